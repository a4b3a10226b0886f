"""The inference bridge: an engine (vLLM, transformers) as a backend of the broker.

A ZeroMQ DEALER connected to the broker. It registers (model, max model
length, host, capacity), heartbeats, serves ``generate`` requests
concurrently up to its capacity, and answers each with ``generate_reply``:
the output ids (int32) and log-probs (float32) as payload frames, or an
error carrying the server's own message. It unregisters on exit; if its
engine dies (a vLLM child exits) it fails what is in flight, unregisters
and stops, so the broker moves those jobs' later calls to other backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from prorl_cli import protocol as P
from prorl_cli.exceptions import InferenceError, ProtocolError
from prorl_cli.inference.contract import Engine
from prorl_cli.protocol import ErrorCode, Op, SamplingParams
from prorl_cli.security import secure_peer

log = logging.getLogger(__name__)


class InferenceBridge:
    """Serves one :class:`Engine` to the broker at ``address`` until stopped."""

    def __init__(
        self,
        engine: Engine,
        *,
        address: str,
        backend_id: str,
        host: str,
        capacity: int = 64,
        engine_check_interval_s: float = 2.0,
        deployment_dir: Path | None = None,
    ) -> None:
        self.engine = engine
        self.address = address
        self.backend_id = backend_id
        self.host = host
        self.capacity = capacity
        self.engine_check_interval_s = engine_check_interval_s
        #: Where the deployment's CURVE keys live (when the broker encrypts); ``None``: plain TCP.
        self.deployment_dir = deployment_dir
        self.ctx = zmq.asyncio.Context.instance()
        self.sock: zmq.asyncio.Socket | None = None
        self._rids = itertools.count(1)
        self._register_rid: str | None = None
        self.registered = asyncio.Event()
        self._stop = asyncio.Event()
        self._interval_s = P.HEARTBEAT_INTERVAL_S
        self._liveness = P.HEARTBEAT_LIVENESS
        self._last_heard = time.monotonic()
        self._slots = asyncio.Semaphore(capacity)
        self._tasks: set[asyncio.Task[None]] = set()
        #: Why the bridge stopped on its own (engine died); ``None`` after a normal stop.
        self.failure: str | None = None

    async def _send(self, header: dict[str, Any], payload: list[bytes] | tuple[bytes, ...] = ()) -> None:
        assert self.sock is not None
        await self.sock.send_multipart(P.encode(header, payload), copy=False)

    async def _register(self) -> None:
        self._register_rid = f"register-{next(self._rids)}"
        self.registered.clear()
        await self._send(
            {
                "op": Op.REGISTER_BACKEND.value,
                "rid": self._register_rid,
                "backend_id": self.backend_id,
                "host": self.host,
                "model": self.engine.model,
                "max_model_len": self.engine.max_model_len,
                "capacity": self.capacity,
            }
        )

    def stop(self) -> None:
        """Ask :meth:`serve` to unregister and return."""
        self._stop.set()

    async def serve(self) -> None:
        """Register, serve until :meth:`stop` (or the engine dies), unregister."""
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        if self.deployment_dir is not None:
            secure_peer(self.sock, self.deployment_dir)
        self.sock.connect(self.address)
        try:
            await self._register()
            loops = [
                asyncio.ensure_future(self._recv_loop()),
                asyncio.ensure_future(self._heartbeat_loop()),
                asyncio.ensure_future(self._engine_watch()),
            ]
            stop_wait = asyncio.ensure_future(self._stop.wait())
            done, _ = await asyncio.wait([*loops, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            for t in [*loops, stop_wait]:
                t.cancel()
            for t in done:
                if t is not stop_wait and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            for t in list(self._tasks):
                t.cancel()
            with contextlib.suppress(zmq.ZMQError):
                await self._send({"op": Op.UNREGISTER.value, "backend_id": self.backend_id})
            self.sock.close(linger=1000)
            self.sock = None

    async def _recv_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            self._last_heard = time.monotonic()
            try:
                header = P.decode_header(frames[0])
            except ProtocolError as e:
                log.warning("ignoring a bad frame from the broker: %s", e)
                continue
            op = header["op"]
            if op == Op.GENERATE:
                task = asyncio.ensure_future(self._serve_generate(header, frames[1:]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif op == Op.REPLY:
                self._on_reply(header)
            elif op == Op.SHUTDOWN:
                log.info("broker asked the bridge to shut down")
                self._stop.set()
            elif op != Op.HEARTBEAT:
                log.debug("ignoring op %s", op.value)

    def _on_reply(self, header: dict[str, Any]) -> None:
        if header.get("rid") == self._register_rid:
            if header.get("ok"):
                self._interval_s = float(header.get("heartbeat_interval_s") or self._interval_s)
                self._liveness = int(header.get("heartbeat_liveness") or self._liveness)
                self.registered.set()
                log.info("registered as backend %s (model %s, max_model_len %s)",
                         self.backend_id, self.engine.model, self.engine.max_model_len)
            else:
                log.error("broker refused registration: %s", header.get("error"))
            return
        err = header.get("error") if isinstance(header.get("error"), dict) else None
        if err and err.get("code") == ErrorCode.UNKNOWN_PEER.value and self.registered.is_set():
            # The broker declared us dead (or restarted): register again.
            log.warning("broker does not know this bridge (%s); registering again", err.get("message"))
            self.registered.clear()
            asyncio.ensure_future(self._register())

    async def _serve_generate(self, header: dict[str, Any], payload: list[bytes]) -> None:
        rid = header.get("rid")
        async with self._slots:
            try:
                if len(payload) != 1:
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"generate needs one prompt frame, got {len(payload)}")
                prompt_ids = P.unpack_tokens(payload[0])
                sampling = SamplingParams.from_wire(header.get("sampling") or {}, what="sampling")
                gen = await self.engine.generate(prompt_ids, sampling)
            except (InferenceError, ProtocolError, ValueError, TypeError) as e:
                code = e.code if isinstance(e, ProtocolError) else ErrorCode.BACKEND_ERROR.value
                message = f"backend {self.backend_id}: {e.message if isinstance(e, ProtocolError) else e}"
                log.warning("generate (job %s) failed: %s", header.get("job_id"), message)
                reply = {"op": Op.GENERATE_REPLY.value, "rid": rid, "error": {"code": code, "message": message}}
                await self._send(reply)
                return
            except Exception as e:  # an engine bug must still answer, or the job would wait out its timeout
                log.exception("generate (job %s) crashed in the engine", header.get("job_id"))
                message = f"backend {self.backend_id}: internal error: {type(e).__name__}: {e}"
                error = {"code": ErrorCode.BACKEND_ERROR.value, "message": message}
                await self._send({"op": Op.GENERATE_REPLY.value, "rid": rid, "error": error})
                return
        await self._send({"op": Op.GENERATE_REPLY.value, "rid": rid, "finish_reason": gen.finish_reason}, gen.payload())

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            silent_s = time.monotonic() - self._last_heard
            if silent_s > self._interval_s * self._liveness:
                log.warning("broker silent for %.1f s; registering again", silent_s)
                self._last_heard = time.monotonic()
                await self._register()
            else:
                await self._send({"op": Op.HEARTBEAT.value, "backend_id": self.backend_id, "inflight": len(self._tasks)})

    async def _engine_watch(self) -> None:
        """Stop serving once the engine is gone: its process died, or 3 health checks in a row failed."""
        failures = 0
        while True:
            await asyncio.sleep(self.engine_check_interval_s)
            if await self.engine.healthy():
                failures = 0
                continue
            failures += 1
            dead = getattr(self.engine, "dead_reason", None)
            if dead or failures >= 3:
                self.failure = f"engine of backend {self.backend_id} is down: {dead or 'health check failed 3 times'}"
                log.error("%s; unregistering", self.failure)
                return
