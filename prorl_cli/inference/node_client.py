"""The node side of generate: ask the broker, or call a redirected HTTP backend directly.

Every call goes to the broker first, so pause/resume, stickiness and
``backends clear`` apply to HTTP backends too. The broker answers with
the output (a bridge served it) or with ``redirect: url`` (an HTTP backend
added with ``backends add``), in which case this node calls
``url/completions`` itself with the prompt as token ids.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prorl_cli.exceptions import BrokerRestarted, InferenceError, ProtocolError, RemoteError
from prorl_cli.inference.contract import Generation, check_sampling
from prorl_cli.inference.openai_engine import OpenAIEngine
from prorl_cli.inference.settings import InferenceConfig
from prorl_cli.protocol import ErrorCode, Op, SamplingParams, pack_tokens

log = logging.getLogger(__name__)

#: ``await request(header, payload, cancel=...) -> (reply header, reply payload)`` over the node's socket
#: (:meth:`prorl_cli.peer.BrokerPeer.request`).
RequestFn = Callable[..., Awaitable[tuple[dict[str, Any], list[bytes]]]]
#: ``await notify(header)``: a message to the broker that gets no reply.
NotifyFn = Callable[[dict[str, Any]], Awaitable[None]]
#: ``await rejoin()``: register with the broker again and return once registered
#: (:meth:`prorl_cli.peer.BrokerPeer.rejoin`).
RejoinFn = Callable[[], Awaitable[None]]


class NodeInference:
    """``generate(job_id, prompt_ids, sampling) -> Generation`` for one node's jobs."""

    def __init__(
        self,
        request: RequestFn,
        config: InferenceConfig,
        host: str,
        notify: NotifyFn | None = None,
        rejoin: RejoinFn | None = None,
    ) -> None:
        self.request = request
        self.notify = notify
        self.rejoin = rejoin
        self.config = config
        self.host = host
        self._http: dict[str, OpenAIEngine] = {}

    def _http_engine(self, url: str, backend_id: str | None) -> OpenAIEngine:
        engine = self._http.get(url)
        if engine is None:
            engine = OpenAIEngine(url, timeout_s=self.config.generate_timeout_s, backend_id=backend_id or url)
            self._http[url] = engine
        return engine

    async def generate(self, job_id: str, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        """One model call for ``job_id``; raises :class:`InferenceError`."""
        try:
            check_sampling(sampling)
        except ValueError as e:
            raise InferenceError(str(e)) from e
        if not prompt_ids:
            raise InferenceError("generate needs at least one prompt token")
        header = {"op": Op.GENERATE.value, "job_id": job_id, "sampling": sampling.to_wire()}
        timeout_s = self.config.generate_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        # Giving up (timeout, or the job's task was cancelled) tells the broker, which stops the call at the engine.
        cancel = {"op": Op.GENERATE_CANCEL.value, "job_id": job_id}
        while True:
            try:
                remaining_s = max(0.0, deadline - asyncio.get_running_loop().time())
                async with asyncio.timeout(remaining_s):  # not wait_for: it can lose a cancel (gh-86296)
                    reply, payload = await self.request(header, [pack_tokens(prompt_ids)], cancel=cancel)
                    if reply.get("ok") or self.rejoin is None or not _is_unknown_peer(reply):
                        break
                    # A broker that restarted (or declared us dead) does not know this node yet:
                    # register again (claiming our running jobs) and ask again, within this call's deadline.
                    log.warning("job %s: the broker does not know this node; registering again", job_id)
                    await self.rejoin()
            except BrokerRestarted as e:
                # Nothing was sampled for us (or it was lost): ask the new broker; the handler sees only latency.
                log.warning("job %s: %s; asking again", job_id, e)
            except asyncio.TimeoutError as e:
                raise InferenceError(
                    f"job {job_id}: no generate answer from the broker within {timeout_s:g} s "
                    "(generation paused, or no backend registered?)"
                ) from e
        if not reply.get("ok"):
            error = RemoteError.from_reply(reply)
            if isinstance(error, InferenceError):
                raise error
            raise InferenceError(str(error)) from error
        backend_id = reply.get("backend_id")
        redirect = reply.get("redirect")
        raw_version = reply.get("policy_version")
        # The trainer's weight version at the time the broker routed the call (contract K3).
        version = raw_version if isinstance(raw_version, int) and not isinstance(raw_version, bool) else None
        if redirect:
            engine = self._http_engine(str(redirect), backend_id)
            try:
                gen = await engine.generate(prompt_ids, sampling)
            finally:
                if self.notify is not None and backend_id:
                    # The broker counts this backend's in-flight calls and served calls.
                    await self.notify({"op": Op.GENERATE_DONE.value, "job_id": job_id, "backend_id": backend_id})
            gen.backend_id = backend_id or engine.backend_id
            gen.policy_version = version
            return gen
        try:
            gen = Generation.from_payload(payload, str(reply.get("finish_reason") or "stop"), backend_id)
        except ProtocolError as e:
            raise InferenceError(f"backend {backend_id}: malformed generate reply: {e.message}") from e
        gen.policy_version = version
        return gen


def _is_unknown_peer(reply: dict[str, Any]) -> bool:
    error = reply.get("error")
    return isinstance(error, dict) and error.get("code") == ErrorCode.UNKNOWN_PEER.value
