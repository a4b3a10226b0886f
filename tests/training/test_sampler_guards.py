"""The DAPO sampler refuses what it cannot serve, up front and by name, against a real broker and node: a run id
that names another run's jobs, a second step at once, policy versions that are not counts or go back, prompts
that are not a sequence, sampling keys the submit schema refuses; a resumed sampler runs again the groups an
earlier ``close()`` cancelled; a sampler closed after its client warns instead of raising."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import pytest

from prorl_cli.exceptions import ClientMisuse, ConfigError, SamplerClosed
from prorl_cli.training.sampler import (
    BlockingDapoSampler,
    CarriedGroup,
    DapoSampler,
    SamplerConfig,
    SamplerState,
    StepBatch,
)
from tests.harness import Deployment
from tests.training.test_sampler import aclient


def keep_all(rewards: Any) -> bool:
    """Every group informative: the ``test`` handler rewards every job 1.0."""
    return True


def echoes(batch: StepBatch) -> list[Any]:
    return [r.output["echo"] for r in batch.results]


def test_a_run_id_that_names_another_runs_jobs_is_refused_and_those_jobs_are_left_alone(stack: Deployment) -> None:
    """Two runs under one run_id submit the same ids; the broker returns the first run's job for each. A sampler that
    meets a job holding other work (another instance) than it submitted under that id raises, naming the run id,
    rather than train on the other run's rollouts, and neither cancels nor forgets that run's jobs."""
    cfg = SamplerConfig(group_size=2, target_groups=2, mode="sync", run_id="t-twin", informative=keep_all,
                        step_timeout_s=60)

    async def go() -> tuple[StepBatch, list[str], dict[str, str]]:
        async with aclient(stack) as client:
            first = DapoSampler(client, "test", [{"echo": "first-a"}, {"echo": "first-b"}], cfg)
            batch = await first.step()
            await first.close(cancel_in_flight=False)  # its step's results stay at the broker
            errors = []
            for state in (None, SamplerState()):  # a fresh sampler, and one told it resumes: neither may take them
                other = DapoSampler(client, "test", [{"echo": "other-a"}, {"echo": "other-b"}], cfg, state=state)
                with pytest.raises(ConfigError) as e:
                    await other.step()
                errors.append(str(e.value))
                with pytest.raises(ConfigError):  # no later step goes on under those ids either
                    await other.step()
                await other.close()
            held = await client.list_jobs(prefix="t-twin-")
            return batch, errors, held

    batch, errors, held = asyncio.run(go())
    assert sorted(echoes(batch)) == ["first-a", "first-a", "first-b", "first-b"]
    for message in errors:
        assert "'t-twin'" in message and "holds other work" in message and "its own run_id" in message, message
    # The first run's jobs are all still there, done: not cancelled, not forgotten by the run that met them.
    assert held == {r.job_id: "done" for r in batch.results}, held


def test_a_resumed_sampler_runs_again_the_groups_a_graceful_close_cancelled(stack: Deployment) -> None:
    """``close()`` cancels what is in flight. A trainer that saved ``state()`` and closed so gets those groups back
    cancelled: run again under the same ids (StepStats.rerun_jobs), never counted as failed groups."""
    slow = {"sleep_s": {"run": 1.0}}
    ps = [{"echo": 0}, {"echo": 1, **slow}, {"echo": 2, **slow}, {"echo": 3, **slow}]
    cfg = SamplerConfig(group_size=2, target_groups=1, max_in_flight=8, run_id="t-rerun", informative=keep_all,
                        step_timeout_s=60)

    async def go() -> tuple[SamplerState, set[str], StepBatch, list[str]]:
        async with aclient(stack) as client:
            first = DapoSampler(client, "test", ps, cfg)
            await first.step(policy_version=0)  # the fast group; the three slow ones are still running
            state = first.state()
            await first.close()  # the default: cancels them
            cancelled = set(first.cancelled_ids)
            resumed = DapoSampler(client, "test", ps, cfg, state=state.to_dict())
            batch = await resumed.step(policy_version=1)
            # The carried groups' jobs run again, to the end, under their ids.
            rerun = [r.state for r in await client.wait(sorted(cancelled), timeout_s=60)]
            await resumed.close()
            return state, cancelled, batch, rerun

    state, cancelled, batch, rerun = asyncio.run(go())
    assert sorted(c.position for c in state.carried) == [1, 2, 3] and len(cancelled) == 6
    stats = batch.stats
    assert stats.failed_groups == 0 and stats.rerun_jobs == 6 and stats.carried_in == 3, stats
    assert rerun == ["done"] * 6


def test_one_step_at_a_time_and_policy_versions_only_grow(stack: Deployment) -> None:
    """Two step() calls at once would both take step 0 (two batches sharing one StepStats, the counter moved twice):
    the second is refused. A version lower than an earlier step's would keep carried groups from ever going stale."""
    cfg = SamplerConfig(group_size=2, target_groups=1, max_in_flight=4, run_id="t-once", informative=keep_all,
                        step_timeout_s=60)

    async def go() -> tuple[list[Any], int, StepBatch]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "test", [{"echo": i} for i in range(4)], cfg)
            both = await asyncio.gather(sampler.step(3), sampler.step(3), return_exceptions=True)
            after = sampler.step_index
            with pytest.raises(ValueError, match=r"policy_version 2 is lower than 3, an earlier step's"):
                await sampler.step(2)
            batch = await sampler.step(3)  # the same version again is fine (a trainer that syncs every other step)
            await sampler.close()
            return list(both), after, batch

    both, after, batch = asyncio.run(go())
    batches = [b for b in both if isinstance(b, StepBatch)]
    refused = [e for e in both if isinstance(e, ClientMisuse)]
    assert len(batches) == 1 and len(refused) == 1, both
    assert "already taking step 0" in str(refused[0]) and "one step at a time" in str(refused[0])
    assert after == 1 and batch.step == 1


