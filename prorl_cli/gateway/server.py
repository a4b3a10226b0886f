"""The gateway's HTTP server: one per node process, serving every job under its own secret URL.

Routes (``<token>`` is the job's unguessable token; nothing else names a job)::

    POST /jobs/<token>/v1/chat/completions     OpenAI chat (streaming or not)
    POST /jobs/<token>/v1/completions          OpenAI text completion
    POST /jobs/<token>/v1/responses            OpenAI Responses (streaming or not; previous_response_id)
    GET  /jobs/<token>/v1/responses/<id>       a response the job keeps for previous_response_id
    DELETE /jobs/<token>/v1/responses/<id>     forget a kept response
    GET  /jobs/<token>/v1/responses            the Responses WebSocket mode: refused, with an error event
    POST /jobs/<token>/v1/responses/input_tokens  Responses token count (nothing sampled)
    POST /jobs/<token>/v1/responses/compact, responses/<id>/cancel,
    GET  /jobs/<token>/v1/responses/<id>/input_items   not served: a 404 saying why
    GET  /jobs/<token>/v1/models               the model names the job accepts
    GET  /jobs/<token>/v1/models/<model>       one of them
    POST /jobs/<token>/v1/messages             Anthropic messages (streaming or not)
    POST /jobs/<token>/v1/messages/count_tokens  Anthropic token count (nothing sampled)

A request with an unknown token gets 401 and is not recorded; one for a job
that has ended gets 410. The server listens on 127.0.0.1 (an ephemeral
port) for agents in the node process, and on one Unix socket per sandbox
(bind-mounted into it, where the tool server relays a loopback port to it).
Bad requests get the API's own error body naming the problem; the server
never dies on one, and a client that disconnects cancels its model call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
import secrets
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from prorl_cli.agent.chat import ChatTemplateError
from prorl_cli.agent.loop import GenerateFn
from prorl_cli.agent.tools import InlineToolParser, ToolParser
from prorl_cli.agent.trajectory import Trajectory
from prorl_cli.exceptions import ConfigError, ContextLengthExceeded, InferenceError
from prorl_cli.gateway import anthropic_routes, openai_routes, responses_routes
from prorl_cli.gateway.buffer import (
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_TOOL_CHOICE_RETRIES,
    ChatFactory,
    TokenBuffer,
)
from prorl_cli.gateway.messages import MessageMemo, RequestError
from prorl_cli.gateway.streaming import (
    KEEPALIVE_S,
    SSE_RESPONSE,
    anthropic_error,
    end_with_error,
    openai_error,
)
from prorl_cli.protocol import SamplingParams

log = logging.getLogger(__name__)

#: Largest request body accepted (a long conversation is a few MB of JSON).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: How many ended jobs' tokens are remembered (to answer 410 rather than 401).
ENDED_TOKENS_KEPT = 4096
#: The model name every job accepts; ``openai/prorl``-style prefixes are accepted too.
DEFAULT_MODEL = "prorl"


class JobGateway:
    """One job's endpoint: its token, its token buffer, and where it listens."""

    def __init__(self, gateway: Gateway, job_id: str, buffer: TokenBuffer, models: tuple[str, ...]) -> None:
        self.gateway = gateway
        self.job_id = job_id
        self.buffer = buffer
        self.models = models
        self.token = secrets.token_urlsafe(24)
        self.closed = False
        #: The last chat request's messages in canonical form (reused for the unchanged prefix of the next).
        self.memo = MessageMemo()
        #: The job's last stored Responses conversations (``previous_response_id``).
        self.responses = responses_routes.StoredResponses()
        #: The job's last Anthropic message-thread replies (``thread: {"type": "continue"}``).
        self.threads = anthropic_routes.StoredThreads()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unix_sites: list[web.UnixSite] = []

    # -------------------------------------------------------------- URLs
    def base_url(self, host: str | None = None, port: int | None = None) -> str:
        """The OpenAI base URL (``.../v1``); default: the node's loopback listener."""
        return f"http://{host or self.gateway.host}:{port or self.gateway.port}/jobs/{self.token}/v1"

    def anthropic_base_url(self, host: str | None = None, port: int | None = None) -> str:
        """The Anthropic base URL (the SDK appends ``/v1/messages``)."""
        return f"http://{host or self.gateway.host}:{port or self.gateway.port}/jobs/{self.token}"

    @property
    def api_key(self) -> str:
        """What to pass as the API key (SDKs insist on one; the URL's token is what authorises)."""
        return self.token

    def env(self, host: str | None = None, port: int | None = None) -> dict[str, str]:
        """Environment variables that point OpenAI- and Anthropic-speaking harnesses here."""
        base = self.base_url(host, port)
        return {
            "OPENAI_BASE_URL": base, "OPENAI_API_BASE": base, "OPENAI_API_KEY": self.token,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url(host, port), "ANTHROPIC_API_KEY": self.token,
            "PRORL_GATEWAY_MODEL": self.models[0],
        }

    @property
    def trajectory(self) -> Trajectory:
        return self.buffer.trajectory

    # ---------------------------------------------------------- serving
    def check_model(self, model: str) -> None:
        name = model.split("/", 1)[1] if "/" in model and model.split("/", 1)[0] in ("openai", "anthropic") else model
        if name not in self.models:
            raise RequestError(f"model {model!r} does not exist here; this job serves {list(self.models)} (send one "
                               "of them, e.g. from $PRORL_GATEWAY_MODEL; the harness task accepts more names with "
                               "its settings model and model_aliases)", status=404, param="model",
                               code="model_not_found")

    async def serve_unix(self, path: str | Path) -> None:
        """Also listen on the Unix socket ``path`` (a sandbox's run directory; the relay connects to it)."""
        if self.closed:
            raise RuntimeError(f"job {self.job_id}'s gateway is closed")
        site = web.UnixSite(self.gateway.runner, str(path))
        await site.start()
        self._unix_sites.append(site)

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """End the job's endpoint: later requests get 410; requests in flight have their model calls cancelled
        and get the same 410 (a stream already answered 200: the API's error event)."""
        if self.closed:
            return
        self.closed = True
        self.gateway._retire(self)
        for task in list(self._tasks):
            task.cancel()
        for site in self._unix_sites:
            with contextlib.suppress(OSError, RuntimeError):
                await site.stop()
        self._unix_sites.clear()

    async def __aenter__(self) -> JobGateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _is_anthropic(request: web.Request) -> bool:
    return request.path.endswith(("/v1/messages", "/v1/messages/count_tokens"))


