"""Anthropic routes: ``POST /v1/messages`` (text, ``tool_use`` / ``tool_result``, streaming events) and
``POST /v1/messages/count_tokens`` (Claude Code calls it to manage its context)."""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from aiohttp import web

from prorl_cli.gateway.buffer import Reply
from prorl_cli.gateway.messages import AGENT_HEADER, anthropic_request, request_agent
from prorl_cli.gateway.streaming import SseEvents, awaiting, open_sse

if TYPE_CHECKING:
    from prorl_cli.gateway.server import JobGateway

_STOP = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def _blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
    blocks += [{"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": c.name, "input": c.arguments}
               for c in reply.tool_calls]
    return blocks


def _stop_reason(reply: Reply) -> str:
    return "stop_sequence" if reply.stop_string is not None else _STOP[reply.finish_reason]


async def messages(request: web.Request, job: JobGateway, body: dict[str, Any]) -> web.StreamResponse:
    req = anthropic_request(body)
    req.agent = request_agent(request.match_info.get("agent"), request.headers.get(AGENT_HEADER), body)
    job.check_model(req.model)
    message_id = f"msg_{secrets.token_hex(12)}"
    if not req.stream:
        reply = await job.buffer.complete(req)
        return web.json_response({
            "id": message_id, "type": "message", "role": "assistant", "model": req.model,
            "content": _blocks(reply), "stop_reason": _stop_reason(reply), "stop_sequence": reply.stop_string,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
            "prorl": {"segment": reply.segment, "continued": reply.continued},
        })
    resp = await open_sse(request)
    reply = await awaiting(resp, job.buffer.complete(req), job.gateway.keepalive_s)
    events = SseEvents()
    events.add({"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": req.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}}}, "message_start")
    for i, block in enumerate(_blocks(reply)):
        start: dict[str, Any]
        if block["type"] == "text":
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.add({"type": "content_block_start", "index": i, "content_block": start}, "content_block_start")
        events.add({"type": "content_block_delta", "index": i, "delta": delta}, "content_block_delta")
        events.add({"type": "content_block_stop", "index": i}, "content_block_stop")
    events.add({"type": "message_delta",
                "delta": {"stop_reason": _stop_reason(reply), "stop_sequence": reply.stop_string},
                "usage": {"output_tokens": reply.completion_tokens}}, "message_delta")
    events.add({"type": "message_stop"}, "message_stop")
    await events.end(resp)
    return resp


async def count_tokens(request: web.Request, job: JobGateway, body: dict[str, Any]) -> web.StreamResponse:
    """The prompt's length in the job's tokenizer and template (with the request's tools); nothing is sampled."""
    req = anthropic_request(body, count_only=True)
    job.check_model(req.model)
    return web.json_response({"input_tokens": job.buffer.prompt_tokens(req)})
