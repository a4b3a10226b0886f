"""OpenAI routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` and
``GET /v1/models/{model}``."""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from prorl_cli.gateway.buffer import Reply
from prorl_cli.gateway.messages import (
    AGENT_HEADER,
    ChatRequest,
    RequestError,
    openai_chat_request,
    openai_completion_request,
    request_agent,
)
from prorl_cli.gateway.streaming import SseEvents, awaiting, open_sse

if TYPE_CHECKING:
    from prorl_cli.gateway.server import JobGateway


def _usage(reply: Reply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in reply.tool_calls]


def _token(chat: Any, token_id: int, logprob: float) -> dict[str, Any]:
    token = chat.decode([token_id])
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(job: JobGateway, reply: Reply) -> dict[str, Any]:
    """``choices[0].logprobs``: each output token's log-prob, and its alternatives when asked for
    (``top_logprobs``) and the engine returned them (else ``[]``)."""
    chat = job.buffer.segments[reply.segment].chat
    top = reply.top_logprobs or [[] for _ in reply.call.output_ids]
    content = [{**_token(chat, tid, lp), "top_logprobs": [_token(chat, t, alt) for t, alt in alts]}
               for tid, lp, alts in zip(reply.call.output_ids, reply.call.logprobs, top, strict=True)]
    return {"content": content, "refusal": None}


def _text_logprobs(job: JobGateway, reply: Reply, req: ChatRequest) -> dict[str, Any] | None:
    """A legacy completion's ``choices[0].logprobs`` when the request asked for them: each output token, its
    log-prob, its alternatives (``{token: logprob}``; ``None`` each with ``logprobs: 0``, ``{}`` from an engine
    that returns none) and where its text starts in the completion's."""
    if not req.logprobs:
        return None
    chat = job.buffer.segments[reply.segment].chat
    tokens = [chat.decode([t]) for t in reply.call.output_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top: list[dict[str, float] | None]
    if not req.top_logprobs:
        top = [None] * len(tokens)
    else:
        alts = reply.top_logprobs or [[] for _ in tokens]
        top = [{chat.decode([t]): lp for t, lp in a} for a in alts]
    return {"tokens": tokens, "token_logprobs": list(reply.call.logprobs), "top_logprobs": top,
            "text_offset": offsets}


def prorl_fields(reply: Reply) -> dict[str, Any]:
    """What the gateway adds to every response (OpenAI clients ignore unknown fields).

    A stream carries it on its finish-reason chunk, the last one with a choice: the usage chunk
    after it is sent only on request (``stream_options.include_usage``), as OpenAI does, and its
    empty ``choices`` is not what a client reading ``chunk.choices[0]`` expects.
    """
    return {"segment": reply.segment, "continued": reply.continued, "policy_version": reply.call.policy_version}


def _stream_base(req: ChatRequest, prefix: str, kind: str) -> dict[str, Any]:
    """The fields every chunk of one stream shares (OpenAI sends ``usage: null`` on each when usage was asked for)."""
    base: dict[str, Any] = {"id": f"{prefix}-{secrets.token_hex(12)}", "object": kind, "created": int(time.time()),
                            "model": req.model}
    if req.include_usage:
        base["usage"] = None
    return base


async def _end_stream(resp: web.StreamResponse, events: SseEvents, req: ChatRequest, base: dict[str, Any],
                      reply: Reply) -> None:
    """The usage chunk (only when asked for: its ``choices`` is empty), ``[DONE]``, end of body."""
    if req.include_usage:
        events.add({**base, "choices": [], "usage": _usage(reply)})
    events.add("[DONE]")
    await events.end(resp)


async def chat_completions(request: web.Request, job: JobGateway, body: dict[str, Any]) -> web.StreamResponse:
    req = openai_chat_request(body, job.memo)
    req.agent = request_agent(request.match_info.get("agent"), request.headers.get(AGENT_HEADER), body)
    job.check_model(req.model)
    if req.stream:
        resp = await open_sse(request)
        reply = await awaiting(resp, job.buffer.complete(req), job.gateway.keepalive_s)
        await _stream_chat(resp, job, req, reply)
        return resp
    reply = await job.buffer.complete(req)
    calls = _tool_calls(reply)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content if (reply.content or not calls) else None}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reply.finish_reason,
                              "logprobs": chat_logprobs(job, reply) if req.logprobs else None}
    return web.json_response({
        "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
        "model": req.model, "choices": [choice], "usage": _usage(reply), "prorl": prorl_fields(reply),
    })


async def _stream_chat(resp: web.StreamResponse, job: JobGateway, req: ChatRequest, reply: Reply) -> None:
    base = _stream_base(req, "chatcmpl", "chat.completion.chunk")

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

    events = SseEvents()
    events.add(chunk({"role": "assistant", "content": ""}))
    # Every output token's log-prob (the tool calls' too, as without streaming) on the first chunk after the role.
    logprobs: dict[str, Any] = {"logprobs": chat_logprobs(job, reply)} if req.logprobs else {}
    if reply.content:
        events.add(chunk({"content": reply.content}, **logprobs))
        logprobs = {}
    for i, call in enumerate(_tool_calls(reply)):
        events.add(chunk({"tool_calls": [{"index": i, **call}]}, **logprobs))
        logprobs = {}
    events.add({**chunk({}, reply.finish_reason, **logprobs), "prorl": prorl_fields(reply)})
    await _end_stream(resp, events, req, base, reply)


async def completions(request: web.Request, job: JobGateway, body: dict[str, Any]) -> web.StreamResponse:
    prompt, chat_like = openai_completion_request(body)
    chat_like.agent = request_agent(request.match_info.get("agent"), request.headers.get(AGENT_HEADER), body)
    job.check_model(chat_like.model)
    if chat_like.stream:
        resp = await open_sse(request)
        reply = await awaiting(resp, job.buffer.complete_text(prompt, chat_like), job.gateway.keepalive_s)
        base = _stream_base(chat_like, "cmpl", "text_completion")
        events = SseEvents()
        events.add({**base, "choices": [{"index": 0, "text": reply.content, "finish_reason": None,
                                         "logprobs": _text_logprobs(job, reply, chat_like)}]})
        events.add({**base, "choices": [{"index": 0, "text": "", "finish_reason": reply.finish_reason,
                                         "logprobs": None}], "prorl": prorl_fields(reply)})
        await _end_stream(resp, events, chat_like, base, reply)
        return resp
    reply = await job.buffer.complete_text(prompt, chat_like)
    return web.json_response({
        "id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
        "model": chat_like.model,
        "choices": [{"index": 0, "text": reply.content, "finish_reason": reply.finish_reason,
                     "logprobs": _text_logprobs(job, reply, chat_like)}],
        "usage": _usage(reply), "prorl": prorl_fields(reply),
    })


def _model_object(name: str) -> dict[str, Any]:
    """One served model as ``GET /v1/models`` lists it and ``GET /v1/models/{model}`` returns it."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "prorl"}


async def models(request: web.Request, job: JobGateway) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_object(m) for m in job.models]})


async def model(request: web.Request, job: JobGateway) -> web.Response:
    """``GET /v1/models/{model}`` (``client.models.retrieve``, litellm's and aider's model checks): a name the
    list shows, exactly; anything else is OpenAI's 404 ``model_not_found``."""
    name = request.match_info["model"]
    if name not in job.models:
        raise RequestError(f"The model {name!r} does not exist; this job serves {list(job.models)}", status=404,
                           param="model", code="model_not_found")
    return web.json_response(_model_object(name))
