"""KV-cache admission: a backend takes a new job only while the jobs it already serves fit in its KV cache.

A multi-turn job's later calls are cheap only if its context is still in
its backend's prefix cache when the next turn comes; a backend given more
live jobs than its KV cache holds evicts the prefixes of jobs that are
between turns (running a tool) and computes them again on their next call:
the GPU stays busy, on work it already did. The router therefore reserves,
per backend, KV for each live job routed there: its context (the prompt and
``max_tokens`` of its latest call), but at least the mean context of the
calls routed so far, since a young job's context is small only for now (a
multi-turn job's context grows by every turn). A *new* job's first call
goes only to a backend where the reservations plus the new job's fit in
``fraction`` of the capacity the backend reports (``kv_capacity_tokens`` in its heartbeat
stats; the simulated engine reports it, a backend that does not is never
limited). A backend with no live job always takes one. A first call that
fits nowhere waits at the broker, in arrival order, until a job ends (and
frees its share), and at most ``max_wait_s``: then it goes to the policy's
choice anyway, so no job waits out its generate timeout here. Calls of jobs
already placed are never held: admission only decides when work starts.
A backend that goes (lost, or it left), or that re-registers loading other
weights, frees every share reserved on it at once: its jobs are placed again
by their next call, as new jobs are.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from prorl_cli import timebase
from prorl_cli.protocol.headers import Generate

#: The heartbeat stat a backend reports its KV-cache size in (tokens).
KV_CAPACITY_STAT = "kv_capacity_tokens"


@dataclass
class WaitingCall:
    """A new job's first call, waiting for a backend with room."""

    since: float
    requester: bytes
    header: Generate
    payload: list[bytes]
    #: Backends lost under it so far (a call routed again waits here like a first call).
    moves: int = 0

    @property
    def job_id(self) -> str:
        return self.header.job_id


def call_tokens(header: Generate, payload: list[bytes] | tuple[bytes, ...]) -> int:
    """The context a call needs in KV: its prompt (int32 ids) and the most it may generate (as the caller set it)."""
    sampling = header.sampling
    max_tokens = sampling.max_tokens if sampling is not None and sampling.is_set("max_tokens") else 0
    return (len(payload[0]) // 4 if payload else 0) + max_tokens


class KvAdmission:
    """Live jobs' contexts per backend, and the first calls waiting for room (see the module docstring)."""

    def __init__(self, fraction: float, max_wait_s: float, clock: Callable[[], float] = timebase.monotonic) -> None:
        self.clock = clock
        #: Share of a backend's reported KV capacity live jobs may fill; 0 turns admission off.
        self.fraction = fraction
        self.max_wait_s = max_wait_s
        self._context: dict[str, tuple[str, int]] = {}  # job id -> (backend id, reserved tokens)
        self._load: dict[str, int] = {}  # backend id -> sum of its jobs' reservations
        #: Mean context of the calls routed so far (exponentially weighted): a new job's expected reservation.
        self.mean_call_tokens = 0.0
        self._calls = 0
        self._waiting: dict[int, WaitingCall] = {}  # insertion order is arrival order
        self._ids = itertools.count()

    @property
    def enabled(self) -> bool:
        return self.fraction > 0

    def __len__(self) -> int:
        return len(self._waiting)

    def reservation(self, tokens: int) -> int:
        """KV reserved for a job whose latest call needs ``tokens``."""
        return max(tokens, int(self.mean_call_tokens))

    def load(self, backend_id: str) -> int:
        """KV tokens reserved for the live jobs on ``backend_id``."""
        return self._load.get(backend_id, 0)

    def has_room(self, backend_id: str, stats: dict[str, float], tokens: int) -> bool:
        """Whether a new job needing ``tokens`` fits on this backend (one with no live job always does)."""
        capacity = stats.get(KV_CAPACITY_STAT)
        if not self.enabled or not capacity:
            return True
        load = self._load.get(backend_id, 0)
        return load == 0 or load + self.reservation(tokens) <= capacity * self.fraction

    def note(self, job_id: str, backend_id: str, tokens: int) -> None:
        """A call of ``job_id`` went to ``backend_id``: its context there is now ``tokens``."""
        self._calls += 1
        # A plain mean over the first hundred calls, then a moving one (the workload may change).
        self.mean_call_tokens += (tokens - self.mean_call_tokens) / min(self._calls, 100)
        self.forget(job_id)
        reserved = self.reservation(tokens)
        self._context[job_id] = (backend_id, reserved)
        self._load[backend_id] = self._load.get(backend_id, 0) + reserved

    def forget(self, job_id: str) -> None:
        """``job_id`` ended (or left its backend): its share is free."""
        old = self._context.pop(job_id, None)
        if old is not None:
            bid, tokens = old
            left = self._load.get(bid, 0) - tokens
            if left > 0:
                self._load[bid] = left
            else:
                self._load.pop(bid, None)

    def forget_backend(self, backend_id: str) -> None:
        """``backend_id`` went (or serves none of its jobs any more): every share reserved on it is free.

        Its jobs' next calls reserve again wherever they are routed, as a new job's first call does.
        """
        for job_id in [j for j, (bid, _) in self._context.items() if bid == backend_id]:
            del self._context[job_id]
        self._load.pop(backend_id, None)

    def wait(self, call: WaitingCall) -> None:
        self._waiting[next(self._ids)] = call

    def take_all(self) -> list[WaitingCall]:
        """Every waiting call, oldest first (the caller routes them or puts them back with :meth:`wait`)."""
        out = list(self._waiting.values())
        self._waiting.clear()
        return out

    def pop_job(self, job_id: str, match: Callable[[WaitingCall], bool] | None = None) -> list[WaitingCall]:
        """The waiting calls of ``job_id`` (it ended), or those of them ``match`` picks (a call its node gave up on)."""
        if not self._waiting:
            return []
        keys = [k for k, c in self._waiting.items() if c.job_id == job_id and (match is None or match(c))]
        return [self._waiting.pop(k) for k in keys]

    def overdue(self) -> bool:
        """Whether the oldest waiting call has waited ``max_wait_s``."""
        first = next(iter(self._waiting.values()), None)
        return first is not None and self.clock() - first.since >= self.max_wait_s
