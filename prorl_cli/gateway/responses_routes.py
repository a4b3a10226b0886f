"""OpenAI Responses route: ``POST /v1/responses``, streaming or not.

The API the OpenAI Agents SDK (its default model) and Codex speak. Agents
send the whole conversation as ``input`` items at every call (``store:
false`` or not); a request may instead name an earlier response in
``previous_response_id`` and send only the new items: the job keeps its last
:data:`RESPONSES_KEPT` stored responses for that, which ``GET /v1/responses/{id}``
also returns and ``DELETE /v1/responses/{id}`` forgets. One response is one model
turn: an ``output_text`` message when the model wrote text, then one
``function_call`` item per tool call, which the caller answers with
``function_call_output`` items naming their ``call_id``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import WSCloseCode, web

from prorl_cli.gateway.buffer import Reply
from prorl_cli.gateway.messages import (
    AGENT_HEADER,
    RequestError,
    ResponsesConversation,
    ResponsesRequest,
    openai_responses_request,
    request_agent,
    tool_call_message,
)
from prorl_cli.gateway.openai_routes import chat_logprobs, prorl_fields
from prorl_cli.gateway.streaming import SseEvents, awaiting, open_sse

if TYPE_CHECKING:
    from prorl_cli.gateway.server import JobGateway

#: Stored responses a job keeps for ``previous_response_id`` (the oldest go first).
RESPONSES_KEPT = 64


class StoredResponses(collections.OrderedDict[str, ResponsesConversation]):
    """A job's last :data:`RESPONSES_KEPT` stored responses, by id: the conversation each ends (what
    ``previous_response_id`` continues), and in :attr:`objects` the response object as it was returned (what
    ``GET /v1/responses/{id}`` answers). Both go together, so an id is retrievable exactly while it is continuable."""

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, dict[str, Any]] = {}

    def keep(self, response_id: str, conversation: ResponsesConversation, response: dict[str, Any]) -> None:
        self[response_id] = conversation
        self.objects[response_id] = response
        while len(self) > RESPONSES_KEPT:
            oldest, _ = self.popitem(last=False)
            self.objects.pop(oldest, None)

    def forget(self, response_id: str) -> ResponsesConversation | None:
        """Drop a kept response (``DELETE /v1/responses/{id}``); None when it was not kept."""
        self.objects.pop(response_id, None)
        return self.pop(response_id, None)


def _items(job: JobGateway, reply: Reply, parsed: ResponsesRequest, status: str) -> list[dict[str, Any]]:
    """The response's output items: the text message (when there is text, or nothing else), then the calls."""
    items: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        # Log-probs come only with ``include: ["message.output_text.logprobs"]`` (``top_logprobs`` alone asks for
        # none); without it OpenAI's text part carries an empty list, and so does this one.
        part: dict[str, Any] = {"type": "output_text", "text": reply.content, "annotations": [],
                                "logprobs": chat_logprobs(job, reply)["content"] if parsed.chat.logprobs else []}
        items.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "status": status,
                      "role": "assistant", "content": [part]})
    items += [{"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": f"call_{secrets.token_hex(12)}",
               "name": c.name, "arguments": json.dumps(c.arguments), "status": "completed"} for c in reply.tool_calls]
    return items


def _remember(job: JobGateway, response_id: str, parsed: ResponsesRequest, reply: Reply,
              items: list[dict[str, Any]], final: dict[str, Any]) -> None:
    """Keep the conversation this response ends (its turn in canonical form) for ``previous_response_id``, and
    the response object ``final`` for ``GET /v1/responses/{id}``."""
    names = dict(parsed.names)
    names.update({item["call_id"]: item["name"] for item in items if item["type"] == "function_call"})
    turn: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        turn["tool_calls"] = [tool_call_message(c.name, c.arguments) for c in reply.tool_calls]
    job.responses.keep(response_id, ResponsesConversation(parsed.conversation + [turn], names), final)


