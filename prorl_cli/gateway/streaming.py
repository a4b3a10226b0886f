"""Server-sent events: the response both APIs stream, and the error bodies of each API."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

#: Seconds between keep-alive comments while a stream waits for its model call (:func:`awaiting`).
KEEPALIVE_S = 10.0
#: An SSE comment: every SSE parser skips it (the SDKs' included), and it resets a client's read timeout.
KEEPALIVE = b": keep-alive\n\n"

#: Where :func:`open_sse` keeps a request's stream (an error after its headers went out ends it:
#: :func:`end_with_error`); a typed key where aiohttp has them (3.12+: a string key warns there).
SSE_RESPONSE: Any = (web.RequestKey("prorl_sse_response", web.StreamResponse) if hasattr(web, "RequestKey")
                     else "prorl_sse_response")


async def open_sse(request: web.Request) -> web.StreamResponse:
    """Start a ``text/event-stream`` response (headers go out at once, before the model answers)."""
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
    })
    await resp.prepare(request)
    request[SSE_RESPONSE] = resp
    # Events are small writes: without TCP_NODELAY, Nagle holds each one back until the
    # client's delayed ACK (tens of ms per event on Linux).
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return resp


async def awaiting(resp: web.StreamResponse | None, call: Awaitable[T], interval_s: float = KEEPALIVE_S) -> T:
    """``call``'s result; on a stream (``resp``), a keep-alive comment every ``interval_s`` until it comes.

    A turn is whole before its first event, and it may take minutes (a long turn, a busy cluster, generation
    paused for a weight update): without bytes meanwhile, a client with an idle or read timeout (the SDKs',
    a proxy's) would take the open stream for a dead one. Cancelling the request cancels ``call``.
    """
    if resp is None:
        return await call
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval_s)
            if done:
                return task.result()
            await resp.write(KEEPALIVE)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its cleanup (the conversation released, the model call cancelled) runs now


class SseEvents:
    """The events of one reply, written to the stream together.

    The reply is whole before its first event (the engine answers a call at
    once), so its events go out in one write: one syscall and one wake-up of
    the client instead of one per event. Clients read them exactly as if sent
    apart.
    """

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def add(self, data: Any, event: str | None = None) -> None:
        """One event: an ``event:`` line (Anthropic names its events) and a JSON ``data:`` line."""
        head = f"event: {event}\n" if event else ""
        payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        self._parts.append(f"{head}data: {payload}\n\n".encode())

    async def end(self, resp: web.StreamResponse) -> None:
        """Write every event added and end the response body."""
        await resp.write(b"".join(self._parts))
        self._parts.clear()
        await resp.write_eof()


async def end_with_error(resp: web.StreamResponse, body: dict[str, Any], *, anthropic: bool) -> web.StreamResponse:
    """End a stream whose 200 and headers are already out with the error ``body`` as its last event.

    The status can no longer change, so the error is an event each API's SDK raises as an error:
    Anthropic's ``event: error``, OpenAI's ``data: {"error": ...}`` (no ``[DONE]`` after it).
    """
    events = SseEvents()
    events.add(body, "error" if anthropic else None)
    await events.end(resp)
    return resp


def openai_error(status: int, message: str, *, kind: str | None = None, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """An OpenAI error body (the SDKs raise the matching ``APIStatusError`` subclass)."""
    return {"error": {"message": message, "type": kind or _kind(status), "param": param, "code": code}}


#: The ``error.details.error_code`` values of Anthropic's API that the gateway answers with; the SDK branches on
#: them (a ``thread_*`` code makes a message thread replay its whole history). The gateway's own codes
#: (``model_not_found``, ``job_ended``, ...) are not Anthropic's, so an Anthropic error body does not carry them.
ANTHROPIC_ERROR_CODES = frozenset({"thread_not_found", "thread_already_continued", "thread_continue_in_flight",
                                   "thread_fingerprint_mismatch"})


def anthropic_error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """An Anthropic error body; ``code``, when it is one of :data:`ANTHROPIC_ERROR_CODES`, as ``error.details``."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             410: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error"}
    error: dict[str, Any] = {"type": kinds.get(status, "api_error"), "message": message}
    if code in ANTHROPIC_ERROR_CODES:
        error["details"] = {"error_code": code}
    return {"type": "error", "error": error}


def _kind(status: int) -> str:
    # OpenAI types its 404s (an unknown model, response or URL) invalid_request_error, as every other 4xx but 401;
    # ``not_found_error`` is Anthropic's type, not OpenAI's.
    if status == 401:
        return "authentication_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"
