"""The DAPO sampler against a real broker and node running the seeded heavy-tailed ``dapo_sim`` handler."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.training.sampler import DapoSampler, SamplerConfig, SamplerState, StepBatch
from tests.harness import Deployment

REPO = Path(__file__).resolve().parents[2]


def prompts(n: int = 12) -> list[dict[str, Any]]:
    """A third always right, a third always wrong (zero variance), a third mixed; some with a long tail."""
    out = []
    for i in range(n):
        p = (0.0, 1.0, 0.5)[i % 3]
        out.append({"p": p, "scale_s": 0.02 if i % 4 else 0.5, "alpha": 1.2, "max_s": 1.5, "seed": 7})
    return out


def aclient(dep: Deployment) -> AsyncRolloutClient:
    return AsyncRolloutClient(dep.name, address=dep.address, config=dep.load_config())


def check_batch(batch: StepBatch, cfg: SamplerConfig) -> None:
    assert len(batch.groups) == cfg.target_groups
    for g in batch.groups:
        assert len(g.results) == cfg.group_size
        assert len(set(g.rewards)) > 1, f"zero-variance group {g.group_id} was kept: {g.rewards}"
        assert all(r.ok for r in g.results)


def test_async_sampler_targets_carry_over_and_staleness(stack: Deployment) -> None:
    cfg = SamplerConfig(group_size=4, target_groups=2, max_in_flight=16, run_id="t1", max_staleness=1, step_timeout_s=60)

    async def go() -> tuple[list[StepBatch], dict[str, int], DapoSampler]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", prompts(), cfg)
            batches = [await sampler.step(policy_version=v) for v in (0, 1, 3)]  # 3: jumps past the staleness limit
            await sampler.close()
            # Every job the sampler cancelled is cancelled at the broker, and stays so.
            used = {r.job_id for b in batches for r in b.results}
            assert not used & sampler.cancelled_ids
            states = await client.cancel(sorted(sampler.cancelled_ids))
            return batches, states, sampler

    batches, states, sampler = asyncio.run(go())
    seen_groups: set[str] = set()
    for b in batches:
        check_batch(b, cfg)
        for g in b.groups:
            assert g.group_id not in seen_groups, "a group was counted twice"
            seen_groups.add(g.group_id)
            assert b.policy_version - g.policy_version <= cfg.max_staleness
    s0, s1, s2 = (b.stats for b in batches)
    assert s0.filtered + s1.filtered + s2.filtered > 0  # p = 0 and p = 1 groups were dropped
    assert s0.carried_out > 0 and s1.carried_in == s0.carried_out  # running groups kept for the next step
    # Groups submitted under version 0 complete into step 1 tagged with version 0.
    assert any(g.policy_version == 0 for g in batches[1].groups) or s1.carried_in > 0
    assert s2.stale_groups > 0 and s2.cancelled_jobs > 0  # version 3 - 1 > 1: stale ones cancelled
    # Cancelled in the steps (stale) and at close (still running), all counted.
    assert len(states) == len(sampler.cancelled_ids) >= sum(b.stats.cancelled_jobs for b in batches) > 0
    assert set(states.values()) == {"cancelled"}, states  # never reported done afterwards
    assert sampler.ignored_results >= 0


def test_sync_mode_and_failed_groups(stack: Deployment) -> None:
    ps = [{**p, "fail_p": 0.2, "scale_s": 0.01} for p in prompts()]
    cfg = SamplerConfig(group_size=3, target_groups=2, mode="sync", run_id="t2", step_timeout_s=60)

    async def go() -> StepBatch:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", ps, cfg)
            batch = await sampler.step()
            assert sampler.in_flight_jobs == 0  # batch by batch: nothing carried
            await sampler.close()
            return batch

    batch = asyncio.run(go())
    check_batch(batch, cfg)
    assert batch.stats.submitted_groups % cfg.target_groups == 0
    assert batch.stats.failed_groups > 0  # a failed member drops its group (and cancels its siblings)


def test_a_seeded_run_gives_each_rollout_its_own_seed_and_a_rerun_the_same(stack: Deployment) -> None:
    """One seed for a whole group would give it identical rollouts on an engine that honours seeds: no
    variance, every group filtered. The seed numbers the run's rollouts instead (group position p, rollout k:
    derive_seed(seed, p x group_size + k))."""
    from prorl_cli.protocol import derive_seed

    instances = [{"echo": i, "echo_sampling": True} for i in range(4)]

    def seeds(run_id: str) -> dict[str, list[int]]:
        cfg = SamplerConfig(group_size=3, target_groups=2, mode="sync", run_id=run_id, step_timeout_s=60,
                            sampling={"seed": 100, "max_tokens": 8}, informative=lambda rewards: True)

        async def go() -> StepBatch:
            async with aclient(stack) as client:
                sampler = DapoSampler(client, "test", instances, cfg)
                try:
                    return await sampler.step()
                finally:
                    await sampler.close()

        batch = asyncio.run(go())
        return {g.prompt_id: [r.output["sampling"]["seed"] for r in g.results] for g in batch.groups}

    first = seeds("seeded-a")
    assert first == {p: [derive_seed(100, int(p) * 3 + k) for k in range(3)] for p in first} and len(first) == 2, first
    assert len({s for group in first.values() for s in group}) == 6
    assert seeds("seeded-b") == first  # another run with the same seed samples the same rollouts


@pytest.mark.parametrize("policy", ["exclude", "zero_reward"])
def test_the_batch_holds_the_group_the_filter_judged(stack: Deployment, policy: str) -> None:
    # Failed members stay out of the batch under exclude, and carry reward 0 under zero_reward: a trainer then
    # trains on the rewards the informative filter saw, never on a failed job's own.
    ps = [{**p, "fail_p": 0.4, "scale_s": 0.01} for p in prompts()]
    cfg = SamplerConfig(group_size=4, target_groups=3, mode="sync", run_id=f"t-{policy}", failed=policy,
                        step_timeout_s=60)

    async def go() -> StepBatch:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", ps, cfg)
            batch = await sampler.step()
            await sampler.close()
            return batch

    batch = asyncio.run(go())
    assert len(batch.groups) == cfg.target_groups
    failed = [r for r in batch.results if not r.ok]
    for g in batch.groups:
        assert len(set(g.rewards)) > 1, g.rewards
    if policy == "exclude":
        assert not failed, [r.job_id for r in failed]
        assert any(len(g.results) < cfg.group_size for g in batch.groups)  # a failed member was left out
        assert all(len(g.results) >= 2 for g in batch.groups)
    else:
        assert failed and all(r.reward == 0.0 for r in failed), [(r.job_id, r.reward) for r in failed]
        assert all(len(g.results) == cfg.group_size for g in batch.groups)


def test_cancel_dropped_off_leaves_abandoned_jobs_running(stack: Deployment) -> None:
    """The no-stale-job-cleanup ablation: early termination abandons groups without cancelling them."""
    cfg = SamplerConfig(group_size=3, target_groups=1, max_in_flight=12, carry_over=False, cancel_dropped=False,
                        run_id="t5", step_timeout_s=60)

    async def go() -> tuple[StepBatch, list[str], list[Any], DapoSampler]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", prompts(), cfg)
            batch = await sampler.step()
            ids = sorted(sampler._job_group)
            results = await client.wait(ids, timeout_s=60)  # the abandoned ones still finish
            await sampler.close()
            return batch, ids, results, sampler

    batch, ids, results, sampler = asyncio.run(go())
    check_batch(batch, cfg)
    assert len(ids) > len(batch.results)  # some groups were abandoned at early termination
    assert batch.stats.cancelled_jobs == 0 and not sampler.cancelled_ids
    assert {r.state for r in results} == {"done"}, sorted({r.state for r in results})


CHILD = textwrap.dedent("""
    import asyncio, json, sys
    from prorl_cli.client import AsyncRolloutClient
    from prorl_cli.config import load_config
    from prorl_cli.training.sampler import DapoSampler, SamplerConfig
    name, address, config_path, out = sys.argv[1:5]
    ps = json.loads(sys.argv[5])

    async def main():
        client = AsyncRolloutClient(name, address=address, config=load_config(config_path))
        cfg = SamplerConfig(group_size=4, target_groups=50, max_in_flight=16, run_id="t3")
        sampler = DapoSampler(client, "dapo_sim", ps, cfg)
        task = asyncio.ensure_future(sampler.step())
        while len(sampler._job_group) < cfg.max_in_flight:  # the first window is submitted
            await asyncio.sleep(0.01)
        with open(out + ".tmp", "w") as f:
            json.dump(sorted(sampler._job_group), f)
        import os; os.replace(out + ".tmp", out)
        await task  # never reaches 50 groups: killed first

    asyncio.run(main())
