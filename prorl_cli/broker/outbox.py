"""What the broker tells peers about jobs: results to the clients that watch them, assignments to nodes.

The job table (``broker/jobs.py``) decides; the :class:`Outbox` batches what
follows from it during one turn of the loop, and the loop sends the batch with
:meth:`Outbox.flush` at the turn's end, once the journal is durable (a client
never hears of a job the journal would lose). Rules:

- A job's result goes to each of its watchers once it is final: when the job
  ends, or, for a job cancelled while it ran, when its node's partial result
  comes or its grace runs out (``Job.partial_until``; the table's ``on_release``).
- Job objects are batched, not ids: a result evicted by retention in the
  same turn still goes out, and a watcher gets each job once per turn.
- Assignments go only to a node still alive; a node that cannot be reached
  is lost (``node_lost``: its jobs are queued again).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.broker.state import Job, Node, SendFn
from prorl_cli.observe.metrics import DeploymentCollector
from prorl_cli.protocol import JobState, Op
from prorl_cli.protocol import headers as H


class Outbox:
    """Results and assignments of one loop turn; ``collector`` counts them (and the broker's own failures)."""

    def __init__(self, send: SendFn, collector: DeploymentCollector) -> None:
        self._send = send
        self.collector = collector
        self._metrics = collector.broker
        #: Watcher -> jobs whose results it gets at the turn's end.
        self.results: dict[bytes, list[Job]] = defaultdict(list)
        #: Node id -> jobs placed on it this turn.
        self.assigns: dict[str, list[Job]] = defaultdict(list)

    def job_finished(self, job: Job) -> None:
        """A job reached a terminal state (the table's ``on_end``): push its result to its watchers."""
        self._metrics.inc("prorl_jobs_finished", (job.spec.task, job.state.value, str(job.spec.attempt)))
        if job.state is JobState.FAILED and job.node_id is None and job.result is not None:
            # Failed by the broker itself (its nodes kept dying): no node will list it among its failures.
            error = P.unpack_obj(job.result).get("error")
            self.collector.note_broker_failure(job.spec.task, error if isinstance(error, dict) else {})
        if job.partial_until is None:  # else it waits for its node's partial result (JobTable.cancel)
            self.deliver(job)

    def deliver(self, job: Job) -> None:
        """Push a job's final result to its watchers."""
        for w in job.watchers:
            self.results[w].append(job)

    def placed(self, placed: list[tuple[Node, Job]]) -> None:
        """Jobs the table placed: each goes to its node, with its timeline's ``assigned`` event."""
        now = timebase.now()
        for node, job in placed:
            self.assigns[node.node_id].append(job)
            job.events.append(["assigned", round(now - job.submitted_at, 6), 0.0, {"node": node.node_id, "attempt": job.spec.attempt}])
            self._metrics.observe("prorl_job_queue_seconds", (job.spec.task,), now - job.queued_at)

    def flush(self, nodes: dict[str, Node], node_lost: Callable[[Node, str], None]) -> None:
        """Send the turn's results, then its assignments (``nodes``: by id; ``node_lost``: for one unreachable)."""
        for identity, finished in self.results.items():
            # Job objects, not ids: a result evicted by retention in this same turn still goes out.
            jobs = list({j.job_id: j for j in finished if j.result is not None}.values())
            if jobs:
                self._send(
                    identity,
                    {"op": Op.RESULT.value, "jobs": [{"job_id": j.job_id, "state": j.state.value} for j in jobs]},
                    [j.result for j in jobs],  # type: ignore[misc]
                )
        self.results.clear()
        for node_id, jobs in self.assigns.items():
            node = nodes.get(node_id)
            if node is None or not node.alive:
                continue
            now = timebase.now()
            # ``timing``: where each job's timeline starts (seconds since it was accepted) and the broker's events.
            timing = [{"since_submit_s": now - j.submitted_at, "events": j.events} for j in jobs]
            if not self._send(
                node.identity,
                H.Assign([j.spec.to_wire() for j in jobs], timing).to_wire(),
                [j.instance for j in jobs],
            ):
                node_lost(node, "unreachable")
        self.assigns.clear()
