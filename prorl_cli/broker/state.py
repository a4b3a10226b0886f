"""The broker's tables: jobs, nodes, backends. Plain data; the server mutates them."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prorl_cli.protocol import BackendStatus, JobSpec, JobState, NodeStatus

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


@dataclass
class Backend:
    """An inference backend: a bridge peer (``identity``) or a plain HTTP address (``url``)."""

    backend_id: str
    kind: str  # "bridge" | "http"
    identity: bytes | None = None
    url: str | None = None
    host: str | None = None
    model: str | None = None
    max_model_len: int | None = None
    capacity: int = 0
    inflight: int = 0  # generate requests forwarded and not yet answered
    jobs: set[str] = field(default_factory=set)  # live jobs routed here (sticky)
    # HTTP backends: calls redirected to them and not yet reported done, per job.
    redirected: dict[str, int] = field(default_factory=dict)
    served: int = 0
    cleared: bool = False
    alive: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    #: The bridge's engine figures from its last heartbeat (the sim engine: busy fraction, tokens/s, hit rate).
    stats: dict[str, float] = field(default_factory=dict)

    def load_key(self, host: str | None) -> tuple[int, int, int, int]:
        """Least live jobs, then least in-flight requests, then same host first."""
        return (len(self.jobs), self.inflight, 0 if host and host == self.host else 1, self.served)

    def status(self) -> BackendStatus:
        return BackendStatus(
            backend_id=self.backend_id,
            kind=self.kind,
            url=self.url,
            host=self.host,
            model=self.model,
            max_model_len=self.max_model_len,
            inflight=self.inflight,
            jobs=len(self.jobs),
            served=self.served,
            cleared=self.cleared,
            alive=self.alive,
            stats=dict(self.stats),
        )


@dataclass
class PendingGenerate:
    """A generate request forwarded to a bridge, awaiting its reply."""

    requester: bytes
    rid: object
    job_id: str
    backend_id: str


class PendingGenerates:
    """Forwarded generate requests by forward id, indexed by job (a finished job's calls are cancelled)."""

    def __init__(self) -> None:
        self._by_fwd: dict[int, PendingGenerate] = {}
        self._by_job: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._by_fwd)

    def add(self, fwd: int, pend: PendingGenerate) -> None:
        self._by_fwd[fwd] = pend
        self._by_job.setdefault(pend.job_id, set()).add(fwd)

    def pop(self, fwd: object) -> PendingGenerate | None:
        pend = self._by_fwd.pop(fwd, None) if isinstance(fwd, int) else None
        if pend is not None:
            fwds = self._by_job[pend.job_id]
            fwds.discard(fwd)
            if not fwds:
                del self._by_job[pend.job_id]
        return pend

    def pop_job(
        self, job_id: str, match: Callable[[bytes, object], bool] | None = None
    ) -> list[tuple[int, PendingGenerate]]:
        """Remove and return the requests of ``job_id`` (those whose requester and rid ``match``)."""
        fwds = sorted(self._by_job.get(job_id, ()))
        if match is not None:
            fwds = [f for f in fwds if match(self._by_fwd[f].requester, self._by_fwd[f].rid)]
        return [(fwd, pend) for fwd in fwds if (pend := self.pop(fwd)) is not None]

    def pop_backend(self, backend_id: str) -> list[tuple[int, PendingGenerate]]:
        """Remove and return every request forwarded to ``backend_id``."""
        fwds = [fwd for fwd, pend in self._by_fwd.items() if pend.backend_id == backend_id]
        return [(fwd, pend) for fwd in fwds if (pend := self.pop(fwd)) is not None]

    def pop_all(self) -> list[PendingGenerate]:
        out = list(self._by_fwd.values())
        self._by_fwd.clear()
        self._by_job.clear()
        return out


@dataclass
class HeldGenerate:
    """A generate request held while generation is paused or no backend is up."""

    requester: bytes
    header: dict
    payload: list[bytes]


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
