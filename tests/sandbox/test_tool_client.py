"""The host's tool-server connection: a call given up on leaves no reply behind for the next call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from prorl_cli.exceptions import SandboxError
from prorl_cli.sandbox.client import ToolClient
from prorl_cli.sandbox.toolserver import _HEADER


def test_a_cancelled_call_never_hands_its_reply_to_the_next_call(tmp_path: Path) -> None:
    async def main() -> None:
        release, got_first = asyncio.Event(), asyncio.Event()
        received: list[str] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # Answers each request in order, the first only once the test lets it go.
            try:
                while True:
                    (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                    op = json.loads(await reader.readexactly(length))["op"]
                    received.append(op)
                    if op == "first":
                        got_first.set()
                        await release.wait()
                    body = json.dumps({"ok": True, "result": f"reply to {op}"}).encode()
                    writer.write(_HEADER.pack(len(body)) + body)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        path = str(tmp_path / "tool.sock")
        server = await asyncio.start_unix_server(serve, path)
        client = await ToolClient.connect_unix(path)
        try:
            first = asyncio.ensure_future(client.call("first", 30.0))
            await got_first.wait()
            first.cancel()  # e.g. the handler's own timeout around a tool call
            with pytest.raises(asyncio.CancelledError):
                await first
            release.set()
            with pytest.raises(SandboxError, match="an earlier 'first' call was cancelled"):
                await client.call("second", 30.0)
        finally:
            await client.close()
            server.close()

    asyncio.run(asyncio.wait_for(main(), 30))
