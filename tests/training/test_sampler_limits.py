"""A DAPO step that cannot reach its target stops with an error naming why and the setting to raise, against a
real broker and node: groups that are always filtered (``max_groups_per_step``), jobs that always fail
(``max_consecutive_failures``), while a healthy run with flaky failures goes on; ``prorl sample`` piped to a log
exits non-zero with the message and shows its progress."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prorl_cli import timebase
from prorl_cli.exceptions import (
    ConfigError,
    RolloutsFailing,
    SamplerError,
    SamplerTimeout,
    StepGroupsExhausted,
)
from prorl_cli.testing.handlers.dapo_sim import draw
from prorl_cli.training.sampler import DapoSampler, SamplerConfig, StepBatch, StepStats
from tests.harness import Deployment
from tests.training.test_sampler import aclient, check_batch, prompts

REPO = Path(__file__).resolve().parents[2]


def run_step(dep: Deployment, ps: list[dict[str, Any]], cfg: SamplerConfig) -> tuple[SamplerError, DapoSampler]:
    """One step that must stop with a :class:`SamplerError`; the sampler is closed after it."""

    async def go() -> tuple[SamplerError, DapoSampler]:
        async with aclient(dep) as client:
            sampler = DapoSampler(client, "dapo_sim", ps, cfg)
            try:
                await sampler.step()
            except SamplerError as e:
                return e, sampler
            finally:
                await sampler.close()
        raise AssertionError("the step reached its target")

    return asyncio.run(go())


def sample_cli(dep: Deployment, tasks: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``prorl sample`` with stdout and stderr piped (not a terminal, as in an sbatch log)."""
    return subprocess.run([sys.executable, "-m", "prorl_cli", "-d", dep.name, "sample", str(tasks), *args],
                          env={**dep.env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_step_whose_groups_are_always_filtered_stops_naming_the_setting(stack: Deployment, mode: str) -> None:
    """Rewards that never vary: every group is filtered. The step stops once its bound of groups all finished,
    instead of resubmitting for ever; sync batches are cut to the bound."""
    ps = [{"p": 0.0, "scale_s": 0.01, "max_s": 0.05, "seed": 3} for _ in range(4)]
    cfg = SamplerConfig(group_size=2, target_groups=1, mode=mode, sync_batch_groups=2, max_groups_per_step=5,
                        run_id=f"lim-filtered-{mode}", step_timeout_s=120)
    error, sampler = run_step(stack, ps, cfg)
    assert isinstance(error, StepGroupsExhausted) and isinstance(error, RuntimeError)
    assert error.setting == "max_groups_per_step" and error.limit == 5 and error.step == 0
    message = str(error)
    assert "step 0: 5 groups tried, all finished: 0 of 1 informative, 5 filtered (rewards 5 all 0.0), 0 failed;" in message
    assert "SamplerConfig.max_groups_per_step (5)" in message and "0: no limit" in message
    assert "\n" not in message
    assert sampler._stats is not None and sampler._stats.submitted_groups == 5  # not one group past the bound
    assert sampler.in_flight_jobs == 0


@pytest.mark.parametrize("policy", ["drop_group", "zero_reward", "exclude"])
def test_a_task_whose_jobs_always_fail_stops_naming_the_failure(stack: Deployment, policy: str) -> None:
    """Every rollout fails: after the default 32 failed results in a row the step stops with them grouped (stage,
    type, message, an example job), whatever ``failed`` does with them, long before the group bound."""
    ps = [{"p": 0.5, "fail_p": 1.0, "scale_s": 0.01, "max_s": 0.05, "seed": 4} for _ in range(4)]
    cfg = SamplerConfig(group_size=2, target_groups=1, failed=policy, run_id=f"lim-fail-{policy}", step_timeout_s=120)
    assert cfg.failure_limit == 32 and cfg.group_limit == 32 + 256
    error, _ = run_step(stack, ps, cfg)
    assert isinstance(error, RolloutsFailing), error
    assert error.setting == "max_consecutive_failures" and error.limit == 32
    [group] = error.failures
    assert (group.stage, group.type, group.message) == ("run", "RuntimeError", "simulated rollout failure")
    assert group.count == 32 and group.example.startswith(f"lim-fail-{policy}-s0-")
    message = str(error)
    assert "the last 32 job results all failed" in message, message
    assert "32 job(s) in run: RuntimeError: simulated rollout failure (e.g. lim-fail-" in message, message
    assert "SamplerConfig.max_consecutive_failures (32)" in message and "\n" not in message


def test_jobs_failing_fast_beside_a_healthy_long_one_do_not_stop_the_step(stack: Deployment) -> None:
    """A broken prompt (or node) fails its jobs at once while a healthy rollout runs long. Refilled at once, the fast
    failures pile up far past the limit, but the step goes on until the job that was in flight when they began has
    ended; here it ends informative and serves the step."""
    run_id = "lim-beside"
    healthy = next({"p": 0.5, "fail_p": 0.0, "scale_s": 4.0, "max_s": 4.0, "seed": seed} for seed in range(100)
                   if len({draw({"p": 0.5, "seed": seed}, f"{run_id}-s0-p0-k{k}")[1] for k in range(2)}) == 2)
    failing = {"p": 0.5, "fail_p": 1.0, "scale_s": 0.01, "max_s": 0.02, "seed": 5}
    cfg = SamplerConfig(group_size=2, target_groups=1, max_in_flight=4, max_consecutive_failures=4, run_id=run_id,
                        step_timeout_s=120)

    async def go() -> StepBatch:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", [healthy] + [failing] * 400, cfg)
            try:
                return await sampler.step()
            finally:
                await sampler.close()

    batch = asyncio.run(go())
    assert [g.prompt_id for g in batch.groups] == ["0"]
    assert batch.stats.failed_groups > cfg.failure_limit  # the old count alone would have stopped the run


def test_a_healthy_run_with_flaky_failures_is_not_stopped(stack: Deployment) -> None:
    """A third of the rollouts fail now and then among good ones: with the defaults every step is served."""
    ps = [{**p, "fail_p": 0.3, "scale_s": 0.01} for p in prompts()]
    cfg = SamplerConfig(group_size=4, target_groups=3, run_id="lim-flaky", step_timeout_s=120)

    async def go() -> tuple[list[StepBatch], DapoSampler]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", ps, cfg)
            batches = [await sampler.step(policy_version=v) for v in range(4)]
            await sampler.close()
            return batches, sampler

    batches, sampler = asyncio.run(go())
    for b in batches:
        check_batch(b, cfg)
    assert sum(b.stats.failed_groups for b in batches) > 0  # failures there were, and they did not stop it
    assert sampler._streak < cfg.failure_limit
    assert all(b.stats.submitted_groups < cfg.group_limit for b in batches)


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_groups_per_step": -1}, r"max_groups_per_step must be an integer >= 0 \(0: no limit\) or None"),
    ({"max_groups_per_step": 2.5}, r"max_groups_per_step must be an integer >= 0"),
    ({"max_consecutive_failures": True}, r"max_consecutive_failures must be an integer >= 0"),
])
def test_the_limits_are_checked_before_a_step(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SamplerConfig(group_size=4, target_groups=2, **settings)


def test_the_limits_defaults_follow_the_steps_size() -> None:
    cfg = SamplerConfig(group_size=8, target_groups=32)
    assert cfg.group_limit == 32 * 32 + 256 and cfg.failure_limit == 2 * 8 * 32  # a window of jobs in flight
    assert SamplerConfig(group_size=4, target_groups=2, mode="sync", sync_batch_groups=16).failure_limit == 64
    assert SamplerConfig(group_size=2, target_groups=1).failure_limit == 32
    off = SamplerConfig(group_size=2, target_groups=1, max_groups_per_step=0, max_consecutive_failures=0)
    assert off.group_limit == 0 and off.failure_limit == 0


def test_prorl_sample_of_a_task_whose_rewards_never_vary_stops_and_says_so(stack: Deployment, tmp_path: Path) -> None:
    """The report's command: the no-op task's reward is always 1, every group is filtered. Piped, it shows its
    progress as lines and ends with one error line naming the option, with the default bound."""
    tasks = tmp_path / "problems.jsonl"
    tasks.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(3)))
    out = tmp_path / "s.jsonl"
    proc = sample_cli(stack, tasks, "--task", "noop", "--group-size", "2", "--target-groups", "1", "--out", str(out))
    assert proc.returncode == 1, proc.stderr + proc.stdout
    lines = proc.stderr.splitlines()
    progress = [line for line in lines if line.startswith("step 0: informative 0/1")]
    assert len(progress) >= 2, proc.stderr  # the first update, and the state the step stopped in
    assert progress[-1].startswith("step 0: informative 0/1, filtered 288,"), proc.stderr
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [lines[-1]], proc.stderr
    assert ("error: dynamic sampling stopped: step 0: 288 groups tried, all finished: 0 of 1 informative, 288 "
            "filtered (rewards 288 all 1.0), 0 failed; no group's rewards ever varied (the task may always reward 1.0)") in errors[0], errors
    assert "--max-groups-per-step (288)" in errors[0] and "SamplerConfig" not in errors[0], errors
    assert not out.exists()  # no step finished: nothing to write


