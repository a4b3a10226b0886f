"""Why jobs did not finish: failed results grouped by stage, error type and the first line of the message.

One grouping for every place that reports failures, so they all name a failure the same way: ``prorl
submit``'s summary (:func:`prorl_cli.cli.jobs.collect.print_failures`) and the DAPO sampler's error when its
rollouts keep failing (:class:`prorl_cli.exceptions.RolloutsFailing`). Jobs that ended done although their agent
ended in an error (:func:`agent_error_key`: an agent harness that exited non-zero, a conversation past the
model's context, an agent stopped at its time limit) are grouped the same way, by their trajectory's error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prorl_cli.protocol import JobResult

#: A message is grouped (and shown) by its first line, cut to this many characters.
MESSAGE_CHARS = 300


def failure_key(result: JobResult) -> tuple[str, str, str]:
    """``(stage, error type, first message line)`` of a result that did not finish: what groups it with others."""
    error = result.error if isinstance(result.error, dict) else {}
    stage = str(error.get("stage") or result.critical_error or "?")
    kind = str(error.get("type") or result.state)
    lines = str(error.get("message") or "").strip().splitlines()
    return stage, kind, lines[0][:MESSAGE_CHARS] if lines else ""


#: What a trajectory stopped at its time limit says where it names no error of its own (an agent harness killed at
#: its ``timeout_s``).
AGENT_TIMEOUT_MESSAGE = "the agent ran past its time limit and was stopped (its timeout_s)"


def agent_error_key(result: JobResult) -> tuple[str, str, str] | None:
    """``("run", error type, first message line)`` of a job that ended done although its agent ended in an error
    or was stopped at its time limit (its trajectory's ``stop_reason`` is ``error`` or ``timeout``;
    ``trajectory.error`` says why); None for any other result.

    Such a job was scored as its agent left it, so it is a result, not a failure: but a summary that counted it
    as done and said nothing more would not tell a crashed or cut-off agent from a clean run.
    """
    output = result.output
    traj: Any = output.get("trajectory") if isinstance(output, dict) else None
    if result.state != "done" or not isinstance(traj, dict) or traj.get("stop_reason") not in ("error", "timeout"):
        return None
    error: dict[str, Any] = traj["error"] if isinstance(traj.get("error"), dict) else {}
    lines = str(error.get("message") or "").strip().splitlines()
    if traj["stop_reason"] == "timeout" and not error:
        return "run", "timeout", AGENT_TIMEOUT_MESSAGE
    return "run", str(error.get("type") or "error"), lines[0][:MESSAGE_CHARS] if lines else ""


@dataclass
class FailureGroup:
    """Results that failed the same way: in one stage, with one error type and first message line."""

    stage: str
    type: str
    message: str
    count: int
    #: One of the group's job ids, to look up (``prorl inspect``, the job's log).
    example: str

    def describe(self) -> str:
        """``3 job(s) in init: ConfigError: <message> (e.g. <job id>)``."""
        return (f"{self.count} job(s) in {self.stage}: {self.type}" + (f": {self.message}" if self.message else "")
                + f" (e.g. {self.example})")


class FailureGroups:
    """Failed results grouped as they come in, in bounded memory: a count and an example id per group.

    Past ``max_groups`` distinct groups (messages that embed an id or a path can make every failure its own),
    further new ones are only counted (:attr:`other`), so a long run's memory stays flat.
    """

    def __init__(self, max_groups: int = 64,
                 key: Callable[[JobResult], tuple[str, str, str] | None] = failure_key) -> None:
        self.max_groups = max_groups
        #: What groups a result (:func:`failure_key`); a result it gives None for is not counted.
        self.key = key
        self._groups: dict[tuple[str, str, str], FailureGroup] = {}
        #: Failures of groups beyond ``max_groups``.
        self.other = 0

    def add(self, result: JobResult) -> None:
        """Count one result that did not finish under its group."""
        key = self.key(result)
        if key is None:
            return
        group = self._groups.get(key)
        if group is not None:
            group.count += 1
        elif len(self._groups) < self.max_groups:
            self._groups[key] = FailureGroup(*key, count=1, example=result.job_id)
        else:
            self.other += 1

    def clear(self) -> None:
        """Forget every failure counted so far."""
        self._groups.clear()
        self.other = 0

    @property
    def total(self) -> int:
        """Failures counted, in every group."""
        return sum(g.count for g in self._groups.values()) + self.other

    def ranked(self) -> list[FailureGroup]:
        """The groups, the largest first (ties: the first seen first)."""
        return sorted(self._groups.values(), key=lambda g: -g.count)


def group_failures(
    results: Iterable[JobResult], key: Callable[[JobResult], tuple[str, str, str] | None] = failure_key,
) -> list[FailureGroup]:
    """``results`` grouped by ``key``, the largest group first: by :func:`failure_key` (pass only the ones that
    did not finish), or by :func:`agent_error_key` (the done jobs whose agent ended in an error, of any results)."""
    groups = FailureGroups(max_groups=1 << 30, key=key)
    for r in results:
        groups.add(r)
    return groups.ranked()
