"""An HTTP server that answers every request with one canned response (malformed engine replies)."""

from __future__ import annotations

import asyncio


class CannedHTTPServer:
    """Answers every request with ``status`` and ``body``; pass :meth:`handle` to ``asyncio.start_server``."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")), b"0"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n" % (self.status, len(self.body)) + self.body)
        await writer.drain()
        writer.close()
