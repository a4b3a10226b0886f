"""The time the loop-side roles read: the host's monotonic clock, or a replay's simulated clock.

Rule: code that runs on an event loop and decides by time (the broker,
node servers, inference bridges, the simulated engine and agent, the
client and the DAPO sampler) reads it with :func:`now` (``timebase.now()``,
looked up on the module at each call), never ``time.monotonic()``
directly. By default :func:`now` *is* ``time.monotonic``. A replay on
simulated time (:func:`run_simulated`) runs all of those roles on one
:class:`SimulatedEventLoop` and points :func:`now` at the loop's clock,
so every timer, timeout and "how long did this take" in that code reads
one clock that only moves when nothing is left to do at the current
instant: which calls share an engine step, how long a tool wait is, when
a deadline fires, none of it depends on how fast this host runs the code.

Wall-clock timestamps meant for people (``time.time()`` in logs, events
and rendezvous files) are not time the roles decide by, and stay as they are.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from prorl_cli.node.loop import CheckedEventLoop

T = TypeVar("T")

#: Where a simulated clock starts: the same instant every run (so two runs' ledgers match to the last
#: digit), far from 0 (code that treats 0 as "never" keeps working).
SIMULATED_START_S = 1_000_000.0

#: The clock the loop-side roles read (seconds, monotonic). Rebound by :func:`use`.
now: Callable[[], float] = time.monotonic


def monotonic() -> float:
    """:func:`now`, looked up at each call: for what keeps a callable (a dataclass's ``default_factory``)."""
    return now()


def use(source: Callable[[], float] | None) -> None:
    """Point :func:`now` at ``source`` (``None``: back to ``time.monotonic``)."""
    global now
    now = source if source is not None else time.monotonic


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that, with nothing ready, moves its loop's clock to the next timer instead of sleeping.

    I/O is always looked at first (a zero-timeout select): messages between
    the roles (ZeroMQ ``inproc`` sockets, which signal the receiver as the
    sender sends) are handled at the instant they were sent. Only when no
    descriptor is ready, no callback is ready and a timer is pending does
    time move, straight to that timer. With no timer at all the loop waits
    for real: only a thread or a signal can wake it then.
    """

    def __init__(self) -> None:
        super().__init__()
        self.loop: SimulatedEventLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None or self.loop is None:
            return super().select(timeout)
        self.loop.advance(timeout)
        return []


class SimulatedEventLoop(CheckedEventLoop):
    """An event loop on simulated time: :meth:`time` moves only by :meth:`advance`, which its selector calls.

    Starts at :data:`SIMULATED_START_S`.
    """

    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now_s = SIMULATED_START_S
        #: Simulated seconds the loop has jumped over so far.
        self.advanced_s = 0.0

    def time(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward (what a sleeping loop would have waited)."""
        if seconds > 0:
            self._now_s += seconds
            self.advanced_s += seconds


def run_simulated(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a :class:`SimulatedEventLoop`, with :func:`now` reading its clock for the duration."""
    with asyncio.Runner(loop_factory=SimulatedEventLoop) as runner:
        loop = runner.get_loop()
        use(loop.time)
        try:
            return runner.run(main)
        finally:
            use(None)
