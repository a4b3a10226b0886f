"""The broker's tables: jobs and nodes. Plain data; the server mutates them (backends: ``routing``)."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from prorl_cli.protocol import JobSpec, JobState, NodeStatus

_seq = itertools.count()


@dataclass
class Job:
    """One job as the broker tracks it. ``instance`` and ``result`` are opaque frames."""

    spec: JobSpec
    instance: bytes
    state: JobState = JobState.QUEUED
    node_id: str | None = None
    watchers: set[bytes] = field(default_factory=set)
    result: bytes | None = None
    seq: int = field(default_factory=lambda: next(_seq))
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def job_id(self) -> str:
        return self.spec.job_id


@dataclass
class Node:
    """A registered node server."""

    node_id: str
    identity: bytes
    host: str
    pid: int
    credit: int
    tasks: set[str]
    last_seen: float = field(default_factory=time.monotonic)
    inflight: set[str] = field(default_factory=set)
    stages: dict[str, dict[str, int]] = field(default_factory=dict)
    alive: bool = True

    @property
    def free(self) -> int:
        return self.credit - len(self.inflight) if self.alive else 0

    def status(self) -> NodeStatus:
        return NodeStatus(
            node_id=self.node_id,
            host=self.host,
            pid=self.pid,
            alive=self.alive,
            credit=self.credit,
            inflight=len(self.inflight),
            tasks=sorted(self.tasks),
            stages=self.stages,
        )


class TaskQueues:
    """Queued job ids per task, FIFO by submission across tasks."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[str]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, task: str, job_id: str, front: bool = False) -> None:
        q = self._queues.setdefault(task, deque())
        if front:
            q.appendleft(job_id)
        else:
            q.append(job_id)
        self._count += 1

    def remove(self, task: str, job_id: str) -> bool:
        q = self._queues.get(task)
        if q is None:
            return False
        try:
            q.remove(job_id)
        except ValueError:
            return False
        self._count -= 1
        return True

    def pop_oldest(self, tasks: set[str], jobs: dict[str, Job]) -> str | None:
        """The oldest queued job among ``tasks`` (None if none)."""
        best: str | None = None
        best_task = ""
        best_seq = -1
        for task in tasks:
            q = self._queues.get(task)
            if q:
                seq = jobs[q[0]].seq
                if best is None or seq < best_seq:
                    best, best_task, best_seq = q[0], task, seq
        if best is not None:
            self._queues[best_task].popleft()
            self._count -= 1
        return best

    def tasks_waiting(self) -> set[str]:
        return {t for t, q in self._queues.items() if q}
