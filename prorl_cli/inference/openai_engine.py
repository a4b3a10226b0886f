"""Token-in/token-out over an OpenAI-compatible ``/v1/completions`` (vLLM).

The prompt goes as a list of token ids, with ``return_token_ids`` and
``logprobs: 0``, so the server returns the sampled ids and their log-probs
and never round-trips through text. The server's echo of the prompt ids is
checked against what was sent: a server that re-tokenized would be caught.
A call with ``sampling.top_logprobs = k`` asks for ``logprobs: k`` with
vLLM's ``return_tokens_as_token_ids``, so each position's alternatives come
keyed ``token_id:N``; a server that keys them by text gives none.
Stop strings (``sampling.stop``) go as ``stop``: vLLM returns the ids up to
the one that completes the string, and names it in ``stop_reason``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import (
    BackendFault,
    ContextLengthExceeded,
    InferenceError,
    context_length_message,
)
from prorl_cli.inference import http
from prorl_cli.inference.checkpoint import reload_problems, tensor_shapes
from prorl_cli.inference.contract import Engine, Generation
from prorl_cli.protocol import SamplingParams

log = logging.getLogger(__name__)


def normalize_base_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1`` (no slash)."""
    http.split_url(url)  # raises ValueError naming a bad URL
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


#: Sampling controls outside the generate contract, at the values that leave the distribution unchanged.
NEUTRAL_SAMPLING: dict[str, float] = {
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
}


