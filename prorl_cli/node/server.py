"""The node server: a DEALER to the broker, the stage pipeline, heartbeats.

The broker assigns jobs up to the node's credit; the node runs each through
INIT → RUN → EVAL locally and reports stage changes and results (batched per
event-loop turn). ``SHUTDOWN`` from the broker, SIGTERM or SIGINT cancel
everything, clean up, unregister (so the broker re-queues what was running,
unless it is stopping) and exit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import time
from typing import Any

import zmq
import zmq.asyncio

from prorl_cli import protocol as P
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import BrokerUnavailable, ProtocolError
from prorl_cli.node.pipeline import Pipeline
from prorl_cli.node.registry import HandlerRegistry, discover
from prorl_cli.node.services import NodeServices
from prorl_cli.protocol import ErrorCode, JobResult, JobSpec, Op
from prorl_cli.rendezvous import read_rendezvous
from prorl_cli.security import secure_peer

log = logging.getLogger(__name__)


class NodeServer:
    """One node: serves the tasks its registry holds, for one deployment."""

    def __init__(
        self,
        config: ProrlConfig,
        node_id: str | None = None,
        address: str | None = None,
        registry: HandlerRegistry | None = None,
    ) -> None:
        self.config = config
        self.host = socket.gethostname()
        self.node_id = node_id or f"{self.host}-{os.getpid()}"
        self.address = address
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
        self.sock: zmq.asyncio.Socket | None = None
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], list[bytes]]]] = {}
        self._stage_out: dict[str, dict[str, Any]] = {}  # job id -> its latest stage this turn
        self._done_out: list[JobResult] = []
        self._flush_scheduled = False
        self._stop = asyncio.Event()
        self._registered = asyncio.Event()
        self._last_heard = time.monotonic()
        self._interval_s = config.broker.heartbeat_interval_s
        self._liveness = config.broker.heartbeat_liveness
        self._leaving = False

    # ----------------------------------------------------------------- I/O

    async def _send(self, header: dict[str, Any], payload: list[bytes] | tuple[bytes, ...] = ()) -> None:
        assert self.sock is not None
        await self.sock.send_multipart(P.encode(header, payload), copy=False)

    async def request(self, header: dict[str, Any], payload: list[bytes] | tuple[bytes, ...] = ()) -> tuple[dict[str, Any], list[bytes]]:
        """Send a request to the broker and await its reply (header, payload)."""
        rid = next(self._rids)
        fut: asyncio.Future[tuple[dict[str, Any], list[bytes]]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._send({**header, "rid": rid, "host": self.host}, payload)
            return await fut
        finally:
            self._pending.pop(rid, None)

    async def notify(self, header: dict[str, Any]) -> None:
        """Send the broker a message that gets no reply."""
        await self._send({**header, "host": self.host})

    def _report_stage(self, spec: JobSpec, stage: str) -> None:
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
            await self._send({"op": Op.JOB_STAGE.value, "updates": stages})
        if done:
            await self._send(
                {"op": Op.JOB_DONE.value, "jobs": [{"job_id": r.job_id, "attempt": r.attempt, "state": r.state} for r in done]},
                [P.pack_obj(r.to_wire()) for r in done],
            )

    # ------------------------------------------------------------- lifecycle

    async def serve(self) -> None:
        """Connect, register and serve until told to stop."""
        if self.address is None:
            self.address = read_rendezvous(self.config.deployment_dir).address
        ctx = zmq.asyncio.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        secure_peer(self.sock, self.config.deployment_dir)
        self.sock.connect(self.address)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self.services.start()
        receiver = asyncio.create_task(self._receive(), name="receive")
        beater = asyncio.create_task(self._heartbeat(), name="heartbeat")
        try:
            await self._register()
            await self._stop.wait()
        finally:
            await self._shutdown()
            receiver.cancel()
            beater.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            self.sock.close()

    async def _register(self) -> None:
        self._registered.clear()
        header = {
            "op": Op.REGISTER.value,
            "node_id": self.node_id,
            "host": self.host,
            "pid": os.getpid(),
            "credit": self.credit,
            "tasks": self.registry.tasks,
        }
        deadline_s = max(10.0, self._interval_s * self._liveness * 3)
        try:
            reply, _ = await asyncio.wait_for(self.request(header), deadline_s)
        except TimeoutError as e:
            raise BrokerUnavailable(f"broker at {self.address} did not answer register within {deadline_s:.0f} s") from e
        if not reply.get("ok"):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"broker refused register: {reply.get('error')}")
        self._interval_s = float(reply.get("heartbeat_interval_s", self._interval_s))
        self._liveness = int(reply.get("heartbeat_liveness", self._liveness))
        self._last_heard = time.monotonic()
        self._registered.set()
        log.info("node %s registered with %s: tasks %s, credit %d", self.node_id, self.address, self.registry.tasks, self.credit)

    async def _shutdown(self) -> None:
        """Cancel every job, clean up, unregister."""
        self._leaving = True
        tasks = list(self.pipeline.tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.node.stop_grace_s)
        await self.services.stop()
        try:
            await asyncio.wait_for(self._send({"op": Op.UNREGISTER.value, "node_id": self.node_id}), 1.0)
        except TimeoutError:
            log.warning("could not send unregister to the broker")
        log.info("node %s stopped", self.node_id)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            if self._registered.is_set():
                await self._send({"op": Op.HEARTBEAT.value, "node_id": self.node_id, "stages": self.pipeline.stats()})
            if time.monotonic() - self._last_heard > self._interval_s * self._liveness:
                # The broker went silent: register again (a restarted broker learns of us).
                log.warning("broker silent for %.1f s; registering again", time.monotonic() - self._last_heard)
                self._last_heard = time.monotonic()
                asyncio.ensure_future(self._reregister())

    async def _reregister(self) -> None:
        try:
            await self._register()
        except (BrokerUnavailable, ProtocolError) as e:
            log.error("re-register failed: %s", e)

    # --------------------------------------------------------------- receive

    async def _receive(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            self._last_heard = time.monotonic()
            try:
                header = P.decode_header(frames[0])
            except ProtocolError as e:
                log.error("bad frame from the broker: %s", e)
                continue
            op = header["op"]
            payload = frames[1:]
            if op == Op.REPLY:
                fut = self._pending.get(header.get("rid"))  # type: ignore[arg-type]
                if fut is not None and not fut.done():
                    fut.set_result((header, payload))
                elif not header.get("ok") and (header.get("error") or {}).get("code") == ErrorCode.UNKNOWN_PEER.value:
                    if not self._leaving:
                        asyncio.ensure_future(self._reregister())
                elif not header.get("ok"):
                    log.warning("broker error: %s", header.get("error"))
            elif op == Op.ASSIGN:
                self._on_assign(header, payload)
            elif op == Op.CANCEL_JOB:
                for job_id in header.get("job_ids", []):
                    task = self.pipeline.tasks.get(job_id)
                    if task is not None:
                        task.cancel()
            elif op == Op.SHUTDOWN:
                log.info("broker asked this node to shut down")
                self._stop.set()
            elif op == Op.HEARTBEAT:
                pass
            else:
                log.warning("unexpected op %s from the broker", op.value)

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

    async def _run(self, spec: JobSpec, instance: Any) -> JobResult:
        try:
            result = await self.pipeline.run_job(spec, instance)
        finally:
            self.pipeline.tasks.pop(spec.job_id, None)
        if not self._leaving:
            self._done_out.append(result)
            self._schedule_flush()
        return result


def run_node(config: ProrlConfig, node_id: str | None = None, address: str | None = None) -> None:
    """Run a node server in the foreground until it is stopped."""
    asyncio.run(NodeServer(config, node_id=node_id, address=address).serve())
