"""The broker's job table: every job's state machine, placement, claims and retention.

Plain objects, no sockets: the broker's loop feeds it validated messages and
sends what it decides. Unit tests drive it directly (``tests/broker/``).

States: ``queued -> assigned -> init -> run -> eval -> done | failed | cancelled | timed_out``.
``assigned`` is a job placed on a node that has not reported its first stage;
every job with a node (assigned or in a stage) is cancelled on that node.

Who may speak for a job: only the node it is placed on (stage updates,
results, ``register.running`` claims), or, while it waits in the queue, the
node it was on when that node was declared dead, or (after a journal replay)
the node the journal recorded it placed on, and then only for that attempt.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.broker.journal import attempt_record, end_record, job_record, placed_record
from prorl_cli.broker.state import Job, Node, TaskQueues
from prorl_cli.exceptions import ProtocolError
from prorl_cli.protocol import ForgetOutcome, JobResult, JobSpec, JobState
from prorl_cli.protocol.headers import JobEnd, StageUpdate

log = logging.getLogger(__name__)


def _noop(*_: Any) -> None:
    return None


@dataclass
class CancelOutcome:
    """Per-id outcome of a cancel: each known job's state after it, the unknown ids, and what to tell which node."""

    states: dict[str, str] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    by_node: dict[str, list[str]] = field(default_factory=dict)


