"""PausableTimer: counts only the time a job spends inside its stages."""

from __future__ import annotations

from prorl_cli import timebase


class PausableTimer:
    """Accumulates running time between :meth:`resume` and :meth:`pause`.

    Queue waits between stages happen while the timer is paused, so they
    never count toward a job's timeout budget.
    """

    def __init__(self, budget_s: float | None = None) -> None:
        self.budget_s = budget_s
        self._elapsed_s = 0.0
        self._started: float | None = None

    def resume(self) -> None:
        if self._started is None:
            self._started = timebase.now()

    def pause(self) -> float:
        """Stop counting; return the seconds counted in the run just ended."""
        if self._started is None:
            return 0.0
        ran = timebase.now() - self._started
        self._elapsed_s += ran
        self._started = None
        return ran

    @property
    def elapsed_s(self) -> float:
        extra = timebase.now() - self._started if self._started is not None else 0.0
        return self._elapsed_s + extra

    @property
    def remaining_s(self) -> float | None:
        """Budget left (never negative), or ``None`` with no budget."""
        if self.budget_s is None:
            return None
        return max(0.0, self.budget_s - self.elapsed_s)
