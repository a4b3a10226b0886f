"""The node side of generate: ask the broker, or call a redirected HTTP backend directly.

Every call goes to the broker first, so pause/resume, stickiness and
``backends clear`` apply to HTTP backends too. The broker answers with
the output (a bridge served it) or with ``redirect: url`` (an HTTP backend
added with ``backends add``), in which case this node calls
``url/completions`` itself with the prompt as token ids, naming the
``model`` the reply carries (absent: the first the server lists).

Time a call spends held at the broker (generation paused, or no backend
up: the broker says so with ``generate_held``) does not count: the call's
``generate_timeout_s`` stands still, and so do its job's stage deadline and
budget (the ``on_hold`` callback tells the node's pipeline).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from prorl_cli import timebase
from prorl_cli.exceptions import (
    BackendFault,
    BrokerRestarted,
    InferenceError,
    JobEnded,
    ProtocolError,
    RemoteError,
)
from prorl_cli.inference.contract import Generation
from prorl_cli.inference.openai_engine import OpenAIEngine
from prorl_cli.inference.settings import InferenceConfig
from prorl_cli.protocol import ErrorCode, Op, SamplingParams, pack_tokens
from prorl_cli.protocol import headers as H

log = logging.getLogger(__name__)

#: ``await request(header, payload, cancel=...) -> (reply header, reply payload)`` over the node's socket
#: (:meth:`prorl_cli.peer.BrokerPeer.request`).
RequestFn = Callable[..., Awaitable[tuple[dict[str, Any], list[bytes]]]]
#: ``await notify(header)``: a message to the broker that gets no reply.
NotifyFn = Callable[[dict[str, Any]], Awaitable[None]]
#: ``await rejoin()``: register with the broker again and return once registered
#: (:meth:`prorl_cli.peer.BrokerPeer.rejoin`).
RejoinFn = Callable[[], Awaitable[None]]


#: ``on_hold(job_id, held)``: the job's calls became held at the broker (True) or none is any more (False).
HoldFn = Callable[[str, bool], None]


class _Scope(Protocol):
    def reschedule(self, when: float | None) -> None: ...


class _Call:
    """One generate call in flight: its deadline (loop time), which stands still while its job is held."""

    __slots__ = ("deadline", "held_left_s", "scope")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        #: Seconds left when the hold began; ``None`` while not held.
        self.held_left_s: float | None = None
        self.scope: _Scope | None = None

    def remaining_s(self, now: float) -> float | None:
        return None if self.held_left_s is not None else max(0.0, self.deadline - now)

    def hold(self, now: float) -> None:
        if self.held_left_s is None:
            self.held_left_s = max(0.0, self.deadline - now)
            if self.scope is not None:
                self.scope.reschedule(None)

    def release(self, now: float) -> None:
        if self.held_left_s is not None:
            self.deadline = now + self.held_left_s
            self.held_left_s = None
            if self.scope is not None:
                self.scope.reschedule(self.deadline)


class NodeInference:
    """``generate(job_id, prompt_ids, sampling) -> Generation`` for one node's jobs."""

    def __init__(
        self,
        request: RequestFn,
        config: InferenceConfig,
        host: str,
        notify: NotifyFn | None = None,
        rejoin: RejoinFn | None = None,
        on_hold: HoldFn | None = None,
    ) -> None:
        self.request = request
        self.notify = notify
        self.rejoin = rejoin
        self.on_hold = on_hold
        self.config = config
        self.host = host
        self._http: dict[tuple[str, str | None], OpenAIEngine] = {}
        #: Calls in flight, by job; and how many of each job's calls the broker holds now.
        self._calls: dict[str, list[_Call]] = {}
        self._held: dict[str, int] = {}

    def held(self, job_id: str, held: bool) -> None:
        """The broker's ``generate_held``: one of ``job_id``'s calls is held (or released).

        The job's clocks stand still from its first held call to the release
        of its last one; a notice for a job with no call in flight is stale
        (the call ended meanwhile) and ignored.
        """
        calls = self._calls.get(job_id)
        if not calls:
            return
        before = self._held.get(job_id, 0)
        after = before + 1 if held else max(0, before - 1)
        self._held[job_id] = after
        now = asyncio.get_running_loop().time()
        if before == 0 and after > 0:
            for call in calls:
                call.hold(now)
            if self.on_hold is not None:
                self.on_hold(job_id, True)
        elif before > 0 and after == 0:
            self._release(job_id, now)

    def _release(self, job_id: str, now: float) -> None:
        self._held.pop(job_id, None)
        for call in self._calls.get(job_id, ()):
            call.release(now)
        if self.on_hold is not None:
            self.on_hold(job_id, False)

    def _begin(self, job_id: str, timeout_s: float) -> _Call:
        now = asyncio.get_running_loop().time()
        call = _Call(now + timeout_s)
        if self._held.get(job_id):
            call.hold(now)
        self._calls.setdefault(job_id, []).append(call)
        return call

    def _end(self, job_id: str, call: _Call) -> None:
        calls = self._calls.get(job_id, [])
        calls.remove(call)
        if not calls:
            del self._calls[job_id]
            # The job's last call is over: whatever notice was lost (the call was dropped while held), its clocks run.
            if self._held.get(job_id):
                self._release(job_id, asyncio.get_running_loop().time())

    async def close(self) -> None:
        """Close the connections of the HTTP backends this node called (it is stopping)."""
        engines, self._http = list(self._http.values()), {}
        for engine in engines:
            await engine.close()

    def _http_engine(self, url: str, backend_id: str | None, model: str | None = None) -> OpenAIEngine:
        # One engine per URL and model: calls name the model the broker sent (None: the server's first).
        engine = self._http.get((url, model))
        if engine is None:
            engine = OpenAIEngine(url, model=model, timeout_s=self.config.generate_timeout_s, backend_id=backend_id or url)
            self._http[(url, model)] = engine
        return engine

    async def generate(self, job_id: str, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        """One model call for ``job_id``; raises :class:`InferenceError`."""
        if not prompt_ids:
            raise InferenceError("generate needs at least one prompt token")
        header = H.Generate(H.NEW_RID, job_id, sampling).to_wire()  # the connection numbers it and adds its host
        timeout_s = self.config.generate_timeout_s
        call = self._begin(job_id, timeout_s)
        try:
            reply, payload = await self._ask(job_id, header, prompt_ids, call, timeout_s)
        finally:
            self._end(job_id, call)
        if not reply.get("ok"):
            error = RemoteError.from_reply(reply)
            if error.code == ErrorCode.UNKNOWN_JOB.value:
                # The broker answers a call of a job it ended before the job's cancel reaches this node.
                raise JobEnded(str(error)) from error
            if isinstance(error, InferenceError):
                raise error
            raise InferenceError(str(error)) from error
        try:
            answer: H.GenerateAnswer = H.parse_reply(Op.GENERATE, reply)
        except ProtocolError as e:
            raise InferenceError(f"job {job_id}: malformed generate reply from the broker: {e.message}") from e
        backend_id, version = answer.backend_id, answer.policy_version
        if answer.redirect:
            engine = self._http_engine(answer.redirect, backend_id, answer.model)
            started = timebase.now()
            fault: str | None = None
            answered = False  # until the server answers: a call given up (cancelled) says nothing of the backend
            try:
                gen = await engine.generate(prompt_ids, sampling)
                gen.engine_s = timebase.now() - started
                answered = True
            except BackendFault as e:
                fault = str(e)[:H.FAULT_CHARS]
                raise
            except InferenceError:
                answered = True  # a 4xx, a malformed answer: this call's trouble, from a server that is up
                raise
            finally:
                if self.notify is not None and backend_id:
                    # The broker counts this backend's in-flight and served calls, and rests one that keeps failing.
                    abandoned = True if not answered and fault is None else None
                    await self.notify(H.GenerateDone(job_id, backend_id, fault, abandoned).to_wire())
            gen.backend_id = backend_id or engine.backend_id
            gen.policy_version = version
            return gen
        try:
            gen = Generation.from_payload(payload, answer.finish_reason or "stop", backend_id)
        except ProtocolError as e:
            raise InferenceError(f"backend {backend_id}: malformed generate reply: {e.message}") from e
        gen.policy_version = version
        gen.engine_s = float(answer.engine_s) if answer.engine_s is not None else None
        gen.stop_string = answer.stop_string
        return gen

    async def _ask(
        self, job_id: str, header: dict[str, Any], prompt_ids: list[int], call: _Call, timeout_s: float
    ) -> tuple[dict[str, Any], list[bytes]]:
        """Ask the broker until it answers (registering again, or asking a restarted broker again)."""
        # Giving up (timeout, or the job's task was cancelled) tells the broker, which stops the call at the engine.
        cancel = H.GenerateCancel(H.NEW_RID, job_id).to_wire()
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout(call.remaining_s(loop.time())) as scope:  # not wait_for: gh-86296
                    call.scope = scope
                    reply, payload = await self.request(header, [pack_tokens(prompt_ids)], cancel=cancel)
                    if reply.get("ok") or self.rejoin is None or not _is_unknown_peer(reply):
                        return reply, payload
                    # A broker that restarted (or declared us dead) does not know this node yet:
                    # register again (claiming our running jobs) and ask again, within this call's deadline.
                    log.warning("job %s: the broker does not know this node; registering again", job_id)
                    await self.rejoin()
            except BrokerRestarted as e:
                # Nothing was sampled for us (or it was lost): ask the new broker; the handler sees only latency.
                log.warning("job %s: %s; asking again", job_id, e)
            except TimeoutError as e:
                raise InferenceError(
                    f"job {job_id}: no generate answer from the broker within {timeout_s:g} s "
                    "(not counting time held at the broker)"
                ) from e
            finally:
                call.scope = None


def _is_unknown_peer(reply: dict[str, Any]) -> bool:
    error = reply.get("error")
    return isinstance(error, dict) and error.get("code") == ErrorCode.UNKNOWN_PEER.value
