"""The node server: a DEALER to the broker, the stage pipeline, heartbeats.

The broker assigns jobs up to the node's credit; the node runs each through
INIT → RUN → EVAL locally and reports stage changes and results (batched per
event-loop turn). ``SHUTDOWN`` from the broker, SIGTERM or SIGINT cancel
everything, clean up, unregister (so the broker re-queues what was running,
unless it is stopping) and exit.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import signal
import socket
import time
from typing import Any

from prorl_cli import protocol as P
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import ProtocolError
from prorl_cli.node.pipeline import Pipeline
from prorl_cli.node.registry import HandlerRegistry, discover
from prorl_cli.node.services import NodeServices
from prorl_cli.peer import BrokerPeer
from prorl_cli.protocol import ErrorCode, JobResult, JobSpec, JobState, Op
from prorl_cli.rendezvous import read_rendezvous

log = logging.getLogger(__name__)


class NodeServer(BrokerPeer):
    """One node: serves the tasks its registry holds, for one deployment."""

    kind = "node"

    def __init__(
        self,
        config: ProrlConfig,
        node_id: str | None = None,
        address: str | None = None,
        registry: HandlerRegistry | None = None,
    ) -> None:
        host = socket.gethostname()
        super().__init__(
            address=address,
            host=host,
            deployment_dir=config.deployment_dir,
            heartbeat_interval_s=config.broker.heartbeat_interval_s,
            heartbeat_liveness=config.broker.heartbeat_liveness,
        )
        self.config = config
        self.node_id = node_id or f"{host}-{os.getpid()}"
        self.registry = registry or discover(config.node.handler_paths, config.node.tasks or None)
        for err in self.registry.errors:
            log.error("handler load error: %s", err)
        if not self.registry.handlers:
            raise ProtocolError(ErrorCode.UNKNOWN_TASK, "no handlers found; nothing to serve")
        nc = config.node
        self.credit = nc.credit or (nc.n_init + nc.n_run + nc.n_eval)
        self.run_dir = config.deployment_dir / "nodes" / self.node_id
        self.services = NodeServices(self)
        self.pipeline = Pipeline(config, self.registry, self.services, self.node_id, self.run_dir, self._report_stage)
        self._stage_out: dict[str, dict[str, Any]] = {}  # job id -> its latest stage this turn
        self._done_out: list[JobResult] = []
        self._flush_scheduled = False
        self._stop = asyncio.Event()
        self._running: dict[str, tuple[int, str]] = {}  # job id -> (attempt, its latest stage)
        # Results sent but maybe never read: the broker may have died before reading them (or read them
        # as a stranger's after it restarted). They go again after each registration; the broker ignores repeats.
        self._unconfirmed: collections.deque[tuple[float, JobResult]] = collections.deque()

    # ------------------------------------------------------------- the peer

    def register_header(self) -> dict[str, Any]:
        return {
            "op": Op.REGISTER.value,
            "node_id": self.node_id,
            "host": self.host,
            "pid": os.getpid(),
            "credit": self.credit,
            "tasks": self.registry.tasks,
            # What this node still runs: a broker that lost track of it (declared us dead, or restarted) takes it back.
            "running": [{"job_id": j, "attempt": a, "stage": s} for j, (a, s) in self._running.items()],
        }

    def heartbeat_header(self) -> dict[str, Any]:
        # A result is confirmed once the broker has been heard from a whole interval after it went out.
        while self._unconfirmed and self._unconfirmed[0][0] < self._last_heard - self._interval_s:
            self._unconfirmed.popleft()
        return {"op": Op.HEARTBEAT.value, "node_id": self.node_id, "stages": self.pipeline.stats()}

    def unregister_header(self) -> dict[str, Any]:
        return {"op": Op.UNREGISTER.value, "node_id": self.node_id}

    def on_registered(self, reply: dict[str, Any]) -> None:
        log.info("node %s registered with %s: tasks %s, credit %d, running %d",
                 self.node_id, self.address, self.registry.tasks, self.credit, len(self._running))
        for job_id in reply.get("drop") or []:
            task = self.pipeline.tasks.get(job_id)
            if task is not None:
                log.warning("job %s ended or moved to another node meanwhile; dropping it", job_id)
                task.cancel()
        if self._unconfirmed:
            log.info("sending %d recent result(s) again", len(self._unconfirmed))
            self.spawn(self._send_results([r for _, r in self._unconfirmed]))

    def on_shutdown(self) -> None:
        self._stop.set()

    def on_message(self, op: Op, header: dict[str, Any], payload: list[bytes]) -> None:
        if op == Op.ASSIGN:
            self._on_assign(header, payload)
        elif op == Op.CANCEL_JOB:
            for job_id in header.get("job_ids", []):
                task = self.pipeline.tasks.get(job_id)
                if task is not None:
                    task.cancel()
        else:
            log.warning("unexpected op %s from the broker", op.value)

    # ------------------------------------------------------------- results

    def _report_stage(self, spec: JobSpec, stage: str) -> None:
        if spec.job_id in self._running:
            self._running[spec.job_id] = (spec.attempt, stage)
        self._stage_out[spec.job_id] = {"job_id": spec.job_id, "attempt": spec.attempt, "stage": stage}
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush()))

    async def _flush(self) -> None:
        """Send the stage updates and results gathered during this loop turn, batched."""
        self._flush_scheduled = False
        stages_by_job, self._stage_out = self._stage_out, {}
        done, self._done_out = self._done_out, []
        # Short jobs pass several stages in one turn: report only the latest,
        # and nothing for jobs whose result goes out in this same flush.
        finished = {r.job_id for r in done}
        stages = [u for j, u in stages_by_job.items() if j not in finished]
        if stages:
            await self.send({"op": Op.JOB_STAGE.value, "updates": stages})
        if done:
            now = time.monotonic()
            self._unconfirmed.extend((now, r) for r in done)
            await self._send_results(done)

    async def _send_results(self, done: list[JobResult]) -> None:
        await self.send(
            {"op": Op.JOB_DONE.value, "jobs": [{"job_id": r.job_id, "attempt": r.attempt, "state": r.state} for r in done]},
            [P.pack_obj(r.to_wire()) for r in done],
        )

    # ------------------------------------------------------------- lifecycle

    async def serve(self) -> None:
        """Connect, register and serve until told to stop."""
        if self.address is None:
            self.address = read_rendezvous(self.config.deployment_dir).address
            self.follow_rendezvous = True
        self.connect(linger_ms=2000, unbounded=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self.services.start()
        self.start_loops()
        try:
            await self.register()
            await self._stop.wait()
        finally:
            await self._shutdown()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def _shutdown(self) -> None:
        """Cancel every job, clean up, unregister."""
        self._leaving = True
        tasks = list(self.pipeline.tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.node.stop_grace_s)
        await self.services.stop()
        await self.close()
        log.info("node %s stopped", self.node_id)

    def _on_assign(self, header: dict[str, Any], payload: list[bytes]) -> None:
        jobs = header.get("jobs", [])
        for raw, frame in zip(jobs, payload, strict=False):
            try:
                spec = JobSpec.from_wire(raw)
                instance = P.unpack_obj(frame)
            except ProtocolError as e:
                log.error("bad assignment: %s", e)
                continue
            if spec.job_id in self.pipeline.tasks:
                continue  # duplicate delivery
            task = asyncio.create_task(self._run(spec, instance), name=f"job-{spec.job_id}")
            self.pipeline.tasks[spec.job_id] = task
            self._running[spec.job_id] = (spec.attempt, JobState.INIT.value)
            task.add_done_callback(functools.partial(self._cancelled_before_start, spec=spec))

    def _cancelled_before_start(self, task: asyncio.Task[JobResult], *, spec: JobSpec) -> None:
        # A cancel_job read in the same turn as its assign cancels the task before _run starts:
        # nothing ran, but the broker still needs the job's result to free its credit.
        if not task.cancelled() or self.pipeline.tasks.get(spec.job_id) is not task:
            return
        self.pipeline.tasks.pop(spec.job_id, None)
        self._running.pop(spec.job_id, None)
        if not self._leaving:
            self._done_out.append(JobResult(job_id=spec.job_id, task=spec.task, state=JobState.CANCELLED.value,
                                            attempt=spec.attempt, node_id=self.node_id,
                                            group_id=spec.group_id, meta=spec.meta))
            self._schedule_flush()

    async def _run(self, spec: JobSpec, instance: Any) -> JobResult:
        try:
            result = await self.pipeline.run_job(spec, instance)
        finally:
            self.pipeline.tasks.pop(spec.job_id, None)
            self._running.pop(spec.job_id, None)
        if not self._leaving:
            self._done_out.append(result)
            self._schedule_flush()
        return result


def run_node(config: ProrlConfig, node_id: str | None = None, address: str | None = None) -> None:
    """Run a node server in the foreground until it is stopped."""
    asyncio.run(NodeServer(config, node_id=node_id, address=address).serve())
