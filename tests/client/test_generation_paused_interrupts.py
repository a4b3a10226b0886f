"""A Ctrl-C (or a cancel) around a step boundary, against a real broker, node and bridge.

``generation_paused`` must release the pause it took however the step ends, a Ctrl-C while the pause
drains included, and must not resume a pause it did not take (someone else's, when its own never went out).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.protocol import StatusReport
from tests.client.test_client import wait_until
from tests.fakes.bridges import ThreadBridge
from tests.fakes.engines import CountingEngine
from tests.harness import Deployment
from tests.inference.conftest import HANDLERS


@pytest.fixture
def draining(tmp_path: Path) -> Iterator[Deployment]:
    """A deployment with one generate call in flight for minutes: a pause that waits for the drain does not return."""
    d = Deployment(tmp_path / "home")
    bridge: ThreadBridge[CountingEngine] | None = None
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        bridge = ThreadBridge(d, "b1", CountingEngine(delay_s=600.0))
        d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2})
        d.wait_for(lambda st: st.backends[0].inflight == 1, 30, "a generate call in flight", "n1")
        yield d
    finally:
        d.close()
        if bridge is not None:
            bridge.close()


def _interrupt() -> None:
    """What Python's SIGINT handler does while the event loop runs: raise KeyboardInterrupt out of it."""
    raise KeyboardInterrupt


@pytest.mark.parametrize("step", ["generation_paused", "sync_weights"])
def test_ctrl_c_while_the_pause_drains_resumes_generation(draining: Deployment, step: str, tmp_path: Path) -> None:
    d = draining
    client = d.new_client()
    main = threading.get_ident()

    def ctrl_c_once_paused() -> None:
        with d.new_client() as watcher:
            wait_until(lambda: watcher.status().generation_paused, 30, "the pause to reach the broker")
        signal.pthread_kill(main, signal.SIGINT)  # a real Ctrl-C, while the client awaits the drain

    sender = threading.Thread(target=ctrl_c_once_paused)
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            if step == "sync_weights":
                client.sync_weights(tmp_path, 1, drain_timeout_s=60)
            else:
                with client.generation_paused(1, drain_timeout_s=60):
                    pytest.fail("the block ran while a call was still in flight")
        sender.join(30)
        st = client.status()
        assert not st.generation_paused, "the Ctrl-C left the deployment paused"
    finally:
        client.close()


def test_a_cancel_while_the_pause_drains_resumes_generation(draining: Deployment) -> None:
    d = draining

    async def main() -> StatusReport:
        async with AsyncRolloutClient(d.name, address=d.address, config=d.load_config()) as client:

            async def step() -> None:
                async with client.generation_paused(1, drain_timeout_s=60):
                    pytest.fail("the block ran while a call was still in flight")

            task = asyncio.ensure_future(step())
            while not (await client.status()).generation_paused:  # until the pause reached the broker
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await client.status()

    assert not asyncio.run(main()).generation_paused, "the cancel left the deployment paused"


def test_ctrl_c_before_the_pause_went_out_neither_pauses_nor_resumes(tmp_path: Path) -> None:
    """Interrupted before its pause was sent, the step took no pause: it leaves the deployment as it found it."""
    d = Deployment(tmp_path / "home")
    try:
        d.start_broker()
        for paused_before in (False, True):
            if paused_before:
                d.client.pause_generation()  # someone else's pause: not this step's to resume
            client = d.new_client()
            try:
                client.connect()
                client._loop.call_soon(_interrupt)  # runs at the loop's first turn, before the pause is sent
                with pytest.raises(KeyboardInterrupt), client.generation_paused(1):
                    pytest.fail("the block ran")
                assert client.status().generation_paused == paused_before  # the client's loop runs on here
            finally:
                client.close()
            assert d.client.status().generation_paused == paused_before
    finally:
        d.close()


def test_a_cancel_or_ctrl_c_inside_the_block_resumes_generation(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home")
    try:
        d.start_broker()
        with pytest.raises(KeyboardInterrupt), d.client.generation_paused(1):
            assert d.client.status().generation_paused
            raise KeyboardInterrupt
        assert not d.client.status().generation_paused

        async def main() -> StatusReport:
            async with AsyncRolloutClient(d.name, address=d.address, config=d.load_config()) as client:
                inside = asyncio.Event()

                async def step() -> None:
                    async with client.generation_paused(2):
                        inside.set()
                        await asyncio.Event().wait()  # until cancelled

                task = asyncio.ensure_future(step())
                await inside.wait()
                assert (await client.status()).generation_paused
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return await client.status()

        assert not asyncio.run(main()).generation_paused
    finally:
        d.close()
