"""LocalStack servers and clients over the life of a training script (real broker and node processes)."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

from prorl_cli.exceptions import BrokerRestarted
from prorl_cli.testing.harness import Deployment


def test_servers_started_from_a_thread_outlive_it(tmp_path: Path) -> None:
    """The README's recipe for asyncio code (asyncio.to_thread) in one asyncio.run, training in the next: the
    worker thread that started the servers is gone by then, and the kernel used to stop them with it."""
    with Deployment(tmp_path / "home", "thr") as stack:

        async def setup() -> None:
            await asyncio.to_thread(stack.start_broker)
            await asyncio.to_thread(stack.start_node, "n1")

        asyncio.run(setup())  # shuts its default executor down: the thread that called start_* ends
        starter = threading.Thread(target=stack.start_node, args=("n2",))
        starter.start()
        starter.join()

        async def train() -> list[str]:
            async with stack.async_client() as client:
                ids = await client.submit("test", [{"echo": i} for i in range(4)])
                return [r.state async for r in client.as_completed(ids, timeout_s=60)]

        assert asyncio.run(train()) == ["done"] * 4
        assert all(p.poll() is None for p in stack.procs.values()), {n: p.poll() for n, p in stack.procs.items()}
        status = stack.client.status()
        assert {n.node_id for n in status.nodes if n.alive} == {"n1", "n2"}


def test_the_stacks_clients_follow_a_broker_restarted_on_a_new_address(tmp_path: Path) -> None:
    """Its clients find the broker through the stack's rendezvous file, so they follow it as any client does."""
    with Deployment(tmp_path / "home", "mv") as stack:
        stack.start_broker()
        stack.start_node("n1")
        client = stack.new_client()
        assert client.process("test", {"echo": 0}, timeout_s=60).ok
        old = stack.address
        stack.kill("broker", signal.SIGKILL)
        stack.start_broker()
        assert stack.address != old
        # The first request may have gone to the old address before the move was seen: that one is refused as
        # BrokerRestarted (nothing left behind), and sent again it reaches the new broker.
        try:
            result = client.process("test", {"echo": 1}, timeout_s=60)
        except BrokerRestarted:
            result = client.process("test", {"echo": 1}, timeout_s=60)
        assert result.output["echo"] == 1
        # The stack's own client follows too: its waits go on at the new address.
        stack.start_node("n2")
        assert {n.node_id for n in stack.client.status().nodes if n.alive} == {"n1", "n2"}
        client.close()