def completions_body(model: str, prompt_ids: list[int], sampling: SamplingParams) -> dict[str, Any]:
    """The ``/v1/completions`` request for one generate call."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        # Neutral, and sent: vLLM takes any of these a request leaves out from the model's generation_config.json
        # (Qwen2.5-Instruct's has repetition_penalty 1.05), and would sample from a distribution other than the
        # one the contract names, while the log-probs it returns stay those of the unmodified model.
        **NEUTRAL_SAMPLING,
        "logprobs": sampling.top_logprobs or 0,
        "return_token_ids": True,
        # Without this vLLM would hide special tokens only in the text; ids are unaffected,
        # but keeping the text faithful helps people reading server logs.
        "skip_special_tokens": False,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension of the completions API
    if sampling.top_logprobs:
        body["return_tokens_as_token_ids"] = True  # alternatives keyed "token_id:N", not by text (vLLM)
    if sampling.stop:
        # vLLM matches them in the output's text and keeps the ids up to the one completing the string (its
        # token_ids and log-probs end there whatever this flag says); the flag keeps the string in the text too,
        # so the text it logs and returns is that of the ids.
        body["stop"] = list(sampling.stop)
        body["include_stop_str_in_output"] = True
    if sampling.structured is not None:
        # vLLM's own field (StructuredOutputsParams: json, json_object, regex, choice, grammar), the record's shape.
        body["structured_outputs"] = dict(sampling.structured)
    return body


_TOKEN_ID_KEY = "token_id:"


def parse_top_logprobs(raw: Any, n: int, k: int, where: str) -> list[list[tuple[int, float]]] | None:
    """``logprobs.top_logprobs`` (one ``{"token_id:N": logprob}`` map per position) as ``k`` (id, logprob) pairs
    per position, most likely first; None when the server gave none or keyed them by text (ids unknown)."""
    if not isinstance(raw, list) or len(raw) != n or not all(isinstance(row, dict) for row in raw):
        return None
    top: list[list[tuple[int, float]]] = []
    for row in raw:
        pairs = []
        for key, lp in row.items():
            if not (isinstance(key, str) and key.startswith(_TOKEN_ID_KEY) and key[len(_TOKEN_ID_KEY):].isdigit()):
                log.warning("%s: top_logprobs keyed %r, not token_id:N; returning none", where, key)
                return None
            try:
                pairs.append((int(key[len(_TOKEN_ID_KEY):]), float(lp) if lp is not None else math.nan))
            except (TypeError, ValueError):
                log.warning("%s: top_logprobs entry %r: %r is not a token id and a log-probability; returning none",
                            where, key, lp)
                return None
        # vLLM adds the sampled token when it is not among the k: keep the k most likely.
        top.append(sorted(pairs, key=lambda p: -p[1])[:k])
    width = min((len(row) for row in top), default=0)
    return [row[:width] for row in top]  # one k for every position (the payload frames need it)


def server_message(resp: http.HttpResponse) -> str:
    """The error message an OpenAI-compatible server put in a failed response."""
    try:
        data = resp.json()
    except InferenceError:
        return resp.body[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
    return str(data)[:500]


def parse_completion(
    data: Any, prompt_ids: list[int], url: str, backend_id: str | None, top_logprobs: int | None = None,
    stop: list[str] | None = None,
) -> Generation:
    """Turn a ``/v1/completions`` JSON answer into a :class:`Generation`, checking its shape.

    ``top_logprobs``: the alternatives per position asked for (``Generation.top_logprobs``). ``stop``: the
    stop strings sent; vLLM's ``stop_reason`` naming one of them is the call's ``stop_string``.
    """
    where = f"backend {url}"
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError) as e:
        raise InferenceError(f"{where}: malformed completion (no choices[0]): {str(data)[:300]}") from e
    ids = choice.get("token_ids") if isinstance(choice, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise InferenceError(
            f"{where}: completion has no token_ids; the server must support 'return_token_ids' (vLLM >= 0.10)"
        )
    lp_block = choice.get("logprobs")
    lps = lp_block.get("token_logprobs") if isinstance(lp_block, dict) else None
    if not isinstance(lps, list) or len(lps) != len(ids):
        raise InferenceError(
            f"{where}: completion has {len(ids)} token ids but logprobs.token_logprobs is "
            f"{'missing' if not isinstance(lps, list) else f'{len(lps)} long'}"
        )
    try:
        logprobs = [float(x) if x is not None else math.nan for x in lps]
    except (TypeError, ValueError) as e:
        raise InferenceError(f"{where}: logprobs.token_logprobs holds a value that is not a number: {e}") from e
    echoed = choice.get("prompt_token_ids", data.get("prompt_token_ids"))
    if isinstance(echoed, list) and echoed and echoed != list(prompt_ids):
        raise InferenceError(f"{where}: the server's prompt_token_ids differ from the prompt ids sent")
    finish = choice.get("finish_reason") or "stop"
    top = parse_top_logprobs(lp_block.get("top_logprobs"), len(ids), top_logprobs, where) if top_logprobs else None
    reason = choice.get("stop_reason")  # vLLM: the stop string or stop id that ended it, else null
    stop_string = reason if stop and finish == "stop" and isinstance(reason, str) and reason in stop else None
    return Generation(ids, logprobs, str(finish), backend_id, top_logprobs=top, stop_string=stop_string)


class OpenAIEngine(Engine):
    """An OpenAI-compatible server reached over HTTP (vLLM, or anything with token ids)."""

    def __init__(
        self, url: str, *, model: str | None = None, timeout_s: float = 600.0, backend_id: str | None = None,
        reload_in_place: bool = False, concurrency: int = http.POOL_SIZE,
    ) -> None:
        self.base_url = normalize_base_url(url)
        self.root_url = self.base_url[: -len("/v1")]
        self.model = model or ""
        self.max_model_len = 0
        self.timeout_s = timeout_s
        self.backend_id = backend_id
        #: Whether :meth:`reload` may use vLLM's ``/collective_rpc`` (``inference.vllm_reload_in_place``).
        self.reload_in_place = reload_in_place
        #: The checkpoint directory served (vLLM's ``/models`` ``root``, then each one reloaded); a reload's
        #: checkpoint is checked against its tensors before vLLM reads any weight.
        self.served_checkpoint: str | None = None
        #: Those tensors' shapes, read when first needed and kept (a trainer may delete old checkpoints).
        self._served_shapes: dict[str, tuple[int, ...]] | None = None
        # Keep-alive: generate calls reuse warm connections (no connect, or TLS handshake, per call). One
        # connection per call served at once (``concurrency``: a bridge's capacity): with fewer, the calls
        # beyond them would wait in the pool, never reaching the server, while their timeout ran.
        self.http = http.HttpClient(pool_size=max(concurrency, http.POOL_SIZE))

    async def describe(self) -> None:
        """Read the served model's name and max length from ``/v1/models``."""
        resp = await self.http.request("GET", f"{self.base_url}/models", timeout_s=30.0)
        if resp.status != 200:
            raise InferenceError(f"backend {self.base_url}: GET /models: HTTP {resp.status}: {server_message(resp)}")
        data = resp.json()
        try:
            entries = data["data"]
            entry = next((e for e in entries if e.get("id") == self.model), entries[0]) if self.model else entries[0]
            model = self.model or str(entry["id"])
            max_model_len = int(entry.get("max_model_len") or 0)
            root = entry.get("root")
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise InferenceError(f"backend {self.base_url}: malformed /models answer: {str(data)[:300]}") from e
        self.model, self.max_model_len = model, max_model_len
        if self.served_checkpoint is None and isinstance(root, str) and root:
            self.served_checkpoint = root

    async def start(self) -> None:
        await self.describe()

    async def healthy(self) -> bool:
        # On a connection of its own: with generate calls on every pooled connection (a bridge whose capacity
        # reaches the pool's size), a check queued behind them would time out and the bridge take a busy
        # engine for a dead one.
        try:
            resp = await http.request("GET", f"{self.root_url}/health", timeout_s=10.0)
        except InferenceError:
            return False
        if resp.status == 404:  # not vLLM: any answer from /models will do
            try:
                resp = await http.request("GET", f"{self.base_url}/models", timeout_s=10.0)
            except InferenceError:
                return False
        return resp.status == 200

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        if not prompt_ids:
            raise InferenceError("generate needs at least one prompt token")
        if not self.model:
            await self.describe()
        body = completions_body(self.model, prompt_ids, sampling)
        if self.max_model_len and len(prompt_ids) < self.max_model_len:
            # As every engine: the output stops at the context's end ("length"); vLLM would refuse the call.
            body["max_tokens"] = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        resp = await self.http.request("POST", f"{self.base_url}/completions", body, timeout_s=self.timeout_s)
        if resp.status != 200:
            message = server_message(resp)
            if self.max_model_len and len(prompt_ids) >= self.max_model_len:
                # vLLM takes a prompt of exactly max_model_len tokens and then refuses the call with
                # "max_tokens must be at least 1, got 0", whatever max_tokens it was sent: say what is wrong.
                raise ContextLengthExceeded(f"backend {self.base_url}: HTTP {resp.status}: " + context_length_message(
                    len(prompt_ids), self.max_model_len, f"the server said: {message}"))
            fault = BackendFault if resp.status >= 500 else InferenceError  # 4xx: this call's fault, not the server's
            raise fault(f"backend {self.base_url}: HTTP {resp.status}: {message}")
        return parse_completion(resp.json(), prompt_ids, self.base_url, self.backend_id, sampling.top_logprobs,
                                sampling.stop)

    async def reload(self, checkpoint: str, policy_version: int) -> None:
        """Load ``checkpoint`` in place through vLLM's ``POST /collective_rpc``, then drop cached prefixes.

        The method called is ``prorl_reload_weights`` of
        :class:`~prorl_cli.inference.vllm_reload.ReloadWorkerExtension`: vLLM's
        own ``reload_weights(weights_path=...)`` plus the refresh of tied output
        heads without which vLLM's CPU backend keeps the old head (see that
        module). vLLM serves ``/collective_rpc`` and ``/reset_prefix_cache``
        only with ``VLLM_SERVER_DEV_MODE=1`` and knows the method only with
        ``--worker-extension-cls``; the vLLM that prorl starts has both (unless
        ``inference.vllm_reload_in_place`` is off). The bridge has let in-flight
        calls finish before calling this.
        """
        from prorl_cli.inference.vllm_reload import RELOAD_METHOD, WORKER_EXTENSION

        if not self.reload_in_place:
            raise InferenceError(f"backend {self.base_url}: in-place reload of vLLM is off (inference.vllm_reload_in_place); "
                                 f"restart it on {checkpoint}")
        served = self.served_checkpoint
        if self._served_shapes is None and served:
            try:
                self._served_shapes = await asyncio.to_thread(tensor_shapes, Path(served))
            except InferenceError as e:
                log.warning("backend %s: the served checkpoint cannot be read, so %s is not checked against it: %s",
                            self.base_url, checkpoint, e)
        # vLLM's reload answers 200 for a checkpoint that lacks weights, and serves what it left in them.
        incoming = await asyncio.to_thread(tensor_shapes, Path(checkpoint))  # None: out of reach, or not safetensors
        problems = reload_problems(self._served_shapes, incoming)
        if problems:
            more = f" ({len(problems) - 5} more)" if len(problems) > 5 else ""
            raise InferenceError(f"backend {self.base_url}: {checkpoint} does not hold every weight of the served "
                                 f"{served} in its shape, so it was not loaded (the served weights are unchanged): "
                                 f"{'; '.join(problems[:5])}{more}")
        needs = f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION}"
        body = {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(checkpoint)}}
        resp = await self.http.request("POST", f"{self.root_url}/collective_rpc", body, timeout_s=self.timeout_s)
        if resp.status == 404:
            raise InferenceError(f"backend {self.base_url} has no /collective_rpc (start vLLM with {needs}), "
                                 f"so it cannot load {checkpoint} in place; restart it on the checkpoint")
        if resp.status != 200:
            message = server_message(resp)
            hint = f" (start vLLM with {needs})" if RELOAD_METHOD in message else ""
            raise InferenceError(f"backend {self.base_url}: {RELOAD_METHOD} from {checkpoint}: HTTP {resp.status}: "
                                 f"{message}{hint}")
        log.info("backend %s loaded %s in place: %s", self.base_url, checkpoint, resp.body[:300].decode(errors="replace"))
        self.served_checkpoint = str(checkpoint)
        if incoming is not None:
            self._served_shapes = incoming
        # Cached prefixes were computed by the old weights.
        resp = await self.http.request("POST", f"{self.root_url}/reset_prefix_cache", {}, timeout_s=60.0)
        if resp.status != 200:
            raise InferenceError(f"backend {self.base_url}: reset_prefix_cache after loading {checkpoint}: "
                                 f"HTTP {resp.status}: {server_message(resp)}")

    async def close(self) -> None:
        await self.http.close()
