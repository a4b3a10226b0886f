"""JSON over HTTP to OpenAI-compatible servers (vLLM), on aiohttp with a keep-alive pool.

A :class:`HttpClient` keeps its connections open between requests (one
pool per client, per event loop), so a generate call costs one request on a
warm connection instead of a TCP handshake and teardown. Cancelling the
awaiting task closes that request's connection (it never goes back to the
pool), which is what makes vLLM abort the request; a server that dies is an
error, not a hang.

aiohttp comes with the ``vllm`` and ``http`` extras (vLLM depends on it
anyway); without it these calls raise :class:`InferenceError` saying so.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prorl_cli.exceptions import BackendFault, InferenceError

MAX_RESPONSE_BYTES = 256 * 1024 * 1024
#: Connections a client keeps at least (a bridge's engine gets one per call of its capacity, if that is more).
POOL_SIZE = 256
_JSON_HEADERS = {"Accept": "application/json", "Content-Type": "application/json"}
_ACCEPT_HEADERS = {"Accept": "application/json"}


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


# Per-call work a generate call need not repeat (a raise is not cached: a bad URL fails every time).
@functools.lru_cache(maxsize=64)
def _check_url(url: str) -> None:
    split_url(url)


@functools.lru_cache(maxsize=16)
def _client_timeout(total_s: float) -> Any:
    import aiohttp

    return aiohttp.ClientTimeout(total=total_s)


class HttpClient:
    """A keep-alive connection pool; create it anywhere, use it from one event loop, :meth:`close` it."""

    def __init__(self, pool_size: int = POOL_SIZE) -> None:
        self.pool_size = pool_size
        self._session: Any = None  # aiohttp.ClientSession, made on first use (it binds the running loop)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> Any:
        try:
            import aiohttp
        except ImportError as e:
            raise InferenceError(
                "talking HTTP to vLLM needs aiohttp: install prorl[vllm] or prorl[http]"
            ) from e
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # No cookie jar: OpenAI-compatible servers set none worth keeping.
            connector = aiohttp.TCPConnector(limit=self.pool_size, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())
            self._loop = loop
        return self._session

    async def request(self, method: str, url: str, body: Any = None, *, timeout_s: float = 600.0) -> HttpResponse:
        """Send one request (``body`` is JSON-encoded when given) and read the whole response.

        Raises :class:`BackendFault` naming the URL when the server cannot be
        reached, closes the connection early, or does not answer in ``timeout_s``.
        """
        import aiohttp

        _check_url(url)  # ValueError naming a bad URL, before any connection
        session = self._get_session()
        data = None if body is None else json.dumps(body).encode()
        headers = _ACCEPT_HEADERS if data is None else _JSON_HEADERS
        timeout = _client_timeout(timeout_s)
        try:
            async with session.request(method, url, data=data, headers=headers, timeout=timeout) as resp:
                length = resp.content_length
                if length is not None and length > MAX_RESPONSE_BYTES:
                    raise InferenceError(f"{method} {url}: response of {length} bytes is too large")
                payload = await resp.content.read(MAX_RESPONSE_BYTES + 1)
                if len(payload) > MAX_RESPONSE_BYTES:
                    raise InferenceError(f"{method} {url}: response larger than {MAX_RESPONSE_BYTES} bytes")
                return HttpResponse(resp.status, {k.lower(): v for k, v in resp.headers.items()}, payload)
        except TimeoutError as e:
            raise BackendFault(f"{method} {url}: no answer within {timeout_s:g} s") from e
        except (aiohttp.ClientError, OSError) as e:
            # Name the socket's own error (ConnectionRefusedError, ...) where aiohttp wraps one.
            cause = getattr(e, "os_error", None) or e
            raise BackendFault(f"{method} {url}: {type(cause).__name__}: {cause}") from e

    async def close(self) -> None:
        """Close the pool's connections (only from the loop that opened them)."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                await session.close()


async def request(method: str, url: str, body: Any = None, *, timeout_s: float = 600.0) -> HttpResponse:
    """One request on a connection of its own (health checks, tests); generate paths use an :class:`HttpClient`."""
    client = HttpClient(pool_size=1)
    try:
        return await client.request(method, url, body, timeout_s=timeout_s)
    finally:
        await client.close()
