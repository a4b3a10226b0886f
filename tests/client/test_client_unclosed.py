"""Clients dropped without close(): a trainer that makes one per step must not run out of file descriptors.

Each connected client holds a DEALER socket, its handshake monitor, their ZeroMQ mailboxes and a TCP
connection. One collected unclosed releases them all and says so with a ResourceWarning naming the fix, as an
unclosed asyncio transport or aiohttp session does. Before, the loop kept an unclosed AsyncRolloutClient alive
through its watchdog and its connection's reader, and with it its sockets, for as long as the loop ran.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator

import pytest

from prorl_cli.client import AsyncRolloutClient, RolloutClient
from tests.harness import Deployment

#: Clients dropped per test: a leak of one socket each stands out far above any fd the test process opens itself.
DROPPED = 10
#: Far longer than releasing a few sockets takes: a test that hits it failed.
PATIENT_S = 30.0
ASYNC_HINT = r"^unclosed AsyncRolloutClient \(broker tcp://.*\).*use `async with AsyncRolloutClient\(\.\.\.\) as client:`"
SYNC_HINT = r"^unclosed RolloutClient \(broker tcp://.*\): use `with RolloutClient\(\.\.\.\) as client:` or call client\.close\(\)"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(tmp_path_factory.mktemp("unclosed") / "home", "unclosed", {"broker": {"journal": False}})
    d.start_broker()
    yield d
    d.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    # libzmq closes a socket's descriptors in its own threads, just after zmq_close returns: polled, not assumed.
    deadline = time.monotonic() + PATIENT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


async def until(predicate: Callable[[], bool], what: str) -> None:
    """:func:`wait_until` in a running loop, which must turn meanwhile (it closes what a finalizer hands it)."""
    deadline = time.monotonic() + PATIENT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.02)


def warned(record: pytest.WarningsRecorder, pattern: str) -> int:
    return sum(1 for w in record if issubclass(w.category, ResourceWarning) and re.search(pattern, str(w.message)))


def test_async_clients_dropped_unclosed_in_a_running_loop_release_their_sockets(deployment: Deployment) -> None:
    """The trainer's case: one long-lived loop, a client per step, never closed."""

    async def main() -> None:
        async with deployment.async_client() as warm:  # the ZeroMQ context's own threads and fds, made once
            await warm.ping()
        before = open_fds()
        with pytest.warns(ResourceWarning, match=ASYNC_HINT) as record:
            for _ in range(DROPPED):
                client = deployment.async_client()
                await client.ping()
                del client
            # A client whose watchdog is inside a heartbeat check at this moment is held by that check until it
            # returns: it is collected, and warned about, as soon as the loop lets the check end.
            await until(lambda: gc.collect() >= 0 and warned(record, ASYNC_HINT) >= DROPPED,
                        f"{DROPPED} ResourceWarnings, one per client dropped")
        assert warned(record, ASYNC_HINT) == DROPPED, [str(w.message) for w in record]
        me = asyncio.current_task()
        await until(lambda: open_fds() <= before and asyncio.all_tasks() == {me},
                    f"the fds to come back to {before} (now {open_fds()}) and the clients' tasks to end "
                    f"(left: {asyncio.all_tasks() - {me}})")

    asyncio.run(main())


def test_an_async_client_whose_loop_ended_releases_its_sockets_when_dropped(deployment: Deployment) -> None:
    """A client per ``asyncio.run``: the loop is closed by the time the client is collected."""

    async def step() -> AsyncRolloutClient:
        client = deployment.async_client()
        await client.ping()
        return client

    async def warm_up() -> None:
        async with deployment.async_client() as client:
            await client.ping()

    asyncio.run(warm_up())
    before = open_fds()
    with pytest.warns(ResourceWarning, match=ASYNC_HINT) as record:
        for _ in range(DROPPED):
            client = asyncio.run(step())
            del client
        gc.collect()
    assert warned(record, ASYNC_HINT) == DROPPED
    wait_until(lambda: open_fds() <= before, f"the fds to come back to {before} (now {open_fds()})")


def test_a_closed_async_client_is_not_warned_about(deployment: Deployment) -> None:
    async def main() -> None:
        async with deployment.async_client() as client:
            await client.ping()
        unconnected = deployment.async_client()  # never connected: holds nothing
        del client, unconnected

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert [str(w.message) for w in record if "unclosed" in str(w.message)] == []


def test_blocking_clients_dropped_unclosed_are_closed_and_say_so(deployment: Deployment) -> None:
    """RolloutClient drives its own loop (no thread): its finalizer runs that loop to close it."""
    warm = deployment.new_client()
    warm.ping()
    warm.close()
    before = open_fds()
    with pytest.warns(ResourceWarning, match=SYNC_HINT) as record:
        for _ in range(DROPPED):
            client = deployment.new_client()
            client.ping()
            del client
        gc.collect()
    assert warned(record, SYNC_HINT) == DROPPED
    assert warned(record, ASYNC_HINT) == 0, "the client it wraps was closed, not left to its own finalizer"
    wait_until(lambda: open_fds() <= before, f"the fds to come back to {before} (now {open_fds()})")


def test_a_blocking_client_dropped_inside_asyncio_code_is_closed_too(deployment: Deployment) -> None:
    """Its own loop cannot run where another runs: it is closed in a thread of its own (it was left open)."""
    warm = deployment.new_client()
    warm.ping()
    warm.close()
    clients: list[RolloutClient] = []

    async def drop() -> None:
        with pytest.warns(ResourceWarning, match=SYNC_HINT) as record:
            clients.clear()
            gc.collect()
        assert warned(record, SYNC_HINT) == DROPPED
        await until(lambda: open_fds() <= before, f"the fds to come back to {before} (now {open_fds()})")

    with asyncio.Runner() as runner:
        runner.get_loop()  # the asyncio code's loop, with its own fds, made before the count
        before = open_fds()
        for _ in range(DROPPED):
            clients.append(deployment.new_client())
            clients[-1].ping()
        runner.run(drop())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_clients_dropped_unclosed_under_warnings_as_errors_still_release_their_sockets(deployment: Deployment) -> None:
    """``-W error`` (or ``filterwarnings = error``) makes the warning raise in the finalizer: the sockets go first."""

    async def step() -> AsyncRolloutClient:
        client = deployment.async_client()
        await client.ping()
        return client

    warm = deployment.new_client()
    warm.ping()
    warm.close()
    before = open_fds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        for _ in range(DROPPED):
            client = deployment.new_client()
            client.ping()
            del client
            dropped = asyncio.run(step())
            del dropped
        gc.collect()
    wait_until(lambda: open_fds() <= before, f"the fds to come back to {before} (now {open_fds()})")