def _response(response_id: str, created_at: int, body: dict[str, Any], parsed: ResponsesRequest, status: str,
              output: list[dict[str, Any]], reply: Reply | None) -> dict[str, Any]:
    """The response object (``reply`` None: the in-progress one a stream starts with)."""
    req = parsed.chat
    out: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "model": req.model,
        "output": output, "error": None, "incomplete_details": None, "instructions": parsed.instructions,
        "metadata": body.get("metadata") or {}, "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature, "top_p": req.top_p, "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [], "max_output_tokens": req.max_tokens,
        "previous_response_id": parsed.previous_response_id, "reasoning": body.get("reasoning"),
        "store": parsed.store, "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": None,
        "user": body.get("user"),
    }
    if reply is not None:
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["usage"] = {
            "input_tokens": reply.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": reply.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}
        out["prorl"] = prorl_fields(reply)
    return out


async def responses(request: web.Request, job: JobGateway, body: dict[str, Any]) -> web.StreamResponse:
    parsed = openai_responses_request(body, job.responses)
    req = parsed.chat
    req.agent = request_agent(request.match_info.get("agent"), request.headers.get(AGENT_HEADER), body)
    job.check_model(req.model)
    response_id, created_at = f"resp_{secrets.token_hex(24)}", int(time.time())
    resp = await open_sse(request) if req.stream else None
    reply = await awaiting(resp, job.buffer.complete(req), job.gateway.keepalive_s)
    status = "incomplete" if reply.finish_reason == "length" else "completed"
    items = _items(job, reply, parsed, status)
    final = _response(response_id, created_at, body, parsed, status, items, reply)
    if parsed.store:
        _remember(job, response_id, parsed, reply, items, final)
    if resp is None:
        return web.json_response(final)
    await _stream(resp, _response(response_id, created_at, body, parsed, "in_progress", [], None), final)
    return resp


async def retrieve(request: web.Request, job: JobGateway) -> web.Response:
    """``GET /v1/responses/{id}`` (``client.responses.retrieve``): a response the job still keeps, as it was
    returned (a streamed one: as its ``response.completed`` event carried it); an unknown id, one evicted past the
    last :data:`RESPONSES_KEPT` or one created with ``store: false`` is OpenAI's 404."""
    # The API can replay a stored response's events (``?stream=true``); the gateway keeps the object only, and
    # an answer that is not a stream would leave the SDK's event reader waiting for events that never come.
    if request.query.get("stream", "false").lower() != "false":
        raise RequestError("stream is not supported when retrieving a response: the gateway keeps the response "
                           "object, not its events (retrieve it without stream)", param="stream")
    response_id = request.match_info["response_id"]
    found = job.responses.objects.get(response_id)
    if found is None:
        raise RequestError(f"Response with id {response_id!r} not found: this job keeps its last {RESPONSES_KEPT} "
                           "responses, not those created with store: false", status=404)
    return web.json_response(found)


async def delete(request: web.Request, job: JobGateway) -> web.Response:
    """``DELETE /v1/responses/{id}`` (``client.responses.delete``): the job forgets a response it keeps, so neither
    ``GET`` nor ``previous_response_id`` finds it again; answered as OpenAI answers. An id it does not keep is the
    404 ``GET`` gives."""
    response_id = request.match_info["response_id"]
    if job.responses.forget(response_id) is None:
        raise RequestError(f"Response with id {response_id!r} not found: this job keeps its last {RESPONSES_KEPT} "
                           "responses, not those created with store: false or deleted", status=404)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def input_tokens(request: web.Request, job: JobGateway, body: dict[str, Any]) -> web.Response:
    """``POST /v1/responses/input_tokens`` (``client.responses.input_tokens.count``): how many tokens the body
    ``responses.create`` would get renders to in the job's tokenizer and template (its ``previous_response_id``,
    ``instructions`` and tools included): the next call's ``usage.input_tokens``. Nothing is sampled or recorded.
    ``model`` may be left out, as OpenAI allows; a model the job does not serve is the 404 a create gets."""
    if body.get("model") is None:
        body = {**body, "model": job.models[0]}
    parsed = openai_responses_request(body, job.responses)
    job.check_model(parsed.chat.model)
    return web.json_response({"object": "response.input_tokens", "input_tokens": job.buffer.prompt_tokens(parsed.chat)})


#: The Responses API's endpoints besides create, retrieve, delete and input_tokens, and why the gateway does not serve each:
#: ``(method, path under /v1/responses/, why)``; each is answered with a 404 saying so, not a bare 405.
NOT_SERVED: tuple[tuple[str, str, str], ...] = (
    ("POST", "compact", "compaction summarises the conversation on OpenAI's servers, which would change the prompt "
                        "the trajectory records: summarise in the harness and send the summary as input"),
    ("POST", "{response_id}/cancel", "only background responses can be cancelled, and the gateway answers every "
                                     "response in its request (background: true is refused)"),
    ("GET", "{response_id}/input_items", "the gateway keeps a response's conversation as the chat template renders "
                                         "it, not its input items: keep the items in the harness"),
)


def not_served(why: str) -> Callable[[web.Request, JobGateway], Awaitable[web.Response]]:
    """A handler answering one of :data:`NOT_SERVED` with OpenAI's 404 body saying ``why``."""
    async def handler(request: web.Request, job: JobGateway) -> web.Response:
        raise RequestError(f"{request.method} {request.path.split('/v1/', 1)[-1]} is not served by the gateway: "
                           f"{why}", status=404, code="unsupported_endpoint")

    return handler


#: What a client of the Responses API's WebSocket mode is told (its transport shows no HTTP error body).
WEBSOCKET_REFUSAL = ("the gateway serves the Responses API over HTTP only (POST /v1/responses, streamed as "
                     "server-sent events with stream: true), not over a WebSocket: use the HTTP transport (the "
                     "OpenAI Agents SDK's default; its use_responses_websocket=False), not client.responses.connect()")


async def websocket(request: web.Request, job: JobGateway) -> web.StreamResponse:
    """``GET /v1/responses`` (the Responses API's WebSocket mode), refused readably: a WebSocket client shows a
    refused upgrade as its bare status, so the upgrade is accepted and the client's first ``response.create`` is
    answered with an ``error`` event saying what to use instead; then the socket is closed. A plain ``GET`` is a
    405 saying the same."""
    ws = web.WebSocketResponse()
    if not ws.can_prepare(request).ok:
        raise RequestError(WEBSOCKET_REFUSAL, status=405, code="websocket_not_supported")
    await ws.prepare(request)
    try:
        await ws.receive()  # the client's first event (or its close): the error answers it
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not job.closed or task is None:
            raise  # the client left
        # The job ended: close the socket as a socket (an HTTP error body cannot follow an upgrade).
        task.uncancel()
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"the job has ended")
        return ws
    if not ws.closed:
        await ws.send_json({"type": "error", "status": 400, "error": {
            "type": "invalid_request_error", "code": "websocket_not_supported", "message": WEBSOCKET_REFUSAL,
            "param": None}})
        await ws.close()
    return ws


async def _stream(resp: web.StreamResponse, started: dict[str, Any], final: dict[str, Any]) -> None:
    """The Responses API's events for a whole reply: created, each item added / its deltas / done, completed."""
    events = SseEvents()
    sequence = 0

    def add(kind: str, **fields: Any) -> None:
        nonlocal sequence
        events.add({"type": kind, "sequence_number": sequence, **fields}, kind)
        sequence += 1

    add("response.created", response=started)
    add("response.in_progress", response=started)
    for index, item in enumerate(final["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            add("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
            add("response.content_part.added", **at, content_index=0,
                part={"type": "output_text", "text": "", "annotations": []})
            add("response.output_text.delta", **at, content_index=0, delta=part["text"],
                logprobs=part.get("logprobs", []))
            add("response.output_text.done", **at, content_index=0, text=part["text"],
                logprobs=part.get("logprobs", []))
            add("response.content_part.done", **at, content_index=0, part=part)
        else:
            add("response.output_item.added", output_index=index,
                item={**item, "status": "in_progress", "arguments": ""})
            add("response.function_call_arguments.delta", **at, delta=item["arguments"])
            add("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        add("response.output_item.done", output_index=index, item=item)
    add("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
    await events.end(resp)
