"""The broker's tables: jobs and nodes, and the send function its parts share.

Plain data; the job table and the node membership mutate them (backends: ``broker/backends.py``).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prorl_cli import timebase
from prorl_cli.protocol import JobSpec, JobState, NodeStatus

_seq = itertools.count()

#: ``send(identity, header, payload) -> bool``: False when the peer is gone (the broker's ``_send``).
SendFn = Callable[[bytes, dict[str, Any], "list[bytes] | tuple[bytes, ...]"], bool]


def instance_digest(instance: bytes) -> bytes:
    """A job instance's digest (its packed bytes, as the client sent them)."""
    return hashlib.blake2b(instance, digest_size=16).digest()


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
    #: The node and attempt that may claim this job back while it waits in the queue: the node it was
    #: placed on when that node was declared dead, or (after a journal replay) the placement the journal recorded.
    claim_node: str | None = None
    claim_attempt: int | None = None
    #: When the broker accepted the job, and when it last entered the queue (monotonic; a replay restarts them).
    submitted_at: float = field(default_factory=timebase.monotonic)
    queued_at: float = field(default_factory=timebase.monotonic)
    #: The broker's timeline events of the job (``prorl_cli/observe/timeline.py``); sent with each assignment.
    #: The first one carries the wall-clock time of submission (``at``, epoch seconds): traces line jobs up by it.
    events: list[list[Any]] = field(default_factory=lambda: [["submitted", 0.0, 0.0, {"at": round(time.time(), 6)}]])
    #: A job cancelled while it ran: until then (monotonic) its result waits for the node's own, which
    #: carries what the job did so far (its partial trajectory); after it, the broker's result goes out.
    partial_until: float | None = None
    #: The instance's digest, kept once the instance is dropped (a finished job): a resubmission under the same
    #: id is the same work only with the same bytes.
    instance_digest: bytes = b""

    def __post_init__(self) -> None:
        if not self.instance_digest and self.instance:
            self.instance_digest = instance_digest(self.instance)

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def retained_bytes(self) -> int:
        """What this job holds in memory (its instance and its result)."""
        return len(self.instance) + (len(self.result) if self.result is not None else 0)


@dataclass
class Node:
    """A registered node server."""

    node_id: str
    identity: bytes
    host: str
    pid: int
    credit: int
    tasks: set[str]
    last_seen: float = field(default_factory=timebase.monotonic)
    inflight: set[str] = field(default_factory=set)
    stages: dict[str, dict[str, int]] = field(default_factory=dict)
    alive: bool = True
    #: Sent with ``register``; heartbeats carrying it (from any connection: the node's sidecar) keep the node alive.
    liveness_token: str | None = None
    died_at: float | None = None
    #: The sandbox runtime the node picked, from its ``register`` (shown in ``status``).
    sandbox_runtime: str | None = None
    #: Why it was declared lost (shown in ``status``).
    lost_reason: str | None = None
    #: Sent ``release``: its running jobs finish, nothing new is placed on it.
    draining: bool = False

    @property
    def free(self) -> int:
        return self.credit - len(self.inflight) if self.alive and not self.draining else 0

    def status(self, now: float | None = None) -> NodeStatus:
        now = timebase.now() if now is None else now
        return NodeStatus(
            node_id=self.node_id,
            host=self.host,
            pid=self.pid,
            alive=self.alive,
            credit=self.credit,
            inflight=len(self.inflight),
            tasks=sorted(self.tasks),
            stages=self.stages,
            sandbox_runtime=self.sandbox_runtime,
            silent_s=round(max(0.0, now - self.last_seen), 3) if self.alive else 0.0,
            lost_reason=self.lost_reason,
            draining=self.draining,
        )


class TaskQueues:
    """Queued job ids per task, FIFO by submission across tasks; removing any job is O(1)."""

    def __init__(self) -> None:
        # Insertion-ordered dicts used as ordered sets: O(1) push at either end, pop and remove.
        self._queues: dict[str, OrderedDict[str, None]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, task: str, job_id: str, front: bool = False) -> None:
        q = self._queues.setdefault(task, OrderedDict())
        if job_id in q:
            return
        q[job_id] = None
        if front:
            q.move_to_end(job_id, last=False)
        self._count += 1

    def remove(self, task: str, job_id: str) -> bool:
        q = self._queues.get(task)
        if q is None or job_id not in q:
            return False
        del q[job_id]
        self._count -= 1
        return True

    def waiting(self) -> dict[str, int]:
        """Queued jobs per task, for the tasks that have any."""
        return {task: len(q) for task, q in self._queues.items() if q}

    def pop_oldest(self, tasks: set[str], jobs: dict[str, Job]) -> str | None:
        """The oldest queued job among ``tasks`` (None if none)."""
        best: str | None = None
        best_task = ""
        best_seq = -1
        for task in tasks:
            q = self._queues.get(task)
            if q:
                head = next(iter(q))
                seq = jobs[head].seq
                if best is None or seq < best_seq:
                    best, best_task, best_seq = head, task, seq
        if best is not None:
            del self._queues[best_task][best]
            self._count -= 1
        return best
