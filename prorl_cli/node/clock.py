"""A job's clock on its node: in-stage time against its budget, the deadline of the stage it is in, holds.

One object per job (it was a timer, a deadline and a wrapper of both: three
objects and a chain of calls per stage, on the node's hot path). Time counts
only inside a stage and not while one of the job's generate calls is held at
the broker (generation paused): queue waits and held time count neither
against the job's budget nor against a stage's limit.

The deadline is one timer handle per job, armed at the end of the loop turn
in which a stage began (by :class:`Arming`), at that stage's own deadline,
and only if the job is still in a stage by then: a job whose stages all
finish without waiting never gets one. A later stage whose deadline is no
earlier than the armed one keeps the handle (a job that runs its stages back
to back has one deadline: its budget); a handle that fires before the
current stage's deadline (it was armed for an earlier one) is armed again;
it does nothing while the job is between stages or held. When it fires in a
stage it cancels the job's task and says so (:attr:`JobClock.expired`), so a
timeout is told apart from a cancel from outside.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prorl_cli import timebase


class JobClock:
    """In-stage time (:attr:`elapsed_s`, against ``budget_s``) and the current stage's deadline of one job."""

    __slots__ = ("task", "loop", "arming", "budget_s", "in_stage", "held", "expired", "at", "on_expire",
                 "_elapsed_s", "_stage_base_s", "_started", "_handle", "_handle_at", "_queued", "_held_left_s")

    def __init__(self, budget_s: float | None, task: asyncio.Task[Any] | None, loop: asyncio.AbstractEventLoop,
                 arming: Arming) -> None:
        #: The job's task: what the deadline cancels.
        self.task = task
        self.loop = loop
        self.arming = arming
        #: The job's in-stage budget (``None``: none).
        self.budget_s = budget_s
        self.in_stage = False
        #: One of the job's generate calls is held at the broker: no time counts.
        self.held = False
        #: Whether the deadline fired in the current stage.
        self.expired = False
        #: The current stage's deadline (loop time), ``None`` between stages, without a limit, or while held.
        self.at: float | None = None
        #: Called right after the deadline cancelled the task (the pipeline watches that the stage really ends).
        self.on_expire: Callable[[], None] | None = None
        self._elapsed_s = 0.0
        #: ``_elapsed_s`` when the current stage began.
        self._stage_base_s = 0.0
        #: When counting began (``timebase.now()``), ``None`` while not counting.
        self._started: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = 0.0
        self._queued = False
        #: Seconds the stage had left when a hold began; ``None`` otherwise.
        self._held_left_s: float | None = None

    # ----------------------------------------------------------------- time

    @property
    def elapsed_s(self) -> float:
        """In-stage seconds so far (held time not counted)."""
        started = self._started
        return self._elapsed_s if started is None else self._elapsed_s + timebase.now() - started

    @property
    def remaining_s(self) -> float | None:
        """Budget left (never negative), or ``None`` without a budget."""
        if self.budget_s is None:
            return None
        started = self._started
        elapsed_s = self._elapsed_s if started is None else self._elapsed_s + timebase.now() - started
        return max(0.0, self.budget_s - elapsed_s)

    # --------------------------------------------------------------- stages

    def enter_stage(self, limit_s: float | None, now: float) -> None:
        """A stage begins at ``now`` (``timebase.now()``), with ``limit_s`` of in-stage time (``None``: no limit)."""
        self.in_stage = True
        self.expired = False
        self._held_left_s = None
        self._stage_base_s = self._elapsed_s if self._started is None else self.elapsed_s
        if self.held:
            # Held from the start: the stage's whole limit waits for the release.
            self.at = None
            self._held_left_s = limit_s
            return
        self._started = now
        if limit_s is None:
            self.at = None
        else:
            self._set_at(now + limit_s)

    def leave_stage(self, now: float) -> float:
        """The stage ended at ``now``: stop counting and disarm (a handle that fires later does nothing).

        A stage that ended past its deadline is :attr:`expired` even if the
        timer never got a turn to fire (the stage did not yield long enough):
        a limit holds however the stage spent its time.
        Returns the seconds the stage counted (held time not included).
        """
        if self.at is not None and now >= self.at:
            self.expired = True
        self.in_stage = False
        self.at = None
        self._held_left_s = None
        started = self._started
        if started is not None:
            self._elapsed_s += now - started
            self._started = None
        return self._elapsed_s - self._stage_base_s

    def hold(self, held: bool) -> None:
        """Stop (``held``) or restart the clock while one of the job's generate calls is held at the broker."""
        if held == self.held:
            return
        self.held = held
        if not self.in_stage:
            return
        now = timebase.now()
        if held:
            if self._started is not None:
                self._elapsed_s += now - self._started
                self._started = None
            if self.at is not None:
                self._held_left_s = max(0.0, self.at - now)
                self.at = None
        else:
            self._started = now
            if self._held_left_s is not None:
                left, self._held_left_s = self._held_left_s, None
                self._set_at(now + left)

    def close(self) -> None:
        """The job ended: cancel the handle."""
        self.at = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    # ------------------------------------------------------------- deadline

    def _set_at(self, at: float) -> None:
        self.at = at
        if not self._queued and (self._handle is None or self._handle_at > at):
            self._queued = True
            self.arming.add(self)

    def arm(self) -> None:
        """Arm (or re-arm earlier) for the current stage's deadline, if the job is still in a stage."""
        self._queued = False
        at = self.at
        if at is None or (self._handle is not None and self._handle_at <= at):
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle_at = at
        self._handle = self.loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self.at is None:
            return
        if self._handle_at < self.at:
            self.arm()
            return
        self.expired = True
        if self.task is not None:
            self.task.cancel()
        if self.on_expire is not None:
            self.on_expire()


class Arming:
    """Arms the deadlines of the jobs that entered a stage in this loop turn, once, at its end."""

    __slots__ = ("_waiting", "_scheduled")

    def __init__(self) -> None:
        self._waiting: list[JobClock] = []
        self._scheduled = False

    def add(self, clock: JobClock) -> None:
        self._waiting.append(clock)
        if not self._scheduled:
            self._scheduled = True
            clock.loop.call_soon(self._arm_all)

    def _arm_all(self) -> None:
        self._scheduled = False
        waiting, self._waiting = self._waiting, []
        for clock in waiting:
            clock.arm()
