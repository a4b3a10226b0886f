"""A client whose link to the broker drops and comes back (libzmq reconnects it): real broker, node and client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.testing.harness import Deployment


def test_results_of_running_jobs_reach_a_client_whose_link_was_dropped_and_remade(tmp_path: Path) -> None:
    """The broker drops a peer that sends a frame over ``max_message_bytes`` (libzmq does, and says nothing); the
    client's socket reconnects. It used to come back under a new routing id, and the results of the jobs it was
    waiting for went to the old one, so they never arrived."""
    with Deployment(tmp_path / "home", "rc", config={"broker": {"max_message_bytes": 1 << 20}}) as stack:
        stack.start_broker()
        stack.start_node("n1")

        async def run() -> list[str]:
            async with stack.async_client() as client:
                ids = await client.submit("test", [{"sleep_s": {"run": 2.0}, "echo": i} for i in range(2)])
                await stack_wait_running(client, ids)
                conn = client._conn
                assert conn is not None and conn.sock is not None
                await conn.sock.send(b"x" * (2 << 20))  # over the limit: the broker's libzmq drops this link
                return [r.state async for r in client.as_completed(ids, timeout_s=60)]

        assert asyncio.run(run()) == ["done", "done"]


async def stack_wait_running(client: AsyncRolloutClient, ids: list[str]) -> None:
    """Until both jobs run on the node (the link drops while they run); the broker pushes no such event to poll for."""
    states: dict[str, str] = {}
    for _ in range(600):
        states = await client.list_jobs()
        if all(states.get(j) in ("init", "run", "eval", "done") for j in ids):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"jobs never ran: {states}")


def test_a_submit_bigger_than_one_message_goes_as_several(tmp_path: Path) -> None:
    """3,000 small instances, 3 MiB in all, against a broker taking 1 MiB messages: the instances of one message
    travel in one frame, which the broker's socket refused whole (dropping the link without a word)."""
    with Deployment(tmp_path / "home", "big", config={"broker": {"max_message_bytes": 1 << 20}}) as stack:
        stack.start_broker()
        stack.start_node("n1")
        client = stack.new_client(request_timeout_s=30)
        ids = client.submit("noop", [{"prompt": "x" * 1024, "i": i} for i in range(3000)])
        assert len(ids.accepted) == 3000 and not ids.existing
        assert {r.state for r in client.wait(ids, timeout_s=300)} == {"done"}
        # Sent again (a trainer resuming), the same ids come back as the broker's jobs, not new ones.
        again = client.submit("noop", [{"prompt": "x" * 1024, "i": i} for i in range(3000)], job_ids=list(ids))
        assert again.existing == list(ids) and not again.accepted
        client.close()


def test_a_submit_in_several_messages_that_fails_partway_says_what_was_taken(tmp_path: Path) -> None:
    """Its later message refused (here: a task no node serves), the earlier ones' jobs already run: the error
    names every id to send again, and sending them again runs each job once. An id repeated across two messages,
    which the broker alone could not see, is refused before anything is sent."""
    from prorl_cli.exceptions import ProtocolError, UnknownJob

    with Deployment(tmp_path / "home", "part", config={"broker": {"max_message_bytes": 1 << 20}}) as stack:
        stack.start_broker()
        stack.start_node("n1")
        client = stack.new_client(request_timeout_s=30)
        instances = [{"prompt": "x" * 1024, "i": i} for i in range(2000)]
        specs = client.make_specs("noop", 1000) + client.make_specs("nosuch", 1000)
        with pytest.raises(UnknownJob, match="nosuch") as caught:  # the error a retry loop knows, as it came
            client.submit_specs(specs, instances)
        submitted = caught.value.submitted  # type: ignore[attr-defined]
        assert list(submitted) == [s.job_id for s in specs]
        taken = submitted.accepted
        assert 0 < len(taken) < 1000 and taken == list(submitted)[:len(taken)]
        assert any(f"the broker took {len(taken)} of this submit's 2000 jobs" in n for n in caught.value.__notes__)
        again = client.submit("noop", instances, job_ids=list(submitted))
        assert again.existing == taken and again.accepted == list(submitted)[len(taken):]
        assert {r.state for r in client.wait(submitted, timeout_s=300)} == {"done"}
        twice = client.make_specs("noop", 2000)
        twice[-1] = client.make_specs("noop", 1, job_ids=[twice[0].job_id])[0]
        with pytest.raises(ProtocolError, match="appears twice"):
            client.submit_specs(twice, instances)
        assert not any(job_id == twice[1].job_id for job_id in client.list_jobs())
        client.close()


def test_a_small_submit_whose_later_specs_are_larger_than_its_first_goes_as_several(tmp_path: Path) -> None:
    """A submit of at most 256 jobs goes whole on its first spec's size. Here the first spec is plain and the 249
    after it each carry 4,096 stop tokens (about 20 KiB packed): 5 MiB of header, which the broker could not even
    read a request id from, so the submit used to wait out its timeout. It now goes as several messages."""
    from dataclasses import replace

    from prorl_cli.protocol import SamplingParams

    with Deployment(tmp_path / "home", "wide") as stack:
        stack.start_broker()
        stack.start_node("n1")
        client = stack.new_client(request_timeout_s=30)
        specs = client.make_specs("noop", 250)
        stops = SamplingParams(stop_token_ids=list(range(1 << 30, (1 << 30) + 4096)))
        specs[1:] = [replace(spec, sampling=stops) for spec in specs[1:]]
        ids = client.submit_specs(specs, [{"i": i} for i in range(250)])
        assert ids.accepted == [s.job_id for s in specs] and not ids.existing
        assert {r.state for r in client.wait(ids, timeout_s=120)} == {"done"}
        client.close()


def test_a_config_shared_by_clients_of_two_deployments_is_not_changed(tmp_path: Path) -> None:
    from prorl_cli.config import load_config

    config = load_config(None, {"home": str(tmp_path), "deployment": "one"})
    first = AsyncRolloutClient("a", config=config)
    second = AsyncRolloutClient("b", config=config)
    assert (first.config.deployment, second.config.deployment, config.deployment) == ("a", "b", "one")
