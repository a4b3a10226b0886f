"""Closing a client while others wait on it, and using it after (real broker and node).

Nothing reaches a closed client any more. Before, an ``AsyncRolloutClient`` closed while another task awaited
``results(ids)``, ``result(id)``, ``wait(ids)`` or a DAPO sampler's step left that task waiting for ever, and a
call after ``close()`` quietly connected again; the blocking client already refused (``ClientClosed``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.client import AsyncRolloutClient, Submitted
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import ClientClosed, ClientMisuse
from prorl_cli.protocol import JobSpec
from prorl_cli.training.sampler import DapoSampler, SamplerConfig
from tests.harness import Deployment, fixed_port, one_node_deployment

#: Far longer than any wake-up here takes: a consumer still waiting after it was left hanging (the bug).
PATIENT_S = 60.0
#: Jobs that never finish on their own: whatever ends a wait on them is the close under test.
HANGS = {"hang_in": "run"}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from one_node_deployment(tmp_path_factory, "close", {"broker": {"journal": False}})


def _cancel_all(deployment: Deployment, prefix: str) -> None:
    """Cancel the hanging jobs a test left (its own client is closed)."""
    with deployment.new_client() as client:
        client.cancel(list(client.list_jobs(prefix=prefix)))


async def _closed_under(client: AsyncRolloutClient, waiting: Sequence[Awaitable[Any]], *,
                        round_trip: bool = True) -> list[BaseException]:
    """Start each of ``waiting`` as a task, let them reach their wait, close ``client``; what each ended with."""
    tasks = [asyncio.ensure_future(w) for w in waiting]
    if round_trip:
        await client.ping()  # a round trip to the broker: every task runs meanwhile, up to its wait
    else:
        await asyncio.wait(tasks, timeout=0)  # no broker to answer: one turn of the loop starts each task
    assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
    await client.close()
    done, pending = await asyncio.wait(tasks, timeout=PATIENT_S)
    assert not pending, f"{len(pending)} waiter(s) still hang after close()"
    return [t.exception() or AssertionError(f"returned {t.result()!r}") for t in tasks]


def test_closing_an_async_client_ends_every_wait_on_it_with_client_closed(deployment: Deployment) -> None:
    """The jobs hang: only the close can end these waits. Each ends with ``ClientClosed``, at once."""

    async def main() -> None:
        client = deployment.async_client()
        ids = await client.submit("test", [HANGS], n=2, job_ids=["close-wait-0", "close-wait-1"], timeout_s=PATIENT_S)
        stream = client.results(ids)
        open_ended = client.results()
        ended_before = client.results(ids)
        await ended_before.aclose()

        async def consume() -> list[str]:
            return [r.state async for r in stream]

        errors = await _closed_under(client, [
            consume(), client.result(ids[0]), client.wait(ids), anext(open_ended),
            anext(aiter(client.as_completed(ids))),
        ])
        for error in errors:
            assert isinstance(error, ClientClosed), repr(error)
        assert "2 result(s) still missing" in str(errors[0]), errors[0]
        assert "job 'close-wait-0'" in str(errors[1]), errors[1]
        # A stream closed before its client ends as it did (every result it was to yield came, or it was let go).
        with pytest.raises(StopAsyncIteration):
            await ended_before.__anext__()
        with pytest.raises(ClientClosed):
            await stream.__anext__()
        with pytest.raises(ClientClosed, match="closed"):
            stream.add(["another"])

    asyncio.run(main())
    _cancel_all(deployment, "close-wait-")


def test_a_closed_async_client_refuses_every_call_instead_of_connecting_again(deployment: Deployment) -> None:
    async def main() -> None:
        client = deployment.async_client()
        (job,) = await client.submit("test", [{"echo": 1}])
        assert (await client.result(job, timeout_s=PATIENT_S)).ok
        assert not client.closed
        await client.close()
        assert client.closed and client.address is None
        refused = "this AsyncRolloutClient is closed; make a new one"
        with pytest.raises(ClientClosed, match=refused):
            await client.status()  # connected again before, to a broker nobody would close it from
        with pytest.raises(ClientClosed, match=refused):
            await client.submit("test", [{"echo": 2}])
        with pytest.raises(ClientClosed, match=refused):
            await client.result(job)  # even a result it holds: as the blocking client refuses
        with pytest.raises(ClientClosed, match=refused):
            client.results([job])
        with pytest.raises(ClientClosed, match=refused):
            client.as_completed([job])
        with pytest.raises(ClientClosed, match=refused):
            async with client:
                pytest.fail("a closed client was entered")
        assert client.address is None, "nothing connected again"
        await client.close()  # twice is fine

    asyncio.run(main())


def test_a_request_in_flight_when_the_client_closes_says_closed(tmp_path: Path) -> None:
    """A reply the close cut off is no sign of a broker gone (``BrokerUnavailable`` said so before). Nothing
    listens at the address: the request is surely in flight when the client closes."""

    async def main() -> None:
        client = AsyncRolloutClient(address=f"tcp://127.0.0.1:{fixed_port()}", config=ProrlConfig(home=str(tmp_path)),
                                    request_timeout_s=PATIENT_S)
        (error,) = await _closed_under(client, [client.status()], round_trip=False)
        assert isinstance(error, ClientClosed), repr(error)
        assert "closed while a request to the broker waited for its reply" in str(error), error

    asyncio.run(main())


class _Watched(AsyncRolloutClient):
    """A client that says when the broker took a submit (the sampler's groups are then in flight)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.submitted = asyncio.Event()

    async def submit_specs(self, specs: Sequence[JobSpec], instances: Sequence[Any]) -> Submitted:
        done = await super().submit_specs(specs, instances)
        self.submitted.set()
        return done


def test_closing_the_client_under_a_dapo_step_ends_the_step(deployment: Deployment) -> None:
    """A trainer that closes its client (its shutdown path, another task's error) had its sampler's step hang."""

    async def main() -> None:
        client = _Watched(deployment.name, config=deployment.load_config(), request_timeout_s=15.0)
        sampler = DapoSampler(client, "test", [HANGS], SamplerConfig(group_size=2, target_groups=1, max_in_flight=2,
                                                                      run_id="close-dapo", timeout_s=PATIENT_S))
        step = asyncio.ensure_future(sampler.step(0))
        await client.submitted.wait()
        (error,) = await _closed_under(client, [step])
        assert isinstance(error, ClientClosed), repr(error)

    asyncio.run(main())
    _cancel_all(deployment, "close-dapo-")


def test_a_closed_blocking_client_refuses_streams_too(deployment: Deployment) -> None:
    client = deployment.new_client()
    (job,) = client.submit("test", [{"echo": 1}])
    stream = client.results([job])
    assert not client.closed
    client.close()
    assert client.closed
    with pytest.raises(ClientClosed, match="this RolloutClient is closed"):
        next(stream)
    with pytest.raises(ClientClosed, match="this RolloutClient is closed"):
        client.results([job])  # said by the blocking client, not by the async one inside it
    with pytest.raises(ClientClosed, match="this RolloutClient is closed"):
        client.as_completed([job])


def test_a_blocking_client_waited_on_by_another_thread_refuses_a_close_saying_how_the_wait_ends(
    deployment: Deployment,
) -> None:
    """A blocking client's loop runs in the thread that waits: another thread cannot wake it, so its close is
    refused, naming the way out (the wait's own end, or cancelling its jobs from a client of that thread)."""
    client = deployment.new_client()
    (job,) = client.submit("test", [HANGS], job_ids=["close-thread-0"], timeout_s=PATIENT_S)
    started = threading.Event()
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            with client.results([job]) as stream:
                started.set()
                next(stream)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        assert started.wait(PATIENT_S)
        with deployment.new_client() as other:
            while not client._loop.is_running():  # the waiter's next() is under way (it set started just before)
                other.ping()
            with pytest.raises(ClientMisuse, match=r"in use by another thread: close it from that thread, once its "
                                                   r"call returned \(a wait there returns when its jobs end or its "
                                                   r"timeout_s passes; a client of this thread can cancel those jobs\)"):
                client.close()
            assert other.cancel([job]) == {job: "cancelled"}
        waiter.join(PATIENT_S)
        assert not waiter.is_alive() and outcome == [None], outcome
    finally:
        waiter.join(PATIENT_S)
        client.close()
