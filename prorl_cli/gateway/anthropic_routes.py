"""Anthropic routes: ``POST /v1/messages`` (text, ``tool_use`` / ``tool_result``, streaming events, message
threads) and ``POST /v1/messages/count_tokens`` (Claude Code calls it to manage its context).

A message thread (the SDK's ``thread`` field, which its tool runner sends by default) keeps a conversation's
history on the server: a request with ``thread: {"type": "create"}`` is answered as any other and its reply
is kept under the message's ``id``; one with ``{"type": "continue", "previous_message_id": id}`` sends only
the new messages (and no ``system`` or ``tools``: the thread's are used). The gateway rebuilds the whole
request from what it kept, so a threaded conversation is recorded exactly as one that resends its history.
A job keeps its last :data:`THREADS_KEPT` thread replies; an id not among them is Anthropic's
``thread_not_found``, on which the SDK resends the whole history under a new thread.
"""

from __future__ import annotations

import collections
import enum
import json
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from prorl_cli.gateway.buffer import Reply
from prorl_cli.gateway.messages import AGENT_HEADER, RequestError, anthropic_request, request_agent
from prorl_cli.gateway.streaming import SseEvents, awaiting, open_sse

if TYPE_CHECKING:
    from prorl_cli.gateway.server import JobGateway

_STOP = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}

#: Thread replies a job keeps for ``thread: {"type": "continue"}`` (the oldest go first).
THREADS_KEPT = 64
#: The fields a thread takes from its ``create`` (Anthropic's API: a ``continue`` does not send them again).
THREAD_FIELDS = ("system", "tools")


class ThreadState(enum.Enum):
    """Where a kept thread reply stands: a ``continue`` may name it, one is being answered, or one was."""

    OPEN = "open"
    IN_FLIGHT = "in_flight"
    CONTINUED = "continued"


@dataclass
class ThreadReply:
    """A kept thread reply: the thread's ``system`` and ``tools`` as its ``create`` sent them (None: not sent) and
    its whole history as sent, ending with the reply as returned."""

    system: Any
    tools: Any
    messages: list[Any]
    state: ThreadState = ThreadState.OPEN


class StoredThreads(collections.OrderedDict[str, ThreadReply]):
    """A job's last :data:`THREADS_KEPT` thread replies, by message id."""

    def keep(self, message_id: str, reply: ThreadReply) -> None:
        self[message_id] = reply
        while len(self) > THREADS_KEPT:
            self.popitem(last=False)


def _thread(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's ``thread`` field, checked (None: the request is not threaded)."""
    thread = body.get("thread")
    if thread is None:
        return None
    kind = thread.get("type") if isinstance(thread, dict) else None
    if kind == "create":
        return thread
    if kind == "continue" and isinstance(thread.get("previous_message_id"), str) and thread["previous_message_id"]:
        return thread
    raise RequestError("thread must be {'type': 'create'} or {'type': 'continue', 'previous_message_id': ...}",
                       param="thread")


def _continued(job: JobGateway, body: dict[str, Any], thread: dict[str, Any]) -> tuple[dict[str, Any], ThreadReply]:
    """The whole request a ``continue`` stands for (the thread's fields and history, then the new messages), and
    the kept reply it continues. The errors are Anthropic's, whose codes the SDK recovers from by resending the
    whole history under a new thread."""
    previous = thread["previous_message_id"]
    kept = job.threads.get(previous)
    if kept is None:
        raise RequestError(f"thread: no thread state for previous_message_id {previous[:80]!r} (this job keeps its "
                           f"last {THREADS_KEPT} thread replies): replay the full conversation with thread "
                           "{'type': 'create'}", status=404, param="thread", code="thread_not_found")
    if kept.state is ThreadState.IN_FLIGHT:
        raise RequestError(f"thread: another request is still continuing from {previous[:80]!r}",
                           param="thread", code="thread_continue_in_flight")
    if kept.state is ThreadState.CONTINUED:
        raise RequestError(f"thread: the message {previous[:80]!r} has already been continued; continue from the "
                           "thread's most recent message id", param="thread", code="thread_already_continued")
    differ = [f for f in THREAD_FIELDS if body.get(f) is not None and body[f] != getattr(kept, f)]
    if differ:
        raise RequestError(f"thread: {' and '.join(differ)} differ from the thread's (a continue takes them from the "
                           "thread): send none, or replay the full conversation with thread {'type': 'create'}",
                           param="thread", code="thread_fingerprint_mismatch")
    new = body.get("messages")
    if not isinstance(new, list):
        raise RequestError("messages must be a list", param="messages")
    full = {k: v for k, v in body.items() if k not in THREAD_FIELDS}
    full.update({f: getattr(kept, f) for f in THREAD_FIELDS if getattr(kept, f) is not None})
    full["messages"] = [*kept.messages, *new]
    return full, kept


def _blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
    blocks += [{"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": c.name, "input": c.arguments}
               for c in reply.tool_calls]
    return blocks


def _stop_reason(reply: Reply) -> str:
    return "stop_sequence" if reply.stop_string is not None else _STOP[reply.finish_reason]


async def messages(request: web.Request, job: JobGateway, body: dict[str, Any]) -> web.StreamResponse:
    thread = _thread(body)
    kept: ThreadReply | None = None
    if thread is not None and thread["type"] == "continue":
        body, kept = _continued(job, body, thread)
    req = anthropic_request(body)
    req.agent = request_agent(request.match_info.get("agent"), request.headers.get(AGENT_HEADER), body)
    job.check_model(req.model)
    message_id = f"msg_{secrets.token_hex(12)}"
    resp = await open_sse(request) if req.stream else None
    if kept is not None:
        kept.state = ThreadState.IN_FLIGHT
    try:
        reply = await awaiting(resp, job.buffer.complete(req), job.gateway.keepalive_s)
    except BaseException:
        if kept is not None:
            kept.state = ThreadState.OPEN  # nothing was answered: the SDK's retry continues from the same message
        raise
    blocks = _blocks(reply)
    if kept is not None:
        kept.state = ThreadState.CONTINUED
    if thread is not None:
        # An empty turn is kept as the empty text it was (a message with no blocks is refused when sent back).
        job.threads.keep(message_id, ThreadReply(body.get("system"), body.get("tools"), [
            *body["messages"], {"role": "assistant", "content": blocks or ""}]))
    if resp is None:
        return web.json_response({
            "id": message_id, "type": "message", "role": "assistant", "model": req.model,
            "content": blocks, "stop_reason": _stop_reason(reply), "stop_sequence": reply.stop_string,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
            "prorl": {"segment": reply.segment, "continued": reply.continued},
        })
    events = SseEvents()
    events.add({"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": req.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}}}, "message_start")
    for i, block in enumerate(blocks):
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
