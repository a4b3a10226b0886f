"""The inference bridge: an engine (vLLM, transformers) as a backend of the broker.

A ZeroMQ DEALER connected to the broker. It registers (model, max model
length, host, capacity), heartbeats, serves ``generate`` requests
concurrently up to its capacity, and answers each with ``generate_reply``:
the output ids (int32) and log-probs (float32) as payload frames, or an
error carrying the server's own message. It unregisters on exit; if its
engine dies (a vLLM child exits) it fails what is in flight, unregisters
and stops, so the broker moves those jobs' later calls to other backends.

Weights move in place (``update_weights``): the bridge stops starting new
calls, lets the calls in flight finish on the old weights (their replies
carry the old ``policy_version``), has the engine load the checkpoint
(:meth:`Engine.reload`), then serves again under the new version and
answers ``weights_updated``. An engine that cannot reload answers with an
error (the caller then restarts the backend on the new checkpoint). The
bridge registers with the version it serves (none: the weights it started
on), so a broker whose current weights differ sends it those before any
call (a requeued bridge comes back on its start checkpoint).

A ``generate_cancel`` (the job ended) stops the call wherever it is: one
still waiting for its turn (capacity, or a weight load) is dropped and
never reaches the engine; one in the engine is cancelled there (vLLM
aborts the request, the transformers engine stops before its next token).
The bridge's log line says which. The hot path takes no lock and makes no
thread hop: admission to the engine is a counter and a FIFO of waiters,
touched only from the bridge's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from functools import partial
from pathlib import Path
from typing import Any

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.exceptions import ContextLengthExceeded, InferenceError, ProtocolError
from prorl_cli.inference.contract import CALL_JOB_ID, Engine
from prorl_cli.observe.metrics import MetricSet
from prorl_cli.peer import BrokerPeer
from prorl_cli.protocol import ErrorCode, Op, SamplingParams
from prorl_cli.protocol import headers as H

log = logging.getLogger(__name__)


#: Calls a bridge remembers after they ended, for a cancel that crosses their reply (far more than are ever in flight).
_ENDED_KEPT = 1024

#: Where a call is, as a cancel's log line says it.
_WHERE = {
    "queued": "before it reached the engine (never submitted to it)",
    "engine": "in the engine",
    "answered": "after the engine answered (the reply is dropped)",
}


#: Longest error message a bridge sends (the broker refuses a reply whose message passes the protocol's 64 KiB,
#: and the call would go unanswered): a server's message may echo a whole request.
MAX_ERROR_CHARS = 8192


def _error(code: str, message: str) -> dict[str, str]:
    """An ``error`` field, its message cut to :data:`MAX_ERROR_CHARS`."""
    if len(message) > MAX_ERROR_CHARS:
        cut = len(message) - MAX_ERROR_CHARS
        message = f"{message[:MAX_ERROR_CHARS]}... ({cut} more characters cut)"
    return {"code": code, "message": message}


#: The ops a bridge serves (the broker's forwarded calls); anything else is ignored.
_SERVED = frozenset({Op.GENERATE, Op.UPDATE_WEIGHTS, Op.GENERATE_CANCEL})


class _Call:
    """One generate call at the bridge: its task, and where it is (a key of ``_WHERE``)."""

    __slots__ = ("task", "stage")

    def __init__(self) -> None:
        self.task: asyncio.Future[None] | None = None
        self.stage = "queued"


class InferenceBridge(BrokerPeer):
    """Serves one :class:`Engine` to the broker at ``address`` until stopped."""

    kind = "bridge"

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
        super().__init__(address=address, host=host, deployment_dir=deployment_dir)
        self.engine = engine
        self.backend_id = backend_id
        self.capacity = capacity
        self.engine_check_interval_s = engine_check_interval_s
        self._stop = asyncio.Event()
        self._generating: dict[Any, _Call] = {}  # forward id -> its call
        #: The forward ids of the last calls that ended here: a cancel that crossed a call's reply is named as such
        #: in the log, not dropped without a word (the log is where a cancel is followed).
        self._ended: collections.OrderedDict[Any, None] = collections.OrderedDict()
        #: Why the bridge stopped on its own (engine died); ``None`` after a normal stop.
        self.failure: str | None = None
        #: The weights version the engine serves (from the last ``update_weights``); ``None`` until one came.
        self.policy_version: int | None = None
        #: Calls admitted to the engine (at most ``capacity``); later ones wait in ``_waiting``, first come first
        #: served. While weights load (``_loading``) none is admitted, and ``_idle`` resolves once none is inside.
        self._serving = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._loading = False
        self._idle: asyncio.Future[None] | None = None
        self._reload_lock = asyncio.Lock()
        #: Prometheus figures, sent in every heartbeat (the broker serves them).
        self.metrics = MetricSet()

    # ------------------------------------------------------------- the peer

    def register_header(self) -> dict[str, Any]:
        # policy_version: the weights it serves (a broker whose current weights differ sends them before any call).
        return H.RegisterBackend(H.NEW_RID, self.backend_id, self.host, self.engine.model,
                                 max_model_len=self.engine.max_model_len, capacity=self.capacity,
                                 policy_version=self.policy_version).to_wire()

    def heartbeat_header(self) -> dict[str, Any]:
        stats = self.engine.stats()  # str -> number; the broker shows them in status
        self.metrics.set("prorl_bridge_inflight", (), float(len(self._generating)))
        return H.Heartbeat(backend_id=self.backend_id, inflight=len(self._generating), stats=stats or None,
                           metrics=self.metrics.to_wire()).to_wire()

    def unregister_header(self) -> dict[str, Any]:
        # reason: its engine died (a loss); without a reason it left on purpose.
        return H.Unregister(backend_id=self.backend_id, reason=self.failure or None).to_wire()

    def on_registered(self, reply: dict[str, Any]) -> None:
        log.info("registered as backend %s (model %s, max_model_len %s)", self.backend_id, self.engine.model, self.engine.max_model_len)

    def on_shutdown(self) -> None:
        self._stop.set()

    def on_message(self, op: Op, header: dict[str, Any], payload: list[bytes]) -> None:
        if op not in _SERVED:
            log.debug("ignoring op %s", op.value)
            return
        try:
            h = P.parse(header, len(payload))  # the one check of every field; what follows reads attributes
        except ProtocolError as e:
            self._refuse(op, header, e)
            return
        if isinstance(h, H.Generate):
            call = _Call()
            call.task = task = asyncio.ensure_future(self._serve_generate(call, h, payload[0]))
            self._generating[h.rid] = call
            task.add_done_callback(partial(self._call_done, h.rid))
        elif isinstance(h, H.UpdateWeights):
            self.spawn(self._update_weights(h))
        elif isinstance(h, H.GenerateCancel):
            # The job ended: stop its call wherever it is. The broker expects no reply.
            ending = self._generating.get(h.rid)
            if ending is not None and ending.task is not None:
                log.info("generate for job %s cancelled %s: the job ended", h.job_id, _WHERE[ending.stage])
                ending.task.cancel()
            elif h.rid in self._ended:
                log.info("generate for job %s cancelled after it ended here (its reply crossed the cancel): "
                         "nothing to stop", h.job_id)

    def _refuse(self, op: Op, header: dict[str, Any], e: ProtocolError) -> None:
        """Answer a malformed request with an error naming the field (the rid is echoed as given)."""
        rid = header.get("rid")
        if op == Op.GENERATE:
            self.spawn(self._answer_error(rid, str(header.get("job_id")), e))
        elif op == Op.UPDATE_WEIGHTS:
            log.error("weights not updated: %s", e.message)
            self.spawn(self.send({"op": Op.WEIGHTS_UPDATED.value, "rid": rid,
                                  "error": _error(e.code, f"backend {self.backend_id}: {e.message}")}))
        else:
            log.warning("ignoring a malformed %s: %s", op.value, e.message)

    # ------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Ask :meth:`serve` to unregister and return."""
        self._stop.set()

    async def serve(self) -> None:
        """Register, serve until :meth:`stop` (or the engine dies), unregister.

        Registration runs in the background: a bridge may come up before its
        broker, and keeps registering until the broker answers.
        """
        self.connect(linger_ms=1000)
        try:
            self.spawn(self.register_again())
            loops = [*self.start_loops(), asyncio.ensure_future(self._engine_watch())]
            stop_wait = asyncio.ensure_future(self._stop.wait())
            done, _ = await asyncio.wait([*loops, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            for t in [*loops, stop_wait]:
                t.cancel()
            for t in done:
                if t is not stop_wait and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            for call in list(self._generating.values()):
                if call.task is not None:
                    call.task.cancel()
            await self.close()

    def _call_done(self, rid: Any, _: asyncio.Future[None]) -> None:
        if self._generating.pop(rid, None) is not None:
            self._ended[rid] = None
            while len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)

    async def _update_weights(self, h: H.UpdateWeights) -> None:
        """Load new weights between calls: in-flight calls finish on the old ones, new ones wait."""
        checkpoint, version = h.checkpoint, h.policy_version
        reply = H.WeightsUpdated(h.rid)
        async with self._reload_lock:
            try:
                self._loading = True
                if self._serving:
                    self._idle = asyncio.get_running_loop().create_future()
                    await self._idle
                log.info("loading weights from %s as policy version %d", checkpoint, version)
                await self.engine.reload(checkpoint, version)
                self.policy_version = version
            except (InferenceError, ProtocolError, OSError, ValueError, RuntimeError) as e:
                message = f"backend {self.backend_id}: {e.message if isinstance(e, ProtocolError) else e}"
                log.error("weights not updated: %s", message)
                reply.error = _error(ErrorCode.RELOAD_FAILED.value, message)
            except Exception as e:  # an engine bug (a torn checkpoint's loader error) must still answer the update
                log.exception("weights not updated: loading %s crashed in the engine", checkpoint)
                reply.error = _error(ErrorCode.RELOAD_FAILED.value,
                                     f"backend {self.backend_id}: internal error: {type(e).__name__}: {e}")
            finally:
                self._loading = False
                self._idle = None
                self._admit()
        await self.send(reply.to_wire())

    # ------------------------------------------------------------- admission to the engine

    async def _enter_engine(self) -> int | None:
        """Wait for a place in the engine (capacity, no weights loading); return the version that serves the call.

        The fast path (room, nobody waiting) does not suspend. A waiter is
        admitted by :meth:`_admit`, which counts it in before waking it, so
        the count never overshoots; one cancelled as its turn came hands the
        place on.
        """
        if self._loading or self._waiting or self._serving >= self.capacity:
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._leave_engine()  # admitted, and cancelled before it ran: give the place back
                raise
        else:
            self._serving += 1
        return self.policy_version

    def _leave_engine(self) -> None:
        self._serving -= 1
        if self._loading:
            if not self._serving and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)
        elif self._waiting:
            self._admit()

    def _admit(self) -> None:
        """Wake waiting calls, oldest first, while there is room and no weights are loading."""
        while self._waiting and not self._loading and self._serving < self.capacity:
            turn = self._waiting.popleft()
            if not turn.done():  # a waiter cancelled meanwhile left its future cancelled
                self._serving += 1
                turn.set_result(None)

    # ------------------------------------------------------------- generate

    async def _serve_generate(self, call: _Call, h: H.Generate, prompt: bytes) -> None:
        rid, job_id = h.rid, h.job_id
        m = self.metrics
        try:
            try:
                prompt_ids = P.unpack_tokens(prompt)
            except (ProtocolError, ValueError, TypeError) as e:
                await self._answer_error(rid, job_id, e)
                return
            sampling = h.sampling if h.sampling is not None else SamplingParams()
            started = timebase.now()  # waiting for the engine's turn counts as engine time, as its own queue does
            version = await self._enter_engine()
            try:
                CALL_JOB_ID.set(job_id)  # this call's own task: the engine's per-job accounting
                call.stage = "engine"
                gen = await self.engine.generate(prompt_ids, sampling)
            except (InferenceError, ProtocolError, ValueError, TypeError) as e:
                await self._answer_error(rid, job_id, e)
                return
            except Exception as e:  # an engine bug must still answer, or the job would wait out its timeout
                log.exception("generate (job %s) crashed in the engine", job_id)
                message = f"backend {self.backend_id}: internal error: {type(e).__name__}: {e}"
                m.inc("prorl_bridge_generate_calls", ("error",))
                await self.send(H.GenerateReply(rid, error=_error(ErrorCode.BACKEND_ERROR.value, message)).to_wire())
                return
            finally:
                call.stage = "answered"
                self._leave_engine()
        except asyncio.CancelledError:
            m.inc("prorl_bridge_generate_calls", ("cancelled",))
            raise
        engine_s = timebase.now() - started  # queued at the engine and generating
        m.observe("prorl_bridge_generate_seconds", (), engine_s)
        m.inc("prorl_bridge_generate_calls", ("ok",))
        m.inc("prorl_bridge_prompt_tokens", (), len(prompt_ids))
        m.inc("prorl_bridge_output_tokens", (), len(gen.output_ids))
        # policy_version: the weights that served this call, whatever came since.
        done = H.GenerateReply(rid, gen.finish_reason, policy_version=version, engine_s=round(engine_s, 6),
                               stop_string=gen.stop_string)
        await self.send(done.to_wire(), gen.payload())

    async def _answer_error(self, rid: Any, job_id: str, e: Exception) -> None:
        """Answer a call the engine (or its own input) refused, with the error's code and message."""
        if isinstance(e, ProtocolError):
            code = e.code
        elif isinstance(e, ContextLengthExceeded):  # the node's agent must shorten its prompt, not retry
            code = ErrorCode.CONTEXT_LENGTH_EXCEEDED.value
        else:
            code = ErrorCode.BACKEND_ERROR.value
        message = f"backend {self.backend_id}: {e.message if isinstance(e, ProtocolError) else e}"
        log.warning("generate (job %s) failed: %s", job_id, message)
        self.metrics.inc("prorl_bridge_generate_calls", ("error",))
        await self.send({"op": Op.GENERATE_REPLY.value, "rid": rid, "error": _error(code, message)})

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