class JobTable:
    """Jobs, the queue, the nodes' holdings and the finished results kept for late watchers.

    ``record`` receives journal records; ``on_end(job)`` is called when a job
    reaches a terminal state (push its result, unless it waits for its node's
    partial result: ``Job.partial_until``), ``on_release(job)`` when such a
    held result is final, ``on_detach(job_id)`` when a job ends or loses its
    node (its generate calls are released), ``on_requeue(job)`` when a lost
    node's job goes back to the queue. ``partial_grace_s``: how long a
    running job's cancel waits for its node's result (0: not at all).
    """

    def __init__(
        self,
        *,
        retention_count: int = 100_000,
        retention_bytes: int = 1 << 30,
        record: Callable[[dict[str, Any]], None] | None = None,
        on_end: Callable[[Job], None] | None = None,
        on_detach: Callable[[str], None] | None = None,
        on_release: Callable[[Job], None] | None = None,
        on_requeue: Callable[[Job], None] | None = None,
        partial_grace_s: float = 0.0,
    ) -> None:
        self.jobs: dict[str, Job] = {}
        self.queue = TaskQueues()
        self.nodes: dict[str, Node] = {}
        self.retention_count = retention_count
        self.retention_bytes = retention_bytes
        self._finished: OrderedDict[str, int] = OrderedDict()  # job id -> bytes held, oldest first
        self.retained_bytes = 0
        #: Replayed jobs the old broker had placed: only their node may take them until ``claims_until``.
        self.awaiting_claim: dict[str, Job] = {}
        self.claims_until = 0.0
        self._record = record or _noop
        self._on_end = on_end or _noop
        self._on_detach = on_detach or _noop
        self._on_release = on_release or _noop
        self._on_requeue = on_requeue or _noop
        self.partial_grace_s = partial_grace_s
        #: Cancelled jobs whose results wait for their nodes' (``Job.partial_until``).
        self._partials: dict[str, Job] = {}
        #: Jobs finished since this broker started: forgetting or retention never lowers it (rates come from it).
        self.finished_total = 0

    # ------------------------------------------------------------ queries

    @property
    def retained_count(self) -> int:
        return len(self._finished)

    def counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in JobState}
        for job in self.jobs.values():
            counts[job.state.value] += 1
        return counts

    def live_tasks(self) -> set[str]:
        return set().union(*(n.tasks for n in self.nodes.values() if n.alive)) if self.nodes else set()

    def journal_snapshot(self, head: list[dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
        """What a replay needs, as journal records (after ``head``: the broker's other state), for a writer that
        may run in another thread.

        Unfinished jobs' records are built now (their specs still change). Finished jobs are named
        now and read when written, and those dropped meanwhile (retention, ``forget``) are skipped, as
        a later snapshot would: a compaction must not keep alive results the loop has let go of, or
        a broker that finishes results fast holds up to its retention again while it writes.
        """
        unfinished: list[dict[str, Any]] = list(head or ())
        for job in self.jobs.values():
            if job.result is not None:
                continue
            unfinished.append(job_record(job.spec, job.instance))
            if job.node_id is not None:
                unfinished.append(placed_record(job.job_id, job.spec.attempt, job.node_id))
            elif job.job_id in self.awaiting_claim and job.claim_node is not None:
                # Replayed and not yet claimed: its node may still claim it after another restart.
                unfinished.append(placed_record(job.job_id, job.claim_attempt or job.spec.attempt, job.claim_node))
        return self._snapshot_records(unfinished, list(self._finished))

    def _snapshot_records(self, unfinished: list[dict[str, Any]], finished: list[str]) -> Iterator[dict[str, Any]]:
        # Finished first, in retention order: a replay drops the oldest first, as this broker does.
        jobs = self.jobs
        for job_id in finished:
            job = jobs.get(job_id)  # a single dict read: safe beside the loop's writes
            if job is None or job.result is None:
                continue
            yield job_record(job.spec, job.instance)
            yield end_record(job.job_id, job.state, job.result)
        yield from unfinished

    # ------------------------------------------------------------ submit

    def add(self, spec: JobSpec, instance: bytes, watcher: bytes | None = None) -> Job:
        """Accept a new job (its id must be new) and queue it."""
        spec.attempt = 1
        job = Job(spec=spec, instance=instance, watchers={watcher} if watcher is not None else set())
        self.jobs[spec.job_id] = job
        self.queue.push(spec.task, spec.job_id)
        self._record(job_record(spec, instance))
        return job

    def withdraw(self, job_ids: Iterable[str]) -> None:
        """Undo :meth:`add` for jobs accepted this turn and never placed (their submit was refused after all)."""
        for job_id in job_ids:
            job = self.jobs.pop(job_id, None)
            if job is not None:
                self.queue.remove(job.spec.task, job_id)

    def load_replayed(self, jobs: Iterable[Job], claim_window_s: float, now: float | None = None) -> int:
        """Take the jobs a journal replay rebuilt; return how many wait for their node's claim."""
        for job in jobs:
            self.jobs[job.job_id] = job
            if job.state.terminal:
                job.instance = b""
                self._retain(job)
            elif job.claim_node is not None:
                job.state, job.node_id = JobState.QUEUED, None
                self.awaiting_claim[job.job_id] = job
            else:
                job.state, job.node_id = JobState.QUEUED, None
                self.queue.push(job.spec.task, job.job_id)
        self._enforce_retention()
        if self.awaiting_claim:
            self.claims_until = (timebase.now() if now is None else now) + claim_window_s
        return len(self.awaiting_claim)

    # ------------------------------------------------------------ placement

    def place(self, now: float | None = None) -> list[tuple[Node, Job]]:
        """Place queued jobs on live nodes with free credit: the node with most free credit takes the oldest job it runs."""
        now = timebase.now() if now is None else now
        if self.awaiting_claim and now >= self.claims_until:
            self._release_unclaimed()
        out: list[tuple[Node, Job]] = []
        if not len(self.queue):
            return out
        nodes = [n for n in self.nodes.values() if n.alive and n.free > 0]
        while nodes and len(self.queue):
            nodes.sort(key=lambda n: n.free, reverse=True)
            node = nodes[0]
            job_id = self.queue.pop_oldest(node.tasks, self.jobs)
            if job_id is None:
                nodes.pop(0)
                continue
            job = self.jobs[job_id]
            job.node_id = node.node_id
            job.state = JobState.ASSIGNED
            job.claim_node = job.claim_attempt = None
            node.inflight.add(job_id)
            self._record(placed_record(job_id, job.spec.attempt, node.node_id))
            out.append((node, job))
            if node.free <= 0:
                nodes.pop(0)
        return out

    def _release_unclaimed(self) -> None:
        """Replayed jobs whose nodes did not claim them in time run again, each with a new attempt (as after a node
        loss: they may have run there, and a job that keeps taking its node down must still run out of attempts)."""
        jobs = sorted(self.awaiting_claim.values(), key=lambda j: j.seq, reverse=True)
        self.awaiting_claim.clear()
        log.info("%d replayed job(s) were not claimed by their nodes; queueing them again", len(jobs))
        for job in jobs:
            node_id = job.claim_node
            job.claim_node = job.claim_attempt = None
            if job.spec.attempt >= job.spec.max_attempts:
                self.finish_by_broker(job, JobState.FAILED, P.ErrorInfo(
                    stage="node", type="NodeLost",
                    message=f"node {node_id} did not claim the job after the broker restarted; attempt "
                            f"{job.spec.attempt} of {job.spec.max_attempts}"))
                continue
            job.spec.attempt += 1
            self._record(attempt_record(job.job_id, job.spec.attempt))
            self.queue.push(job.spec.task, job.job_id, front=True)

    def _take_back(self, job: Job, node: Node, attempt: int) -> None:
        """Give a waiting job back to the node that may claim it (see the module docstring)."""
        self.queue.remove(job.spec.task, job.job_id)
        self.awaiting_claim.pop(job.job_id, None)
        job.node_id = node.node_id
        job.state = JobState.ASSIGNED
        job.claim_node = job.claim_attempt = None
        if job.spec.attempt != attempt:
            job.spec.attempt = attempt
            self._record(attempt_record(job.job_id, attempt))
        self._record(placed_record(job.job_id, attempt, node.node_id))
        node.inflight.add(job.job_id)

    @staticmethod
    def _claimable_by(job: Job, node: Node, attempt: int) -> bool:
        return (
            job.node_id is None and not job.state.terminal
            and job.claim_node == node.node_id and job.claim_attempt == attempt
        )

    # ------------------------------------------------------------ node reports

    def claim(self, node: Node, running: list[StageUpdate]) -> list[str]:
        """A (re-)registering node's ``running`` list: take back what it may claim; return the ids it must drop."""
        drop: list[str] = []
        for c in running:
            job_id, attempt = c.job_id, c.attempt
            job = self.jobs.get(job_id)
            if job is None or job.state.terminal:
                drop.append(job_id)
                continue
            if job.node_id == node.node_id and job.spec.attempt == attempt:
                pass
            elif self._claimable_by(job, node, attempt):
                self._take_back(job, node, attempt)
            else:
                drop.append(job_id)
                continue
            stage = JobState(c.stage)
            if stage in P.STAGES:
                job.state = stage
            node.inflight.add(job_id)
        if drop:
            log.warning("node %s runs %d job(s) that ended, moved or were never its own; it drops them",
                        node.node_id, len(drop))
        return drop

    def stage(self, node: Node, updates: list[StageUpdate]) -> None:
        """Stage updates from ``node``: only for jobs placed on it, at their current attempt."""
        for upd in updates:
            job = self.jobs.get(upd.job_id)
            if job is None or job.state.terminal or job.node_id != node.node_id or job.spec.attempt != upd.attempt:
                continue
            stage = JobState(upd.stage)
            if stage in P.STAGES:
                job.state = stage

    def done(self, node: Node, infos: list[JobEnd], results: list[bytes]) -> list[Job]:
        """Results from ``node``; returns the jobs they finished (stale and foreign results are ignored)."""
        finished: list[Job] = []
        for info, result in zip(infos, results, strict=True):
            job = self.jobs.get(info.job_id)
            if job is None:
                # Gone already (cancelled, then dropped by retention before its node reported): the node's
                # slot is free all the same. Only its own set is touched, so no node frees another's slot.
                node.inflight.discard(info.job_id)
                continue
            if self._claimable_by(job, node, info.attempt):
                # A result sent before the node was declared dead (or before the broker restarted): take it.
                self._take_back(job, node, info.attempt)
            if job.node_id == node.node_id:
                node.inflight.discard(job.job_id)  # its slot is free, whatever became of the job
            if job.partial_until is not None and job.node_id == node.node_id and job.spec.attempt == info.attempt:
                self._adopt_partial(job, bytes(result))
                continue
            if job.state.terminal or job.node_id != node.node_id or job.spec.attempt != info.attempt:
                continue  # stale: cancelled meanwhile, re-queued elsewhere, or never this node's
            state = JobState(info.state)
            self.finish(job, state if state.terminal else JobState.FAILED, bytes(result))
            finished.append(job)
        return finished

    def node_lost(self, node: Node, why: str, now: float | None = None, *, planned: bool = False) -> None:
        """Declare a node dead; its jobs go back to the front of the queue with a new attempt (or fail).

        ``planned``: it said it was leaving (a drain, a scale-down, ``down``): logged as having left, not
        as a loss, and its ``lost_reason`` says ``left``; whatever it still held is requeued all the same.
        """
        if planned:
            log.info("node %s %s; re-queueing %d job(s)", node.node_id, why, len(node.inflight))
        else:
            log.warning("node %s lost (%s); re-queueing %d job(s)", node.node_id, why, len(node.inflight))
        node.alive = False
        node.died_at = died_at = timebase.now() if now is None else now
        node.lost_reason = why
        node.stages = {}  # what it last reported running is gone with it
        for job_id in sorted(node.inflight, key=lambda j: self.jobs[j].seq if j in self.jobs else 0):
            job = self.jobs.get(job_id)
            if job is None or job.state.terminal or job.node_id != node.node_id:
                continue
            job.node_id = None
            self._on_detach(job_id)
            # A job a leaving node never started (still assigned) spends no attempt: attempts bound what a job
            # may cost the fleet, and several nodes leaving at once (scancel of an array) would otherwise pass
            # one job from node to node until it failed without ever running.
            spends = not (planned and job.state == JobState.ASSIGNED)
            if spends and job.spec.attempt >= job.spec.max_attempts:
                self.finish_by_broker(
                    job, JobState.FAILED,
                    P.ErrorInfo(stage="node", type="NodeLost",
                                message=f"node {node.node_id} {why}; attempt {job.spec.attempt} of {job.spec.max_attempts}"),
                )
                continue
            job.claim_node, job.claim_attempt = node.node_id, job.spec.attempt
            if spends:
                job.spec.attempt += 1
                self._record(attempt_record(job_id, job.spec.attempt))
            job.state = JobState.QUEUED
            job.queued_at = died_at
            job.events.append(["requeued", round(died_at - job.submitted_at, 6), 0.0, {"node": node.node_id, "why": why}])
            self.queue.push(job.spec.task, job_id, front=True)
            self._on_requeue(job)
        node.inflight.clear()

    def release(self, node: Node, job_ids: list[str]) -> list[str]:
        """A draining node hands back jobs it never started: queued again (front, same attempt); return their ids."""
        released = []
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None or job.state.terminal or job.node_id != node.node_id or job_id not in node.inflight:
                continue
            node.inflight.discard(job_id)
            job.node_id = None
            self._on_detach(job_id)
            job.state = JobState.QUEUED
            self._record(attempt_record(job_id, job.spec.attempt))  # placed nowhere now (a replay waits for no claim)
            self.queue.push(job.spec.task, job_id, front=True)
            released.append(job_id)
        return released

    def prune_dead_nodes(self, keep: int) -> list[str]:
        """Forget all but the ``keep`` most recently dead nodes; return the ids forgotten."""
        dead = sorted((n for n in self.nodes.values() if not n.alive), key=lambda n: n.died_at or 0.0)
        gone = [n.node_id for n in dead[: max(0, len(dead) - keep)]]
        for node_id in gone:
            del self.nodes[node_id]
        return gone

    # ------------------------------------------------------------ client ops

    def cancel(self, job_ids: list[str], why: P.ErrorInfo | None = None) -> CancelOutcome:
        """Cancel the named jobs; every job that has a node is listed under it to be cancelled there.

        ``why``: the broker's own reason (the deployment stopping), kept in each result; a client's cancel has none.
        """
        out = CancelOutcome()
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None:
                out.unknown.append(job_id)
                continue
            if not job.state.terminal:
                if job.node_id is not None:
                    out.by_node.setdefault(job.node_id, []).append(job_id)
                    if self.partial_grace_s > 0:
                        job.partial_until = timebase.now() + self.partial_grace_s
                        self._partials[job_id] = job
                else:
                    self.queue.remove(job.spec.task, job_id)
                    self.awaiting_claim.pop(job_id, None)
                self.finish_by_broker(job, JobState.CANCELLED, why)
            out.states[job_id] = job.state.value
        return out

    def _adopt_partial(self, job: Job, result: bytes) -> None:
        """A cancelled job's node reported: its result (what the job did until the cancel) replaces the broker's.

        The job stays cancelled whatever the node says (a job that ended as the cancel crossed it
        included): the client was told so, and the journal's end record is rewritten to match.
        """
        try:
            record = P.unpack_obj(result)
        except ProtocolError as e:
            record = e
        if not isinstance(record, dict):
            log.warning("job %s: its node's result after a cancel is unreadable (%s); the broker's stands",
                        job.job_id, record)
        else:
            record["state"] = JobState.CANCELLED.value
            if record.get("error") is None and job.result is not None:
                # The broker's reason for the cancel (its deployment stopping) stays with what the node did.
                own = P.unpack_obj(job.result)
                if isinstance(own, dict) and own.get("error") is not None:
                    record["error"], record["critical_error"] = own["error"], own.get("critical_error")
            job.result = P.pack_obj(record)
            self._record(end_record(job.job_id, JobState.CANCELLED, job.result))
        job.partial_until = None
        self._partials.pop(job.job_id, None)
        self._on_release(job)

    def expire_partials(self, now: float) -> None:
        """Release the held results of cancelled jobs whose node did not report in time (gone, or slow)."""
        for job in [j for j in self._partials.values() if j.partial_until is None or j.partial_until <= now]:
            job.partial_until = None
            del self._partials[job.job_id]
            self._on_release(job)

    def find(self, prefix: str | None, group_id: str | None, after: int = 0, limit: int = P.MAX_LISTED_JOBS) -> tuple[dict[str, str], int | None]:
        """States of the held jobs whose id starts with ``prefix`` and whose group is ``group_id`` (each when given),
        in submission order from ``after`` (a job's ``seq``); the second value pages on (None: no more)."""
        found: dict[str, str] = {}
        for job in self.jobs.values():
            if job.seq < after or (prefix is not None and not job.job_id.startswith(prefix)):
                continue
            if group_id is not None and job.spec.group_id != group_id:
                continue
            if len(found) == limit:
                return found, job.seq
            found[job.job_id] = job.state.value
        return found, None

    def cancel_all(self, why: P.ErrorInfo | None = None) -> CancelOutcome:
        return self.cancel([j.job_id for j in self.jobs.values() if not j.state.terminal], why)

    def forget(self, job_ids: list[str]) -> ForgetOutcome:
        """Drop the retained results (and records) of finished jobs; unfinished ones stay."""
        out = ForgetOutcome()
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None:
                out.unknown.append(job_id)
            elif not job.state.terminal:
                out.running.append(job_id)
            else:
                self._drop_finished(job_id)
                out.forgotten.append(job_id)
        return out

    # ------------------------------------------------------------ finishing

    def finish(self, job: Job, state: JobState, result: bytes) -> None:
        """End ``job`` with ``result`` (a packed JobResult)."""
        job.state = state
        job.result = result
        job.instance = b""  # never run again: only its result is kept
        self.finished_total += 1
        self.awaiting_claim.pop(job.job_id, None)
        self._record(end_record(job.job_id, state, result))
        self._on_detach(job.job_id)
        self._on_end(job)
        self._retain(job)
        self._enforce_retention()

    def finish_by_broker(self, job: Job, state: JobState, error: P.ErrorInfo | None) -> None:
        """Finish a job that no node will report on (cancelled, or lost too often)."""
        result = JobResult(
            job_id=job.job_id,
            task=job.spec.task,
            state=state.value,
            attempt=job.spec.attempt,
            node_id=job.node_id,
            critical_error=error.stage if error else None,
            error=error.to_wire() if error else None,
            group_id=job.spec.group_id,
            meta=job.spec.meta,
            events=[*job.events, ["finished", round(timebase.now() - job.submitted_at, 6), 0.0, {"state": state.value}]],
        )
        self.finish(job, state, P.pack_obj(result.to_wire()))

    def _retain(self, job: Job) -> None:
        size = job.retained_bytes
        self._finished[job.job_id] = size
        self.retained_bytes += size

    def _drop_finished(self, job_id: str) -> None:
        self.retained_bytes -= self._finished.pop(job_id, 0)
        self.jobs.pop(job_id, None)

    def _enforce_retention(self) -> None:
        while self._finished and (
            len(self._finished) > self.retention_count or self.retained_bytes > self.retention_bytes
        ):
            self._drop_finished(next(iter(self._finished)))