async def _error(request: web.Request, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> web.StreamResponse:
    """The API's error body with ``status``; on a stream already answered 200, its last event instead."""
    anthropic = _is_anthropic(request)
    body = anthropic_error(status, message, code) if anthropic else openai_error(status, message, param=param, code=code)
    stream = request.get(SSE_RESPONSE)
    if isinstance(stream, web.StreamResponse) and stream.prepared:
        return await end_with_error(stream, body, anthropic=anthropic)
    return web.json_response(body, status=status)


#: A JSON escape of a UTF-16 surrogate, the only way one reaches a UTF-8 body (its bytes are not valid UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(raw: bytes, body: Any) -> None:
    """A 400 naming the field whose text holds an unpaired surrogate (a JavaScript string cut inside an
    emoji's pair, a file name read with ``surrogateescape``): no tokenizer can encode it. Paired escapes
    decode to one character and pass. A UTF-8 body without such an escape is not walked."""
    if raw[:1] != b"\0" and raw[1:2] != b"\0" and not _SURROGATE_ESCAPE.search(raw):
        return
    try:
        where = _surrogate_at(body, "")
    except RecursionError as e:
        raise RequestError("the request body is nested deeper than the gateway reads") from e
    if where is not None:
        raise RequestError(f"{where or 'the body'} holds an unpaired UTF-16 surrogate (an escape from \\ud800 to "
                           "\\udfff without its partner): not text a tokenizer can encode; send whole characters",
                           param=where or None)


def _surrogate_at(value: Any, path: str) -> str | None:
    """The path (``messages[2].content``) of the first string in ``value`` with an unpaired surrogate, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _surrogate_at(k, path) if isinstance(k, str) else None
            if found is None:
                found = _surrogate_at(v, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _surrogate_at(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _context_length_text(e: ContextLengthExceeded) -> str:
    """OpenAI's and Anthropic's wording for a prompt too long (clients match on it), then the engine's own."""
    lengths = e.lengths()
    if lengths is None:
        return f"prompt is too long for the model's context: {e}"
    prompt, limit = lengths
    return (f"This model's maximum context length is {limit} tokens. However, your messages resulted in {prompt} "
            f"tokens (prompt is too long: {prompt} tokens > {limit - 1} maximum, leaving room for one token to "
            "generate). Please reduce the length of the messages.")


class Gateway:
    """The node's HTTP gateway (see the module docstring). Get the running loop's with :meth:`get`."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Gateway] = weakref.WeakKeyDictionary()

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_body_bytes: int = MAX_BODY_BYTES,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        if not keepalive_s > 0:
            raise ValueError(f"keepalive_s must be positive, got {keepalive_s!r}")
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        #: Seconds between keep-alive comments on a stream waiting for its model call.
        self.keepalive_s = keepalive_s
        self._jobs: dict[str, JobGateway] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._errors])
        for method, route, fn in (
            ("POST", "chat/completions", openai_routes.chat_completions),
            ("POST", "completions", openai_routes.completions),
            ("POST", "responses", responses_routes.responses),
            ("POST", "messages", anthropic_routes.messages),
            ("POST", "messages/count_tokens", anthropic_routes.count_tokens),
            ("POST", "responses/input_tokens", responses_routes.input_tokens),
        ):
            app.router.add_route(method, f"/jobs/{{token:[^/]*}}/v1/{route}", self._with_body(fn))
            # The same endpoint per agent: a harness gives each agent its own base URL to label its calls.
            app.router.add_route(method, f"/jobs/{{token:[^/]*}}/agents/{{agent:[^/]+}}/v1/{route}",
                                 self._with_body(fn))
        for prefix in ("/jobs/{token:[^/]*}/v1", "/jobs/{token:[^/]*}/agents/{agent:[^/]+}/v1"):
            app.router.add_get(f"{prefix}/models", self._models)
            # ``.+``: a served name may hold a slash (``org/model``), sent as is or percent-encoded (the SDK's).
            app.router.add_get(f"{prefix}/models/{{model:.+}}", self._model)
            app.router.add_get(f"{prefix}/responses/{{response_id:[^/]+}}", self._response)
            app.router.add_get(f"{prefix}/responses", self._responses_websocket)
            app.router.add_delete(f"{prefix}/responses/{{response_id:[^/]+}}", self._delete_response)
            for method, path, why in responses_routes.NOT_SERVED:
                path = path.replace("{response_id}", "{response_id:[^/]+}")
                app.router.add_route(method, f"{prefix}/responses/{path}", self._job_route(responses_routes.not_served(why)))
        self.app = app
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        self._started = False

    @classmethod
    async def get(cls) -> Gateway:
        """This event loop's gateway (the node's), started on first use."""
        loop = asyncio.get_running_loop()
        gw = cls._by_loop.get(loop)
        if gw is None:
            gw = cls._by_loop[loop] = cls()
        await gw.start()
        return gw

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("gateway listening on http://%s:%d", self.host, self.port)

    async def close(self) -> None:
        for job in list(self._jobs.values()):
            await job.close()
        if self._started:
            await self.runner.cleanup()
            self._started = False

    # -------------------------------------------------------------- jobs
    def open_job(
        self, job_id: str, *, generate: GenerateFn, chat_for: ChatFactory, parser: ToolParser,
        sampling: SamplingParams, models: tuple[str, ...] = (DEFAULT_MODEL,),
        on_record: Callable[[Trajectory], None] | None = None, max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        tool_choice_retries: int = DEFAULT_TOOL_CHOICE_RETRIES,
    ) -> JobGateway:
        """A new endpoint for one job; its trajectory is kept in the returned object's ``buffer``.

        ``max_concurrent``: requests of this job answered at once (more wait);
        ``tool_choice_retries``: turns sampled again at most when one does not honour ``tool_choice``.
        An :class:`~prorl_cli.agent.tools.InlineToolParser` is refused (:class:`ConfigError`).
        """
        if isinstance(parser, InlineToolParser):
            # Its results continue the model's own turn; a chat API's client sends them back as tool messages
            # of a new turn, so the model would never see them where it was trained to.
            raise ConfigError(f"tool parser {type(parser).__name__} continues the model's own turn (an inline "
                              "format, such as search_r1): the gateway answers whole chat turns; use it with "
                              "ctx.agent(parser=...) in a handler")
        buffer = TokenBuffer(chat_for, generate, parser, sampling=sampling, model=models[0], on_record=on_record,
                             max_concurrent=max_concurrent, tool_choice_retries=tool_choice_retries)
        job = JobGateway(self, job_id, buffer, models)
        self._jobs[job.token] = job
        return job

    def _retire(self, job: JobGateway) -> None:
        self._jobs.pop(job.token, None)
        self._ended[job.token] = job.job_id
        while len(self._ended) > ENDED_TOKENS_KEPT:
            self._ended.popitem(last=False)

    def _job(self, request: web.Request) -> JobGateway:
        token = request.match_info.get("token", "")
        job = self._jobs.get(token)
        if job is not None:
            return job
        if token in self._ended:
            raise RequestError(f"job {self._ended[token]} has ended; its gateway no longer answers", status=410,
                               code="job_ended")
        raise RequestError("unknown or missing job token in the URL (/jobs/<token>/v1/...)", status=401,
                           code="invalid_job_token")

    # ---------------------------------------------------------- handlers
    def _with_body(self, fn: Callable[..., Any]) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.StreamResponse:
            job = self._job(request)  # before the body: a refused request costs nothing
            task = asyncio.current_task()
            assert task is not None
            job._track(task)
            raw = await request.read()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not valid JSON: {e}") from e
            except RecursionError as e:
                raise RequestError("the request body is not valid JSON here: nested deeper than the parser "
                                   "goes") from e
            if not isinstance(body, dict):
                raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
            _refuse_lone_surrogates(raw, body)
            result: web.StreamResponse = await fn(request, job, body)
            return result

        return handler

    async def _models(self, request: web.Request) -> web.Response:
        return await openai_routes.models(request, self._job(request))

    async def _model(self, request: web.Request) -> web.Response:
        return await openai_routes.model(request, self._job(request))

    async def _response(self, request: web.Request) -> web.Response:
        return await responses_routes.retrieve(request, self._job(request))

    async def _delete_response(self, request: web.Request) -> web.Response:
        return await responses_routes.delete(request, self._job(request))

    def _job_route(self, fn: Callable[[web.Request, JobGateway], Any]) -> Callable[[web.Request], Any]:
        """A handler of ``fn(request, job)`` for the job the URL names (401 / 410 as for every route)."""
        async def handler(request: web.Request) -> web.StreamResponse:
            result: web.StreamResponse = await fn(request, self._job(request))
            return result

        return handler

    async def _responses_websocket(self, request: web.Request) -> web.StreamResponse:
        job = self._job(request)
        task = asyncio.current_task()
        assert task is not None
        job._track(task)  # the job's end closes it
        return await responses_routes.websocket(request, job)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except RequestError as e:
            return await _error(request, e.status, str(e), param=e.param, code=e.code)
        except web.HTTPRequestEntityTooLarge:
            return await _error(request, 413, f"the request body exceeds the gateway's {self.max_body_bytes}-byte limit",
                                code="request_too_large")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return await _error(request, e.status, f"{e.reason}: {request.method} {request.path} "
                                "(routes: /jobs/<token>/v1/chat/completions, completions, responses, responses/<id>, "
                                "responses/input_tokens, models, models/<model>, messages, messages/count_tokens)")
        except ContextLengthExceeded as e:
            # What the APIs answer, so harnesses stop or compact (litellm's ContextWindowExceededError, Claude
            # Code's compaction) instead of retrying a call that cannot succeed.
            return await _error(request, 400, _context_length_text(e), param="messages", code="context_length_exceeded")
        except (ValueError, ChatTemplateError) as e:  # sampling values no engine accepts, template failures
            return await _error(request, 400, str(e))
        except InferenceError as e:
            return await _error(request, 502, f"the model call failed: {type(e).__name__}: {e}", code="inference_error")
        except asyncio.CancelledError:
            # Cancelled because its job ended (not because the client left): answer as a later request is
            # answered, so the harness reads "job ended" instead of a dropped connection it would retry.
            token = request.match_info.get("token", "")
            task = asyncio.current_task()
            if token not in self._ended or task is None or task.cancelling() != 1:
                raise
            task.uncancel()
            return await _error(request, 410, f"job {self._ended[token]} has ended; its gateway no longer answers",
                                code="job_ended")
        except ConnectionResetError:
            raise
        except Exception as e:  # one bad request must never take the node's gateway down
            log.exception("gateway: %s %s failed", request.method, request.path)
            return await _error(request, 500, f"internal gateway error: {type(e).__name__}: {e}")
