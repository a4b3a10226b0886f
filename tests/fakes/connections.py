"""A raw ROUTER over real ZeroMQ playing the broker's side of the wire, for client-side tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from prorl_cli import protocol as P


def with_router(test: Callable[[zmq.asyncio.Socket], Awaitable[None]]) -> None:
    """Run ``test(router)`` on a fresh event loop with a bound ROUTER (no pytest-asyncio here)."""

    async def main() -> None:
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
        try:
            async with asyncio.timeout(60):
                await test(sock)
        finally:
            sock.close(0)

    asyncio.run(main())


async def receive_request(router: zmq.asyncio.Socket) -> tuple[bytes, dict[str, object]]:
    """The next request at ``router``: the sender's identity and its decoded header."""
    identity, *frames = await router.recv_multipart()
    return identity, P.decode_header(frames[0])
