"""The node's event loop: refuses timer values that would corrupt asyncio's timer heap.

A NaN deadline compares false with everything, so once a NaN timer is in the
heap, ``heapq`` can no longer keep it ordered: other jobs' timeouts fire late
and heartbeats stop. ``asyncio.sleep(float("nan"))`` in one handler was
enough. This loop raises :class:`~prorl_cli.exceptions.InvalidTimer` in the
caller instead (the handler's stage fails with a clear error), so nothing
non-finite ever reaches the heap.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from contextvars import Context
from typing import Any, TypeVar, TypeVarTuple

from prorl_cli.exceptions import InvalidTimer

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


def _check(what: str, value: float) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidTimer(f"{what} must be a finite number of seconds, got {value!r}")


class CheckedEventLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``call_later``/``call_at`` refuse NaN and infinite times."""

    def call_later(self, delay: float, callback: Callable[[*Ts], object], *args: *Ts,
                   context: Context | None = None) -> asyncio.TimerHandle:
        _check("a timer delay", delay)
        return super().call_later(delay, callback, *args, context=context)

    def call_at(self, when: float, callback: Callable[[*Ts], object], *args: *Ts,
                context: Context | None = None) -> asyncio.TimerHandle:
        _check("a timer deadline", when)
        return super().call_at(when, callback, *args, context=context)


def run_checked(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on a :class:`CheckedEventLoop`."""
    with asyncio.Runner(loop_factory=CheckedEventLoop) as runner:
        return runner.run(main)
