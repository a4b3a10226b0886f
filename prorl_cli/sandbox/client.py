"""Host side of the tool server protocol: one connection per sandbox, asyncio.

Frames are a 4-byte big-endian length and a JSON object (see
:mod:`prorl_cli.sandbox.toolserver`, whose constants this module shares).
Calls on one connection are serialised; the tool server runs them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

from prorl_cli.exceptions import SandboxError, SandboxTimeout, ToolError
from prorl_cli.sandbox.toolserver import _HEADER, MAX_FRAME_BYTES

# Added to a tool's own timeout before the host gives up on the reply: the
# server needs a moment to interrupt a command and collect its output.
REPLY_MARGIN_S = 10.0


class ToolClient:
    """An open connection to one sandbox's tool server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: str) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()
        self.where = where
        #: Why this connection was closed out of step with the server (a call given up on); later calls fail naming it.
        self._broken: str | None = None

    @classmethod
    async def connect_unix(cls, path: str, timeout_s: float = 10.0) -> ToolClient:
        """Connect to a tool server's Unix socket."""
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_unix_connection(path, limit=MAX_FRAME_BYTES)
        except (TimeoutError, OSError) as e:
            raise SandboxError(f"cannot connect to the tool server at {path}: {e}") from e
        return cls(reader, writer, path)

    @classmethod
    async def connect_tcp(cls, host: str, port: int, timeout_s: float = 10.0) -> ToolClient:
        """Connect to a tool server started with ``--tcp`` (benchmarks)."""
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
        except (TimeoutError, OSError) as e:
            raise SandboxError(f"cannot connect to the tool server at {host}:{port}: {e}") from e
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, f"{host}:{port}")

    async def call(self, op: str, reply_timeout_s: float, **fields: Any) -> Any:
        """Send one request; return its ``result`` or raise the error it names.

        ``reply_timeout_s`` bounds the wait for the reply (the tool's own
        timeout plus :data:`REPLY_MARGIN_S` is a good value).
        """
        data = json.dumps({"op": op, **fields}, separators=(",", ":")).encode()
        async with self._lock:
            if self._broken is not None:
                raise SandboxError(f"tool server connection at {self.where} is closed: {self._broken}")
            try:
                self._writer.write(_HEADER.pack(len(data)) + data)
                await self._writer.drain()
                async with asyncio.timeout(reply_timeout_s):
                    header = await self._reader.readexactly(_HEADER.size)
                (length,) = _HEADER.unpack(header)
                if length > MAX_FRAME_BYTES:
                    raise SandboxError(f"tool server at {self.where} sent a {length}-byte frame")
                async with asyncio.timeout(reply_timeout_s):
                    body = await self._reader.readexactly(length)
            except TimeoutError as e:
                # The stream is now out of step with the server: close it.
                self._broken = f"an earlier {op!r} call got no reply within {reply_timeout_s:.1f} s"
                self._writer.close()
                raise SandboxTimeout(f"tool call {op!r} got no reply within {reply_timeout_s:.1f} s") from e
            except asyncio.CancelledError:
                # Its reply would answer the next call on this connection: close it, so later calls fail instead.
                self._broken = f"an earlier {op!r} call was cancelled before its reply came"
                self._writer.close()
                raise
            except (OSError, asyncio.IncompleteReadError) as e:
                raise SandboxError(
                    f"tool server at {self.where} went away during {op!r} (sandbox stopped or crashed): {e}"
                ) from e
        reply = json.loads(body)
        if reply.get("ok"):
            return reply.get("result")
        error = reply.get("error") or {}
        kind, message = error.get("type", "Error"), error.get("message", "")
        if kind == "ToolError":
            raise ToolError(f"{op}: {message}")
        raise SandboxError(f"{op}: tool server error {kind}: {message}")

    async def close(self) -> None:
        """Close the connection (the tool server keeps running)."""
        self._writer.close()
        # OSError: the server side is already gone; nothing left to close.
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
