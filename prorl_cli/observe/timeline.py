"""Per-job timelines: what happened to a job and when, relative to its submission.

Each job carries a compact list of events in its :class:`~prorl_cli.protocol.JobResult`
(``events``), each ``[name, t_s, dur_s]`` or ``[name, t_s, dur_s, attrs]``: seconds
since the broker accepted the job (on the broker's clock for broker events, on the
node's monotonic clock shifted by the broker's "time since submit" for node events; not rounded, to keep
recording cheap),
a duration (0 for an instant) and a small map. ``docs/observability.md`` lists the names.

Recording must be cheap on the node's hot path: an event is one list append. The
job's :class:`Timeline` is the current one of the job's asyncio task (a context
variable the pipeline sets), so code deep inside a stage (inference, sandboxes,
tools) records into it without being handed it.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from prorl_cli import timebase

#: Event names (the ``name`` of ``[name, t_s, dur_s, attrs]``).
SUBMITTED = "submitted"
QUEUED = "queued"
ASSIGNED = "assigned"
REQUEUED = "requeued"
RECEIVED = "received"  # the node got the assignment
WAIT = "wait"  # a stage pool's queue: attrs {"stage"}
STAGE = "stage"  # in a stage: attrs {"stage"}
GENERATE = "generate"  # attrs {"backend", "prompt", "output", "ok"}
TOOL = "tool"  # attrs {"tool", "ok"}
SANDBOX_START = "sandbox_start"  # attrs {"runtime", "ok"}
SANDBOX_STOP = "sandbox_stop"
FINISHED = "finished"  # attrs {"state"}

Event = list[Any]


class Timeline:
    """The events of one job attempt; ``t0`` is the submission instant on this process's monotonic clock."""

    __slots__ = ("t0", "events")

    def __init__(self, t0: float, events: list[Event] | None = None) -> None:
        self.t0 = t0
        self.events: list[Event] = events if events is not None else []

    def rel(self, at: float) -> float:
        """``at`` (this process's monotonic clock) as seconds since submission."""
        return at - self.t0

    def instant(self, name: str, attrs: dict[str, Any] | None = None, at: float | None = None) -> None:
        t = (timebase.now() if at is None else at) - self.t0
        self.events.append([name, t, 0.0, attrs] if attrs else [name, t, 0.0])

    def span(self, name: str, start: float, end: float, attrs: dict[str, Any] | None = None) -> None:
        """An event from ``start`` to ``end`` (monotonic seconds)."""
        t0 = self.t0
        self.events.append([name, start - t0, end - start, attrs] if attrs else [name, start - t0, end - start])


#: The timeline of the job whose asyncio task runs now (set by the node's pipeline for each job).
CURRENT: ContextVar[Timeline | None] = ContextVar("prorl_job_timeline", default=None)


def current() -> Timeline | None:
    """The running job's timeline, or ``None`` outside a job."""
    return CURRENT.get()


def record_span(name: str, start: float, attrs: dict[str, Any] | None = None) -> None:
    """Record ``name`` from ``start`` until now into the running job's timeline (nothing outside a job)."""
    timeline = CURRENT.get()
    if timeline is not None:
        timeline.span(name, start, timebase.now(), attrs)