@pytest.mark.parametrize("version", [-1, 2.5, "2", True, None])
def test_a_policy_version_that_is_not_a_count_is_refused(version: Any) -> None:
    sampler = DapoSampler(None, "t", [{}], SamplerConfig(2, 1))  # type: ignore[arg-type]  # refused before any use
    with pytest.raises(ValueError, match=r"policy_version must be a non-negative integer, got "):
        asyncio.run(sampler.step(version))


def test_a_resumed_sampler_takes_no_version_below_its_saved_groups() -> None:
    state = SamplerState(step=4, cursor=8, carried=[CarriedGroup(position=7, step=3, policy_version=5)])
    sampler = DapoSampler(None, "t", [{}], SamplerConfig(2, 1), state=state)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"policy_version 0 is lower than 5.*passes its version on, not 0"):
        asyncio.run(sampler.step(0))


def test_prompts_that_are_not_a_sequence_of_instances_are_refused_up_front() -> None:
    """A str would be walked character by character (a job per character, all failing), a dict by position
    (KeyError: 0), a generator not at all; a datasets.Dataset is a sequence and is taken."""
    datasets = pytest.importorskip("datasets")
    pandas = pytest.importorskip("pandas")
    cfg = SamplerConfig(2, 1)
    for bad, message in (("hello", r"got one str; put a single instance in a list"),
                         ({"prompt": "x"}, r"got one dict; put a single instance in a list"),
                         ((p for p in [{"x": 1}]), r"indexed by position .* got generator; make it a list first"),
                         (pandas.DataFrame({"prompt": ["a"]}), r"DataFrame\[0\] raised KeyError")):
        with pytest.raises(TypeError, match=message):
            DapoSampler(None, "t", bad, cfg)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one prompt"):
        DapoSampler(None, "t", [], cfg)  # type: ignore[arg-type]
    table = datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}])
    assert DapoSampler(None, "t", table, cfg).prompts is table  # type: ignore[arg-type]


@pytest.mark.parametrize(("sampling", "message"), [
    ({"max_token": 4}, r"sampler sampling has unknown field\(s\) \['max_token'\]"),
    ({"max_tokens": "4"}, r"sampler sampling\.max_tokens must be an integer, got str"),
    ({"temperature": -1.0}, r"sampler sampling\.temperature must be in \[0, "),
])
def test_sampling_keys_are_checked_when_the_config_is_made(sampling: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SamplerConfig(group_size=2, target_groups=1, sampling=sampling)
    assert SamplerConfig(group_size=2, target_groups=1, sampling={"max_tokens": 4, "seed": 1}).sampling


def test_a_sampler_closed_after_its_client_warns_naming_the_jobs_left_running(
        stack: Deployment, caplog: pytest.LogCaptureFixture) -> None:
    """A ``with RolloutClient`` block that ended before ``sampler.close()``: nothing can cancel the jobs in flight any
    more. The close does not raise ClientClosed at the end of a run; it closes the sampler and says what was left
    running and how to cancel it."""
    slow = {"sleep_s": {"run": 30.0}}
    ps = [{"echo": 0}, {"echo": 1, **slow}, {"echo": 2, **slow}]
    cfg = SamplerConfig(group_size=2, target_groups=1, max_in_flight=6, run_id="t-late-close", informative=keep_all,
                        step_timeout_s=60)
    with stack.new_client() as client:
        sampler = BlockingDapoSampler(client, "test", ps, cfg)
        sampler.step()
        left = sampler.sampler.in_flight_jobs
    try:
        with caplog.at_level(logging.WARNING, logger="prorl_cli.training.sampler"):
            sampler.close()
        assert left == 4
        assert "the client was closed before this sampler: its 4 job(s) in flight (2 group(s))" in caplog.text
        assert "prorl cancel --prefix t-late-close-" in caplog.text
        with pytest.raises(SamplerClosed):  # closed, as after any close(): no step submits unwatched groups
            asyncio.run(sampler.sampler.step())
        held = stack.client.list_jobs(prefix="t-late-close-")
        assert sum(state not in ("done", "cancelled") for state in held.values()) == 4, held

        async def the_async_one() -> None:  # the same with an AsyncRolloutClient's async with block
            async with aclient(stack) as client:
                late = DapoSampler(client, "test", ps, replace(cfg, run_id="t-late-close-aio"))
                await late.step()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="prorl_cli.training.sampler"):
                await late.close()
            assert "prorl cancel --prefix t-late-close-aio-" in caplog.text

        asyncio.run(the_async_one())
    finally:
        stack.client.cancel(sorted(stack.client.list_jobs(prefix="t-late-close-")))