""")


def test_a_carry_window_under_one_step_never_leaves_a_step_waiting_on_nothing(stack: Deployment) -> None:
    """A window of 0.3 steps' worth holds fewer groups than a step needs: when it is full of ready groups and
    nothing is in flight, the step still submits (else it would wait for a result that cannot come)."""
    ps = [{"p": 0.5, "scale_s": 0.01, "alpha": 1.2, "max_s": 0.2, "seed": 5} for _ in range(8)]
    cfg = SamplerConfig(group_size=4, target_groups=3, max_in_flight=16, carry_window_steps=0.3, run_id="t6",
                        step_timeout_s=30)

    async def go() -> tuple[list[StepBatch], list[int | None]]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", ps, cfg)
            caps: list[int | None] = []
            sampler.on_progress = lambda _st: caps.append(sampler.group_cap())
            batches = [await sampler.step(policy_version=v) for v in range(2)]
            await sampler.close()
            return batches, caps

    batches, caps = asyncio.run(go())
    for b in batches:
        check_batch(b, cfg)
    # The window really was below a step's worth of groups at some point.
    assert min(c for c in caps if c is not None) < cfg.target_groups, caps


@pytest.mark.parametrize(("settings", "message"), [
    ({"group_size": 0}, r"group_size must be a positive integer, got 0"),
    ({"target_groups": 2.0}, r"target_groups must be a positive integer, got 2\.0"),
    ({"max_in_flight": "16"}, r"max_in_flight must be a positive integer or None, got '16'"),
    ({"sync_batch_groups": 0}, r"sync_batch_groups must be a positive integer or None, got 0"),
    ({"max_staleness": 1.5}, r"max_staleness must be an integer >= 0"),
    ({"carry_window_steps": float("nan")}, r"carry_window_steps must be a number >= 0"),
    ({"step_timeout_s": 0}, r"step_timeout_s must be a positive number of seconds or None, got 0"),
    ({"carry_over": "no"}, r"carry_over must be true or false, got 'no'"),
    ({"mode": "batch"}, r"mode must be one of \('async', 'sync'\), got 'batch'"),
    ({"run_id": ""}, r"run_id must be a non-empty string"),
    ({"max_in_flight": 2}, r"max_in_flight \(2\) is smaller than one group \(4\)"),
    # One reward never varies: the default filter would never end a step.
    ({"group_size": 1, "max_in_flight": 4}, r"group_size 1 can never pass the default filter"),
])
def test_sampler_settings_are_checked_before_a_step_and_named(settings: dict[str, Any], message: str) -> None:
    from prorl_cli.exceptions import ConfigError

    with pytest.raises(ConfigError, match=message):
        SamplerConfig(**{"group_size": 4, "target_groups": 2, **settings})


def test_restarted_sampler_resubmits_the_same_ids(stack: Deployment, tmp_path: Path) -> None:
    ps = [{**p, "scale_s": 0.3} for p in prompts()]
    out = tmp_path / "ids.json"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, stack.name, stack.address, str(stack.config_path), str(out), json.dumps(ps)],
        env={**stack.env(), "PYTHONPATH": str(REPO)}, start_new_session=True,
    )
    try:
        stack.wait_for(lambda st: out.exists() and st.jobs.get("done", 0) > 0, 60, "the first trainer's jobs", None)
    finally:
        os.killpg(child.pid, 9)
        child.wait()
    first_ids = set(json.loads(out.read_text()))
    before = stack.client.status().jobs
    cfg = SamplerConfig(group_size=4, target_groups=2, max_in_flight=16, run_id="t3", step_timeout_s=60)

    async def go() -> tuple[StepBatch, set[str]]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", ps, cfg, state=SamplerState(step=0, cursor=0))
            batch = await sampler.step()
            ids = set(sampler._job_group)
            await sampler.close(cancel_in_flight=False)
            return batch, ids

    batch, second_ids = asyncio.run(go())
    check_batch(batch, cfg)
    assert first_ids <= second_ids  # the same deterministic ids again, from the same cursor
    used = {r.job_id for r in batch.results}
    assert used & first_ids, "results of the killed trainer's jobs were not reused"
    after = stack.client.status().jobs
    # No job ran twice: the broker knows one job per id.
    assert sum(after.values()) - sum(before.values()) == len(second_ids - first_ids)


def test_a_new_sampler_under_an_earlier_runs_run_id_says_it_got_that_runs_results(
        stack: Deployment, caplog: pytest.LogCaptureFixture) -> None:
    """Job ids are deterministic: a second experiment under the same run_id gets the first one's rollouts (made by
    another policy) back. A resumed sampler (state=) expects that; a fresh one says so, once."""
    ps = [{**p, "scale_s": 0.01} for p in prompts(6)]
    cfg = SamplerConfig(group_size=2, target_groups=1, max_in_flight=4, run_id="t-reused", step_timeout_s=60)

    async def one_step(state: SamplerState | None = None) -> StepBatch:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", ps, cfg, state=state)
            batch = await sampler.step()
            await sampler.close(cancel_in_flight=False)
            return batch

    warning = "job ids of this run already exist at the broker"
    with caplog.at_level(logging.WARNING, logger="prorl_cli.training.sampler"):
        assert asyncio.run(one_step()).stats.existing_jobs == 0
        assert warning not in caplog.text
        assert asyncio.run(one_step()).stats.existing_jobs > 0
        assert caplog.text.count(warning) == 1 and "'t-reused'" in caplog.text
        caplog.clear()
        asyncio.run(one_step(SamplerState(step=0, cursor=0)))  # resumed: its own jobs, no warning
        assert warning not in caplog.text


def test_prorl_sample_without_id_prefix_runs_new_jobs_each_time(stack: Deployment, tmp_path: Path) -> None:
    """Two runs on one deployment: the second samples anew, not the first run's jobs the broker still holds
    under the same ids (step 0's results are kept: a sampler forgets only earlier steps')."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({**p, "scale_s": 0.01}) + "\n" for p in prompts(9)))
    runs = []
    for n in (1, 2):
        out = tmp_path / f"run{n}.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "prorl_cli", "-d", stack.name, "sample", str(tasks), "--task", "dapo_sim",
             "--group-size", "3", "--target-groups", "1", "--out", str(out)],
            env={**stack.env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr + proc.stdout
        runs.append({json.loads(line)["job_id"] for line in out.read_text().splitlines()})
    assert runs[0] and runs[1] and not runs[0] & runs[1], runs


def test_prorl_sample_collects_informative_groups(stack: Deployment, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({**p, "scale_s": 0.01}) + "\n" for p in prompts(9)))
    out = tmp_path / "groups.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "-d", stack.name, "sample", str(tasks), "--task", "dapo_sim",
         "--group-size", "3", "--target-groups", "2", "--id-prefix", "cli", "--out", str(out)],
        env={**stack.env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "informative 2/2" in proc.stderr and "filtered" in proc.stderr and "in flight" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r["reward"])
    assert len(groups) == 2 and all(len(set(v)) > 1 and len(v) == 3 for v in groups.values())
    # `submit --dapo` (where dynamic sampling used to live) names the command that does it now.
    bad = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", stack.name, "submit", str(tasks), "--task", "dapo_sim",
                          "--dapo"], env={**stack.env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert bad.returncode != 0 and "prorl sample TASKS" in bad.stderr, bad.stderr
    missing = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", stack.name, "sample", str(tasks), "--task",
                              "dapo_sim", "--group-size", "3"], env={**stack.env(), "PYTHONPATH": str(REPO)},
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "--target-groups" in missing.stderr, missing.stderr
    # Parquet goes through the same loaders as plain submit.
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist([{**p, "scale_s": 0.01} for p in prompts(9)]), table)
    proc = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "-d", stack.name, "sample", str(table), "--task", "dapo_sim",
         "--group-size", "3", "--target-groups", "1", "--id-prefix", "pq", "--out", str(tmp_path / "pq.jsonl")],
        env={**stack.env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0 and "informative 1/1" in proc.stderr, proc.stderr + proc.stdout
    wrong = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", stack.name, "sample", str(table), "--task", "dapo_sim",
                            "--group-size", "3", "--target-groups", "1", "--format", "io"],
                           env={**stack.env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0 and "--format applies to the domain tasks" in wrong.stderr, wrong.stderr


def test_groups_finished_beyond_a_steps_target_survive_a_restart(stack: Deployment) -> None:
    """Sync batches of 8 groups for a target of 2 leave informative groups ready for later steps. A trainer
    restarted from ``state()`` gets them back (same ids, the broker's results): none lost, none run twice."""
    ps = [{**p, "scale_s": 0.01} for p in prompts()]
    cfg = SamplerConfig(group_size=4, target_groups=2, mode="sync", sync_batch_groups=8, run_id="t-ready",
                        step_timeout_s=60)

    async def first_trainer() -> tuple[StepBatch, SamplerState, list[str]]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", ps, cfg)
            batch = await sampler.step()
            ready = [g.group_id for g in sampler._ready]
            state = sampler.state()
            await sampler.close(cancel_in_flight=False)  # the trainer's process ends here
            return batch, state, ready

    async def restarted(state: dict[str, Any]) -> tuple[StepBatch, int]:
        async with aclient(stack) as client:
            before = sum((await client.status()).jobs.values())
            sampler = DapoSampler(client, "dapo_sim", ps, cfg, state=state)
            batch = await sampler.step()
            ran = sum((await client.status()).jobs.values()) - before
            await sampler.close()
            return batch, ran

    batch0, state, ready = asyncio.run(first_trainer())
    assert len(ready) >= cfg.target_groups, ready  # enough left over for the next step without a new batch
    assert {c.position for c in state.carried} and state.step == 1
    saved = json.loads(json.dumps(state.to_dict()))  # as a trainer's checkpoint keeps it: plain JSON
    assert SamplerState.from_dict(saved) == state
    batch1, ran = asyncio.run(restarted(saved))
    check_batch(batch1, cfg)
    assert [g.group_id for g in batch1.groups] == ready[: cfg.target_groups]
    assert ran == 0  # answered from the broker's results: no job ran again
    assert not {g.group_id for g in batch1.groups} & {g.group_id for g in batch0.groups}



def test_a_damaged_sampler_state_is_refused_naming_the_field() -> None:
    """A checkpoint that would resubmit other ids (a wrong cursor type, a group without its step) is refused."""
    from prorl_cli.exceptions import ConfigError

    good = {"step": 2, "cursor": 5, "carried": [{"position": 4, "step": 1, "policy_version": 1}], "filtered_prompts": [0]}
    assert SamplerState.from_dict(good).carried[0].position == 4
    for bad, named in (({**good, "cursor": "5"}, "cursor"), ({**good, "carried": [{"position": 4}]}, "carried[0]"),
                       ({**good, "filtered_prompts": [-1]}, "filtered_prompts[0]"), ({**good, "epoch": 1}, "epoch"),
                       ([1, 2], "mapping")):
        with pytest.raises(ConfigError, match=re.escape(named)):
            DapoSampler(None, "t", [{}], SamplerConfig(2, 1), state=bad)  # type: ignore[arg-type]


def test_a_sampler_state_is_read_by_its_declared_checks_naming_the_exact_field() -> None:
    """``from_dict`` reads the state with the wire records' checkers: an error names the field down to the item
    (``carried[1].step``) and says what is wrong with it; a null is damage, not a default; nothing caps a list's
    length (a large dataset's filtered prompts), and a state holding CarriedGroups reads as its dict does."""
    from prorl_cli.exceptions import ConfigError
    from prorl_cli.training.sampler import CarriedGroup

    group = {"position": 4, "step": 1, "policy_version": 1}
    good = {"step": 2, "cursor": 5, "carried": [group, group], "filtered_prompts": [0]}
    for bad, message in (
            ({**good, "carried": [group, {"position": 4, "policy_version": 1}]}, "carried[1].step is missing"),
            ({**good, "carried": [{**group, "step": "1"}]}, "carried[0].step must be an integer, got str"),
            ({**good, "carried": [{**group, "k": 0}]}, "carried[0] has unknown field(s) ['k']"),
            ({**good, "carried": [7]}, "carried[0] must be a map, got int"),
            ({**good, "filtered_prompts": (0,)}, "filtered_prompts must be a list, got tuple"),
            ({**good, "step": True}, "step must be an integer, got bool"),
            ({**good, "cursor": None}, "cursor must not be null")):
        with pytest.raises(ConfigError, match=re.escape(f"sampler state: {message}")):
            SamplerState.from_dict(bad)
    many = SamplerState.from_dict({**good, "filtered_prompts": list(range(200_000))})
    assert len(many.filtered_prompts) == 200_000
    assert SamplerState.from_dict({**good, "carried": [CarriedGroup(4, 1, 1)]}).carried == [CarriedGroup(4, 1, 1)]
    assert SamplerState.from_dict({"cursor": 3}) == SamplerState(cursor=3)  # left out: the default


def test_a_closed_sampler_takes_no_step_and_the_blocking_one_refuses_an_async_client(stack: Deployment) -> None:
    """A step after close() would submit groups nothing watches or cancels; an async client handed to the blocking
    sampler would fail deep inside it."""
    from prorl_cli.exceptions import SamplerClosed
    from prorl_cli.training.sampler import BlockingDapoSampler

    cfg = SamplerConfig(group_size=2, target_groups=1, run_id="t-closed", step_timeout_s=60)

    async def go() -> int:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", prompts(3), cfg)
            await sampler.close()
            before = sum((await client.status()).jobs.values())
            with pytest.raises(SamplerClosed, match="state=sampler.state"):
                await sampler.step()
            with pytest.raises(TypeError, match="use DapoSampler"):
                BlockingDapoSampler(client, "dapo_sim", prompts(3), cfg)
            return sum((await client.status()).jobs.values()) - before

    assert asyncio.run(go()) == 0  # nothing was submitted


def test_prompts_whose_groups_stopped_teaching_are_skipped_in_later_epochs(stack: Deployment) -> None:
    """Six prompts, four of them always solved or never: once their groups were filtered, the sampler passes
    over most of those four (skip_filtered_prompts), so later epochs spend their rollouts on the two that teach."""
    ps = [{"p": (0.0, 1.0, 0.5)[i % 3], "scale_s": 0.01, "max_s": 0.2, "seed": 11} for i in range(6)]
    cfg = SamplerConfig(group_size=4, target_groups=2, mode="sync", sync_batch_groups=6, run_id="skip1",
                        skip_filtered_prompts=0.9, step_timeout_s=60)
    zero_variance = {0, 1, 3, 4}

    async def go() -> tuple[list[StepBatch], DapoSampler]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", ps, cfg)
            sampler.job_outcomes = {}
            batches = [await sampler.step() for _ in range(3)]
            await sampler.close()
            return batches, sampler

    batches, sampler = asyncio.run(go())
    for b in batches:
        check_batch(b, cfg)
    assert zero_variance <= set(sampler.state().filtered_prompts)
    assert sum(b.stats.skipped_prompts for b in batches) > 0
    assert sampler.job_outcomes is not None
    positions = sorted({int(j.split("-p")[1].split("-k")[0]) for j in sampler.job_outcomes})
    first_epoch = [pos for pos in positions if pos < len(ps)]
    later = [pos for pos in positions if pos >= len(ps)]
    assert first_epoch == list(range(6)), "nothing is skipped before a prompt's first group"
    # Without skipping, four in six of the later groups would be the zero-variance prompts again.
    stale_share = sum(pos % len(ps) in zero_variance for pos in later) / len(later)
    assert later and stale_share < 0.5, (later, stale_share)
    # A sampler resumed from a checkpoint makes the same choices (a draw fixed by the run and the position).
    resumed = DapoSampler(None, "dapo_sim", ps, cfg, state=sampler.state())  # type: ignore[arg-type]
    assert [resumed._skips(pos) for pos in range(6, 60)] == [sampler._skips(pos) for pos in range(6, 60)]
    assert any(resumed._skips(pos) for pos in range(6, 60))


def test_skipping_every_prompt_is_refused() -> None:
    from prorl_cli.exceptions import ConfigError

    with pytest.raises(ConfigError, match="skip_filtered_prompts must be a probability in \\[0, 1\\)"):
        SamplerConfig(group_size=4, target_groups=2, skip_filtered_prompts=1.0)
