"""A trainer's slips against a real deployment: one job id where a list is expected, a stream used after it was
closed, and an id the broker never had added to a running stream. Each is refused or reported at once, naming
the problem, instead of acting on the id's characters, waiting for ever, or poisoning the stream."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.exceptions import UnknownJob
from prorl_cli.protocol import JobResult
from tests.harness import Deployment, one_node_deployment

#: Far longer than any of these jobs take: a test that hits it failed (the stream waited instead of ending).
PATIENT_S = 60.0


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from one_node_deployment(tmp_path_factory, "misuse", {"broker": {"journal": False}})


def _refused_as_one_id() -> pytest.RaisesExc[TypeError]:
    """The refusal of one id given where a collection of ids goes: a TypeError that names the parameter and the fix."""
    return pytest.raises(TypeError, match=r"^job_ids: a list of job ids, got one .*; put a single id in a list$")


def test_one_id_where_ids_are_expected_is_refused_by_the_blocking_client(deployment: Deployment) -> None:
    """A str is iterable: taken as ids, ``cancel("rollout-7")`` cancelled jobs ``r``, ``o``, ... and
    ``forget`` dropped an unrelated job named ``o``; the one job meant ran on."""
    client = deployment.new_client()
    try:
        (hung,) = client.submit("test", [{"hang_in": "run"}], job_ids=["rollout-7"], timeout_s=PATIENT_S)
        (bystander,) = client.submit("test", [{"echo": "o"}], job_ids=["o"])
        client.wait([bystander], timeout_s=PATIENT_S)
        streams = list(client._aio._streams)
        for one in (hung, hung.encode(), bytearray(hung.encode())):
            with _refused_as_one_id():
                client.cancel(one)  # type: ignore[arg-type]  # the slip under test
            with _refused_as_one_id():
                client.forget(one)  # type: ignore[arg-type]
            with _refused_as_one_id():
                client.forget_local(one)  # type: ignore[arg-type]
            with _refused_as_one_id():
                client.wait(one, timeout_s=PATIENT_S)  # type: ignore[arg-type]
            with _refused_as_one_id():
                client.results(one)  # type: ignore[arg-type]
            with _refused_as_one_id():
                client.as_completed(one)  # type: ignore[arg-type]  # at the call
            with _refused_as_one_id():
                client.submit("test", [{}, {}], job_ids="ab")
            with _refused_as_one_id():
                client.make_specs("test", 2, job_ids="ab")
        with client.results([bystander]) as stream:
            with _refused_as_one_id():
                stream.add(hung)  # type: ignore[arg-type]
            assert stream.pending == {bystander}
        assert client._aio._streams == streams, "a refused results() left a stream registered with the client"
        # Nothing acted on the characters: the job meant still runs, the job named "o" is still there.
        assert list(client.list_jobs(prefix="rollout-7")) == [hung]
        assert client.list_jobs(prefix="o") == {bystander: "done"}
        assert client.list_jobs(prefix="a") == {} and client.list_jobs(prefix="b") == {}
        assert client.cancel([hung]) == {hung: "cancelled"}, "the job meant was still running"
    finally:
        client.close()


def test_one_id_where_ids_are_expected_is_refused_by_the_async_client(deployment: Deployment) -> None:
    async def main(client: AsyncRolloutClient) -> None:
        (done,) = await client.submit("test", [{"echo": 1}], job_ids=["async-one"])
        await client.wait([done], timeout_s=PATIENT_S)

        for one in (done, done.encode()):
            with _refused_as_one_id():
                await client.cancel(one)  # type: ignore[arg-type]  # the slip under test
            with _refused_as_one_id():
                await client.forget(one)  # type: ignore[arg-type]
            with _refused_as_one_id():
                await client.wait(one)  # type: ignore[arg-type]
            with _refused_as_one_id():
                client.forget_local(one)  # type: ignore[arg-type]
            with _refused_as_one_id():
                client.results(one)  # type: ignore[arg-type]
            with _refused_as_one_id():
                client.as_completed(one)  # type: ignore[arg-type]  # at the call
        with _refused_as_one_id():
            await client.submit("test", [{}, {}], job_ids="ab")
        stream = client.results([done])
        with _refused_as_one_id():
            stream.add(done)  # type: ignore[arg-type]
        assert [r.job_id async for r in stream] == [done]
        assert done in client._results, "the refused forget dropped nothing"

    async def run() -> None:
        async with deployment.async_client() as client:
            await main(client)

    asyncio.run(run())


def test_next_on_a_closed_stream_ends_it_instead_of_waiting(deployment: Deployment) -> None:
    """Nobody feeds a closed stream: ``next`` after ``close`` raised nothing and waited for ever (here: until the
    stream's timeout, which the test would report as a failure)."""
    client = deployment.new_client()
    try:
        ids = client.submit("test", [{"echo": 1}, {"hang_in": "run"}], timeout_s=PATIENT_S)
        stream = client.results(ids, timeout_s=PATIENT_S)
        assert next(stream).job_id == ids[0]
        stream.close()
        with pytest.raises(StopIteration):
            next(stream)
        assert list(stream) == []
        client.cancel(ids)
    finally:
        client.close()
    with pytest.raises(StopIteration):
        next(stream)  # its client (and the client's loop) closed too: still no wait, no ClientClosed


def test_closing_a_stream_ends_a_consumer_waiting_on_it(deployment: Deployment) -> None:
    async def main(client: AsyncRolloutClient) -> None:
        (hung,) = await client.submit("test", [{"hang_in": "run"}], timeout_s=PATIENT_S)
        stream = client.results([hung])
        waiting = asyncio.get_running_loop().create_task(stream.__anext__())
        await client.ping()  # a round trip to the broker: the consumer runs meanwhile, up to its wait
        assert not waiting.done()
        await stream.aclose()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, PATIENT_S)
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await client.cancel([hung])

    async def run() -> None:
        async with deployment.async_client() as client:
            await main(client)

    asyncio.run(run())


