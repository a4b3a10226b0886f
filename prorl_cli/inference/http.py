"""A small asyncio HTTP/1.1 client (no third-party dependency).

Enough for talking JSON to OpenAI-compatible servers: one connection per
request (``Connection: close``), Content-Length, chunked or read-to-EOF
bodies, a total timeout. Cancelling the awaiting task closes the socket,
which is what makes a dead server an error instead of a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prorl_cli.exceptions import InferenceError

MAX_RESPONSE_BYTES = 256 * 1024 * 1024


@dataclass
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON; :class:`InferenceError` names the problem when it is not."""
        try:
            return json.loads(self.body)
        except ValueError as e:
            snippet = self.body[:200].decode("utf-8", "replace")
            raise InferenceError(f"HTTP {self.status}: response is not JSON: {snippet!r}") from e


def split_url(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, path)`` of an http(s) URL; :class:`ValueError` otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port, parts.path or "/"


async def request(
    method: str, url: str, body: Any = None, *, timeout_s: float = 600.0
) -> HttpResponse:
    """Send one request (``body`` is JSON-encoded when given) and read the whole response.

    Raises :class:`InferenceError` naming the URL when the server cannot be
    reached, closes the connection early, or does not answer in ``timeout_s``.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await _request(method, url, body)
    except asyncio.TimeoutError as e:
        raise InferenceError(f"{method} {url}: no answer within {timeout_s:g} s") from e
    except (OSError, asyncio.IncompleteReadError) as e:
        raise InferenceError(f"{method} {url}: {type(e).__name__}: {e}") from e


async def _request(method: str, url: str, body: Any) -> HttpResponse:
    scheme, host, port, path = split_url(url)
    query = urlsplit(url).query
    target = path + (f"?{query}" if query else "")
    data = b"" if body is None else json.dumps(body).encode()
    ctx = ssl.create_default_context() if scheme == "https" else None
    reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
    try:
        head = (
            f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Accept: application/json\r\nContent-Length: {len(data)}\r\n"
        )
        if body is not None:
            head += "Content-Type: application/json\r\n"
        writer.write(head.encode("latin-1") + b"\r\n" + data)
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            raise InferenceError(f"{method} {url}: the server closed the connection without answering")
        fields = status_line.decode("latin-1").split(None, 2)
        if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
            raise InferenceError(f"{method} {url}: not an HTTP response: {status_line[:100]!r}")
        status = int(fields[1])
        headers: dict[str, str] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            total = 0
            while True:
                size_line = await reader.readline()
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                total += size
                if total > MAX_RESPONSE_BYTES:
                    raise InferenceError(f"{method} {url}: response larger than {MAX_RESPONSE_BYTES} bytes")
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
            payload = b"".join(chunks)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            if length > MAX_RESPONSE_BYTES:
                raise InferenceError(f"{method} {url}: response of {length} bytes is too large")
            payload = await reader.readexactly(length)
        else:
            payload = await reader.read(MAX_RESPONSE_BYTES)
        return HttpResponse(status, headers, payload)
    finally:
        writer.close()
        # The peer may already have reset the connection; the socket is closed either way.
        with contextlib.suppress(OSError):
            await writer.wait_closed()