def test_prorl_sample_of_a_failing_task_prints_why_and_stops(stack: Deployment, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"p": 0.5, "fail_p": 1.0, "scale_s": 0.01, "seed": i}) + "\n" for i in range(3)))
    proc = sample_cli(stack, tasks, "--task", "dapo_sim", "--group-size", "2", "--target-groups", "1",
                      "--max-consecutive-failures", "6", "--step-timeout-s", "120")
    assert proc.returncode == 1, proc.stderr + proc.stdout
    lines = proc.stderr.splitlines()
    assert "why jobs did not finish" in proc.stderr, proc.stderr
    assert any(line.startswith("  6 job(s) in run: RuntimeError: simulated rollout failure (e.g. dapo-")
               for line in lines), proc.stderr
    assert lines[-1].startswith("error: dynamic sampling stopped: step 0: the last 6 job results all failed"), lines
    assert "--max-consecutive-failures (6)" in lines[-1], lines[-1]


def test_a_step_past_its_timeout_is_a_sampler_error_naming_the_setting(stack: Deployment, tmp_path: Path) -> None:
    """Rollouts far longer than ``step_timeout_s``: the step stops as every other sampler stop does (one
    ``SamplerError`` for a trainer to catch, a ``TimeoutError`` too), saying how far it got; the CLI names its
    option."""
    slow = [{"p": 0.5, "scale_s": 60.0, "alpha": 50.0, "max_s": 60.0, "seed": i} for i in range(4)]
    cfg = SamplerConfig(group_size=2, target_groups=1, run_id="lim-timeout", step_timeout_s=1.5)
    error, _ = run_step(stack, slow, cfg)
    assert isinstance(error, SamplerTimeout) and isinstance(error, TimeoutError), repr(error)
    assert (error.setting, error.limit, error.step) == ("step_timeout_s", 1.5, 0)
    assert str(error).startswith("step 0: 0 of 1 informative groups within 1.5 s ("), error
    assert "SamplerConfig.step_timeout_s" in str(error), error
    tasks = tmp_path / "slow.jsonl"
    tasks.write_text("".join(json.dumps(inst) + "\n" for inst in slow))
    proc = sample_cli(stack, tasks, "--task", "dapo_sim", "--group-size", "2", "--target-groups", "1",
                      "--step-timeout-s", "1")
    assert proc.returncode == 1, proc.stderr + proc.stdout
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error: dynamic sampling stopped: step 0: 0 of 1 informative groups within 1 s ("), last
    assert "--step-timeout-s bounds" in last and "SamplerConfig" not in last, last



def test_a_step_retried_after_its_timeout_counts_the_whole_step(stack: Deployment) -> None:
    """``step()`` again after a :class:`SamplerTimeout` goes on with the same step, and the stats it returns count
    all of it: the groups the timed-out attempts submitted (and filtered) are the step's own, not carried in, and
    its wall time runs from the first attempt's start."""
    run_id = "lim-retry"
    # One group at a time: a quick one that is filtered, then one of 4 s that is informative.
    quick = {"p": 0.0, "scale_s": 0.01, "max_s": 0.05, "seed": 1}
    slow = {"p": 0.5, "scale_s": 4.0, "alpha": 50.0, "max_s": 4.0, "seed": informative_seed(f"{run_id}-s0-p1", 2)}
    cfg = SamplerConfig(group_size=2, target_groups=1, max_in_flight=2, run_id=run_id, step_timeout_s=1.5)

    async def go() -> tuple[StepBatch, int, float, float, float]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", [quick, slow], cfg)
            try:
                timeouts = 0
                began = last = timebase.now()
                while True:
                    try:
                        batch = await sampler.step()
                    except SamplerTimeout:
                        timeouts += 1
                        last = timebase.now()
                        continue
                    return batch, timeouts, began, last, timebase.now()
            finally:
                await sampler.close()

    batch, timeouts, began, last, ended = asyncio.run(go())
    check_batch(batch, cfg)
    stats = batch.stats
    assert timeouts >= 1 and stats.attempts == timeouts + 1, (timeouts, stats)
    assert (stats.submitted_groups, stats.carried_in, stats.filtered, stats.informative) == (2, 0, 1, 1), stats
    assert stats_add_up(stats), stats
    # Every timed-out attempt lasted its limit; the step's wall time holds them and the attempt that returned.
    assert stats.wall_s >= timeouts * cfg.step_timeout_s, stats
    assert ended - last < stats.wall_s <= ended - began, (stats, ended - last, ended - began)


def test_a_step_out_of_groups_accounts_for_every_group_it_saw(stack: Deployment) -> None:
    """:class:`StepGroupsExhausted`'s breakdown adds up: every group the step saw (submitted, or carried in from the
    step before) is informative, filtered or failed, a group whose jobs all failed under ``failed="exclude"``
    among the failed ones."""
    run_id = "lim-breakdown"
    informative = {"p": 0.5, "scale_s": 0.01, "max_s": 0.05, "seed": informative_seed(f"{run_id}-s0-p0", 2)}
    running = {"p": 0.0, "scale_s": 1.5, "alpha": 50.0, "max_s": 1.5}  # still running when step 0 ends
    solved = {"p": 1.0, "scale_s": 0.01, "max_s": 0.05}
    failing = {"p": 0.5, "fail_p": 1.0, "scale_s": 0.01, "max_s": 0.05}
    unsolved = {"p": 0.0, "scale_s": 0.01, "max_s": 0.05}
    cfg = SamplerConfig(group_size=2, target_groups=1, max_in_flight=4, failed="exclude", max_groups_per_step=4,
                        run_id=run_id, step_timeout_s=120)

    async def go() -> tuple[StepBatch, StepGroupsExhausted, StepGroupsExhausted, DapoSampler]:
        async with aclient(stack) as client:
            sampler = DapoSampler(client, "dapo_sim", [informative, running, solved, failing, failing, unsolved], cfg)
            try:
                first = await sampler.step(policy_version=0)
                with pytest.raises(StepGroupsExhausted) as stopped:
                    await sampler.step(policy_version=1)
                # The bound is the step's: called again, the step stops at once, submitting nothing more.
                with pytest.raises(StepGroupsExhausted) as again:
                    await sampler.step(policy_version=1)
                return first, stopped.value, again.value, sampler
            finally:
                await sampler.close()

    first, error, again, sampler = asyncio.run(go())
    assert [g.prompt_id for g in first.groups] == ["0"] and first.stats.carried_out == 1, first.stats
    message = str(error)
    assert message.startswith("step 1: 5 groups tried (4 submitted, 1 carried in), all finished: 0 of 1 informative, "
                              "3 filtered (rewards 2 all 0.0, 1 all 1.0), 2 failed (of 4 failed job(s), most: "), message
    stats = sampler._stats
    assert stats is not None and (stats.carried_in, stats.submitted_groups) == (1, 4), stats
    assert (stats.informative, stats.filtered, stats.failed_groups, stats.stale_groups) == (0, 3, 2, 0), stats
    assert stats_add_up(stats), stats
    assert str(again) == message and stats.attempts == 2, (str(again), stats)


def stats_add_up(stats: StepStats) -> bool:
    """Every group a step saw is in one bucket: carried in or submitted = informative, filtered, failed, stale, or
    carried out (with carry-over)."""
    return stats.carried_in + stats.submitted_groups == (stats.informative + stats.filtered + stats.failed_groups
                                                         + stats.stale_groups + stats.carried_out)


def test_sampler_errors_copy_and_pickle_whole() -> None:
    """A trainer's worker process raising one hands it over pickled (multiprocessing, Ray)."""
    import copy
    import pickle

    from prorl_cli.observe.failures import FailureGroup

    group = FailureGroup("run", "RuntimeError", "boom", 6, "job-1")
    for error in (RolloutsFailing("step 3: failing", setting="max_consecutive_failures", limit=6, step=3,
                                  failures=[group], other_failures=2),
                  SamplerTimeout("step 1: late", setting="step_timeout_s", limit=1.5, step=1)):
        for back in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
            assert type(back) is type(error) and str(back) == str(error)
            assert (back.setting, back.limit, back.step, back.failures, back.other_failures) == \
                (error.setting, error.limit, error.step, error.failures, error.other_failures)


def test_prorl_sample_piped_shows_a_line_per_step_and_keeps_the_steps_before_a_stop(
        stack: Deployment, tmp_path: Path) -> None:
    """Piped: a line at each step's end. A run that stops in its third step still writes the two before it."""
    tasks = tmp_path / "tasks.jsonl"
    # Mixed prompts (p 0.5): a step gets its group; the bound of 64 groups is never near for them.
    tasks.write_text("".join(json.dumps({"p": 0.5, "scale_s": 0.01, "seed": i}) + "\n" for i in range(6)))
    out = tmp_path / "groups.jsonl"
    proc = sample_cli(stack, tasks, "--task", "dapo_sim", "--group-size", "3", "--target-groups", "1",
                      "--steps", "2", "--max-groups-per-step", "64", "--out", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    for step in (0, 1):
        assert any(line.startswith(f"step {step}: informative 1/1") for line in proc.stderr.splitlines()), proc.stderr
    assert {json.loads(line)["step"] for line in out.read_text().splitlines()} == {0, 1}
    # Two prompts whose groups are informative (seeds picked for their job ids: step k runs prompt k, one group at
    # a time), then prompts that always succeed: the third step stops, and the first two are still written.
    served = [{"p": 0.5, "scale_s": 0.01, "seed": informative_seed(f"keep-s{k}-p{k}", 3)} for k in range(2)]
    tasks.write_text("".join(json.dumps(t) + "\n" for t in served + [{"p": 1.0, "scale_s": 0.01}] * 20))
    proc = sample_cli(stack, tasks, "--task", "dapo_sim", "--group-size", "3", "--target-groups", "1",
                      "--steps", "3", "--max-groups-per-step", "8", "--max-in-flight", "3", "--id-prefix", "keep",
                      "--out", str(out))
    assert proc.returncode == 1, proc.stderr + proc.stdout
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error: dynamic sampling stopped: step 2: 8 groups tried"), last
    assert "--max-groups-per-step (8)" in last and last.endswith(f"(2 step(s) before it written to {out})"), last
    assert {json.loads(line)["step"] for line in out.read_text().splitlines()} == {0, 1}


def informative_seed(group_id: str, group_size: int) -> int:
    """A ``dapo_sim`` seed under which the jobs of ``group_id`` (p 0.5) get rewards that differ."""
    from prorl_cli.testing.handlers.dapo_sim import draw

    return next(seed for seed in range(1000)
                if len({draw({"p": 0.5, "seed": seed}, f"{group_id}-k{k}")[1] for k in range(group_size)}) > 1)