def _drain(stream: Any, calls: int = 10) -> tuple[list[str], list[str]]:
    """Up to ``calls`` ``next`` calls: the ids yielded, and the messages of the ``UnknownJob`` raised meanwhile."""
    got: list[str] = []
    unknown: list[str] = []
    for _ in range(calls):
        try:
            result: JobResult = next(stream)
        except StopIteration:
            break
        except UnknownJob as e:
            unknown.append(str(e))
            continue
        got.append(result.job_id)
    return got, unknown


def test_an_unknown_id_added_to_a_stream_is_reported_once_and_the_rest_still_come(deployment: Deployment) -> None:
    """Before, every later ``next`` raised ``UnknownJob`` again, the result already received never came out,
    and the stream could never end."""
    client = deployment.new_client()
    try:
        good = client.submit("test", [{"echo": k} for k in range(3)])
        stream = client.results(good[:1], timeout_s=PATIENT_S)
        client.result(good[0], timeout_s=PATIENT_S)  # received before the bad id is added
        stream.add(["typo-id", *good[1:]])
        got, unknown = _drain(stream)
        assert sorted(got) == sorted(good), (got, unknown)
        assert len(unknown) == 1 and "typo-id" in unknown[0] and not any(g in unknown[0] for g in good), unknown
        assert stream.pending == set()
        with pytest.raises(StopIteration):
            next(stream)
        stream.close()
    finally:
        client.close()


def test_an_unknown_id_does_not_stop_an_open_ended_stream(deployment: Deployment) -> None:
    client = deployment.new_client()
    try:
        with client.results() as stream:
            stream.add(["no-such-job"])
            with pytest.raises(UnknownJob, match="no-such-job"):
                next(stream)
            (later,) = client.submit("test", [{"echo": 1}])
            assert next(stream).job_id == later
    finally:
        client.close()

