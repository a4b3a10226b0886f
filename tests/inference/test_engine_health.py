"""An engine's health check is answered while its generate calls fill every pooled connection."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from prorl_cli.inference import http
from prorl_cli.inference.openai_engine import OpenAIEngine
from prorl_cli.protocol import SamplingParams

COMPLETION = json.dumps({"choices": [{"token_ids": [4], "logprobs": {"token_logprobs": [-0.25]},
                                      "finish_reason": "length"}]}).encode()


MODELS = json.dumps({"data": [{"id": "m", "max_model_len": 1024}]}).encode()


class HeldServer:
    """Answers ``/health`` at once and holds every completion until :attr:`release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = 0
        self.all_held = asyncio.Event()
        self.want = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another on this connection
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n")
                                   if ln.lower().startswith(b"content-length")), b"0"))
                await reader.readexactly(length)
                line = head.split(b"\r\n")[0]
                body = MODELS if b"/models" in line else b"{}"
                if b"/completions" in line:
                    self.held += 1
                    if self.held >= self.want:
                        self.all_held.set()
                    await self.release.wait()
                    body = COMPLETION
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        finally:
            writer.close()


def test_health_is_checked_while_generate_calls_hold_the_whole_pool() -> None:
    # A bridge whose capacity reaches the pool's size (capacity 256 and more, for a large GPU server) has every
    # pooled connection busy generating: a health check queued behind them timed out three times in a row,
    # and the bridge took its healthy engine for dead and left, failing every call in flight.
    pytest.importorskip("aiohttp", reason="HTTP backends need aiohttp (pip install 'prorl[http]')")

    async def go() -> tuple[bool, int]:
        fake = HeldServer()
        fake.want = http.POOL_SIZE
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = OpenAIEngine(f"http://127.0.0.1:{port}", model="m")
        try:
            calls = [asyncio.ensure_future(engine.generate([1, 2], SamplingParams(max_tokens=1)))
                     for _ in range(http.POOL_SIZE)]
            await fake.all_held.wait()
            healthy = await engine.healthy()
            fake.release.set()
            done = await asyncio.gather(*calls)
            return healthy, len(done)
        finally:
            await engine.close()
            server.close()

    healthy, answered = asyncio.run(go())
    assert healthy, "the health check waited for a pooled connection and timed out"
    assert answered == http.POOL_SIZE


@pytest.mark.timeout(120)
def test_a_bridge_engine_sends_as_many_calls_at_once_as_its_capacity(tmp_path: Path) -> None:
    # The connection pool held 256 connections whatever the capacity: with capacity 300 the last 44 calls
    # waited in the bridge's pool, never reaching the server, while their timeout ran.
    pytest.importorskip("aiohttp", reason="HTTP backends need aiohttp (pip install 'prorl[http]')")
    from prorl_cli.config import ProrlConfig
    from prorl_cli.inference.serve import BridgeOptions, build_engine

    capacity = http.POOL_SIZE + 44

    async def go() -> int:
        fake = HeldServer()
        fake.want = capacity
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        opts = BridgeOptions(attach=f"http://127.0.0.1:{port}", capacity=capacity)
        engine = build_engine(opts, ProrlConfig(home=str(tmp_path)), "b1")
        try:
            await engine.start()
            calls = [asyncio.ensure_future(engine.generate([1, 2], SamplingParams(max_tokens=1)))
                     for _ in range(capacity)]
            await fake.all_held.wait()  # every call at the server at once (before the fix: 256, then a hang)
            fake.release.set()
            return len(await asyncio.gather(*calls))
        finally:
            await engine.close()
            server.close()

    assert asyncio.run(go()) == capacity
