"""TRL's GRPOTrainer trains through prorl: the real ``trl`` package, a real deployment, the tiny model.

The rollout function turns each prompt group into prorl jobs (the test
handler ``multiturn``: two model calls with a tool observation between
them), syncs the trainer's weights into the running bridge between steps
(pause that drains, in-place reload, resume under the new version), and
hands TRL the token-exact sequence with tool tokens masked.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.integrations.trl import (
    ProrlRollout,
    RolloutMismatch,
    _groups,
    prorl_reward,
    row_from_sample,
)
from prorl_cli.protocol import JobResult
from prorl_cli.training.samples import build_samples
from tests.harness import Deployment, need_module
from tests.inference.conftest import HANDLERS, start_bridge


def _two_turn() -> Trajectory:
    """A scripted two-turn trajectory: prompt [1 2 3], output [10 11], observation [20 21], output [12]."""
    return Trajectory(calls=[
        ModelCall([1, 2, 3], [10, 11], [-0.1, -0.2], "stop", policy_version=4),
        ModelCall([1, 2, 3, 10, 11, 20, 21], [12], [-0.3], "stop", policy_version=5),
    ])


def test_a_two_turn_trajectory_becomes_one_row_with_the_observation_masked() -> None:
    (sample,), report = build_samples(_two_turn(), rollout_id="j", group_id="g", reward=1.0)
    assert report.merge_ratio == 1.0
    row = row_from_sample(sample)
    assert row.prompt_ids == [1, 2, 3]
    assert row.completion_ids == [10, 11, 20, 21, 12]
    assert row.env_mask == [1, 1, 0, 0, 1]  # the tool tokens stay in the sequence, out of the loss
    assert row.logprobs == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3])
    assert row.policy_versions == [4, 4, 5] and row.reward == 1.0


def test_prompts_must_come_in_groups_of_num_generations() -> None:
    assert _groups(["a", "a", "b", "b"], 2) == ["a", "b"]
    with pytest.raises(RolloutMismatch, match="groups of num_generations=2"):
        _groups(["a", "a", "b"], 2)
    with pytest.raises(RolloutMismatch, match="not one prompt repeated"):
        _groups(["a", "b"], 2)
    assert prorl_reward(prorl_reward=[1, 0.5]) == [1.0, 0.5]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a bridge start, 2 steps with a reload: about a minute on 2 idle cores
def test_grpo_trainer_takes_two_steps_through_prorl(tiny_model: Path, tmp_path: Path) -> None:
    need_module("trl", "trl")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    start = tmp_path / "v0"
    shutil.copytree(tiny_model, start)
    d = Deployment(tmp_path / "home", config={"inference": {"generate_timeout_s": 120.0}})
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        start_bridge(d, "b1", "--engine", "transformers", "--model", str(start), timeout_s=180)
        rollout = ProrlRollout(
            d.client, "multiturn",
            instance_of=lambda prompt: {"tokenizer": str(start), "turns": 2, "observation": prompt},
            sampling={"max_tokens": 6, "temperature": 1.0}, checkpoint_dir=tmp_path / "ckpt", timeout_s=120,
        )

        group = 2

        def first_in_group(completion_ids: list[list[int]], **_: Any) -> list[float]:
            # Reward variance within every group (TRL lays a group's completions side by side), so every step has
            # a gradient; a reward drawn from the sampled tokens leaves both groups of a step flat now and then.
            return [float(i % group == 0) for i in range(len(completion_ids))]

        model = AutoModelForCausalLM.from_pretrained(str(start))
        before = [p.detach().clone() for p in model.parameters()]
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=2, per_device_train_batch_size=4,
            num_generations=group, max_completion_length=64, learning_rate=1e-2, logging_steps=1, report_to="none",
            save_strategy="no", seed=0,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=[prorl_reward, first_in_group], args=args,
            train_dataset=Dataset.from_dict({"prompt": [f"tool says {i}" for i in range(8)]}),
            processing_class=AutoTokenizer.from_pretrained(str(start)), rollout_func=rollout,
        )
        trainer.train()
    finally:
        d.close()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), trainer.state.log_history
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "the weights did not move"
    # Step 1 sampled under the initial weights (version 0); step 2 under the weights step 1 made, loaded in place.
    assert [h.policy_versions for h in rollout.history] == [[0], [1]], rollout.history
    for h in rollout.history:
        assert h.rollouts == 4 and h.failed == 0 and h.split_rollouts == 0 and h.merge_ratio == 1.0
        assert h.masked_tokens > 0  # the observation (and its chat scaffolding) is in every completion, masked
    for row in rollout.last_rows:
        # Masked tokens are exactly the ones the model did not sample: log-prob 0 there, the engine's elsewhere.
        assert len(row.env_mask) == len(row.completion_ids) == len(row.logprobs)
        assert all(lp == 0.0 for lp, m in zip(row.logprobs, row.env_mask, strict=True) if not m)
        assert 0 < sum(row.env_mask) < len(row.env_mask)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 2 warm-up steps, a bridge start, 2 held-out evaluations, 2 steps
def test_the_trl_example_runs(tmp_path: Path) -> None:
    """``examples/train_trl_grpo.py --short`` (a token warm-up): TRL trains on the calculator task through prorl.

    Nothing here depends on what the warm-up taught (the reward curve's rise is the example's own
    multi-seed run, in docs/training.md), so two supervised steps exercise that path at a tenth of the cost.
    """
    need_module("trl", "trl")
    import json
    import os
    import subprocess
    import sys

    from tests.harness import REPO

    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_trl_grpo.py"), "--out", str(out), "--short", "--warmup-steps", "2"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 2 and all(math.isfinite(x) for x in summary["losses"])
    assert summary["policy_versions_seen"] == [[0], [1]]  # step 2 sampled under the weights step 1 made
    # Masked: tool results and their chat scaffolding (none in a step where no episode called the tool).
    assert len(summary["masked_tokens"]) == 2 and all(m >= 0 for m in summary["masked_tokens"])
    assert [s for s, _ in summary["curve"]] == [0, 2] and (out / "reward_curve.png").is_file()


def test_a_sample_whose_lists_do_not_line_up_is_refused_not_shifted() -> None:
    """A hand-built sample with one log-prob short would hand TRL log-probs one token off: a named error instead."""
    from prorl_cli.training.samples import SampleError

    (sample,), _ = build_samples(_two_turn(), rollout_id="j", group_id="g", reward=1.0)
    sample.old_log_probs = sample.old_log_probs[:-1]
    with pytest.raises(SampleError, match="sample of rollout 'j' has 7 old_log_probs for 8 input_ids"):
        row_from_sample(sample)


def test_a_rollout_that_split_hands_trl_its_first_sample_whole() -> None:
    """The row is the first sample (call 0's prompt and what merged into it); every list is the completion's length."""
    traj = Trajectory(calls=[
        ModelCall([1, 2, 3], [10, 11], [-0.1, -0.2], "stop", policy_version=4),
        ModelCall([1, 2, 9], [12], [-0.3], "stop", policy_version=4),  # the history was edited: a new sample
    ])
    samples, report = build_samples(traj, rollout_id="j", group_id="g", reward=0.5)
    row = row_from_sample(samples[0])
    assert report.samples == 2
    assert (row.prompt_ids, row.completion_ids, row.env_mask) == ([1, 2, 3], [10, 11], [1, 1])
    assert row.logprobs == pytest.approx([-0.1, -0.2]) and row.policy_versions == [4, 4] and row.reward == 0.5


def test_each_prorl_rollout_has_job_ids_of_its_own_and_an_explicit_run_id_moves_past_other_work(
        stack: Deployment, caplog: pytest.LogCaptureFixture) -> None:
    """Calls are numbered from 0 in every ProrlRollout, so under one run id two trainers on a deployment (or one
    restarted from a checkpoint) submit the same job ids, and the broker hands each the jobs it holds for them: the
    other run's rollouts of other prompts. The default run id is one of the ProrlRollout's own; an explicit one
    whose ids hold other work goes on under ``{run_id}-r1`` (that call and the later ones, with a warning), and one
    whose ids hold the same work uses those jobs, with a warning."""
    import asyncio
    import logging

    from prorl_cli.client import AsyncRolloutClient
    from prorl_cli.training.sampler import DapoSampler, SamplerConfig

    mine = [{"echo": "mine-0"}, {"echo": "mine-1"}]
    theirs = [{"echo": "theirs-0"}, {"echo": "theirs-1"}]

    async def other_run() -> None:
        """Another trainer's call in flight under ``trl`` (the default run id before): its jobs held at the broker."""
        async with AsyncRolloutClient(stack.name, address=stack.address, config=stack.load_config()) as client:
            sampler = DapoSampler(client, "test", theirs, SamplerConfig(
                group_size=2, target_groups=2, mode="sync", run_id="trl", informative=lambda rewards: True,
                step_timeout_s=60))
            await sampler.step()
            await sampler.close(cancel_in_flight=False)

    def run(rollout: ProrlRollout, instances: list[dict[str, Any]]) -> list[JobResult]:
        return rollout._run(instances, 2, 0)

    def echoes(results: list[JobResult]) -> list[Any]:
        return [r.output["echo"] for r in results]

    asyncio.run(other_run())
    a, b = ProrlRollout(stack.client, "test", sync_weights=False), ProrlRollout(stack.client, "test", sync_weights=False)
    assert a.run_id != b.run_id and a.run_id.startswith("trl-") and b.run_id.startswith("trl-")
    assert echoes(run(a, mine)) == ["mine-0", "mine-0", "mine-1", "mine-1"]  # its own rollouts, not the other run's
    restarted = ProrlRollout(stack.client, "test", sync_weights=False, run_id="trl")
    with caplog.at_level(logging.WARNING, logger="prorl_cli.integrations.trl"):
        first = run(restarted, mine)
    assert echoes(first) == ["mine-0", "mine-0", "mine-1", "mine-1"] and restarted.job_prefix == "trl-r1"
    assert {r.job_id.rsplit("-p", 1)[0] for r in first} == {"trl-r1-s0"}
    assert "holds other work" in caplog.text and "goes on under job ids trl-r1-*" in caplog.text
    second = run(restarted, theirs)  # the later calls stay under the new prefix
    assert echoes(second) == ["theirs-0", "theirs-0", "theirs-1", "theirs-1"] and restarted.job_prefix == "trl-r1"
    assert {r.job_id.rsplit("-p", 1)[0] for r in second} == {"trl-r1-s1"}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prorl_cli.integrations.trl"):
        assert echoes(run(ProrlRollout(stack.client, "test", sync_weights=False, run_id="trl"), theirs)) == [
            "theirs-0", "theirs-0", "theirs-1", "theirs-1"]
    assert "4 job id(s) of run_id 'trl' were already at the broker with the same work" in caplog.text
    with pytest.raises(ValueError, match="run_id must be a non-empty string or None"):
        ProrlRollout(stack.client, "test", sync_weights=False, run_id="")


def test_max_completion_length_bounds_each_call_and_the_completion(stack: Deployment,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """TRL bounds a completion by ``max_completion_length`` (its own generation stops there; ``dr_grpo`` divides by
    it): each call's max_tokens is capped at it (set to it when sampling gives none), and a multi-turn completion
    longer than it is cut to it, ids, log-probs, mask and versions alike."""
    import logging
    import types

    from prorl_cli.integrations.trl import RolloutStats, _completion_limit

    trainer = types.SimpleNamespace(args=types.SimpleNamespace(max_completion_length=3))
    assert _completion_limit(trainer) == 3 and _completion_limit(types.SimpleNamespace()) is None
    rollout = ProrlRollout(stack.client, "test", sync_weights=False, sampling={"max_tokens": 100, "temperature": 0.5})
    with caplog.at_level(logging.WARNING, logger="prorl_cli.integrations.trl"):
        assert rollout.sampling_for(3) == {"max_tokens": 3, "temperature": 0.5}
    assert "sampling max_tokens 100 is over the trainer's max_completion_length (3)" in caplog.text
    assert rollout.sampling == {"max_tokens": 100, "temperature": 0.5}  # the caller's map is left alone
    assert rollout.sampling_for(None) is rollout.sampling
    assert rollout.sampling_for(200) == {"max_tokens": 100, "temperature": 0.5}  # within the bound: as given
    assert ProrlRollout(stack.client, "test", sync_weights=False).sampling_for(64) == {"max_tokens": 64}
    # What the jobs were sampled with: the capped map.
    sampled = rollout._run([{"echo": 0, "echo_sampling": True}], 2, 0, rollout.sampling_for(3))
    assert [r.output["sampling"]["max_tokens"] for r in sampled] == [3, 3]

    done = JobResult(job_id="j", task="t", state="done", reward=1.0, output={"trajectory": _two_turn().to_dict()})
    stats = RolloutStats(global_step=0, policy_version=0)
    (row,) = rollout._rows([done], stats, eos_id=0, max_completion_length=3)
    assert (row.completion_ids, row.env_mask, row.policy_versions) == ([10, 11, 20], [1, 1, 0], [4, 4])
    assert row.logprobs == pytest.approx([-0.1, -0.2, 0.0]) and row.prompt_ids == [1, 2, 3] and row.reward == 1.0
    assert stats.truncated_rollouts == 1 and stats.sampled_tokens == 2 and stats.masked_tokens == 1
    (whole,) = rollout._rows([done], RolloutStats(0, 0), eos_id=0, max_completion_length=5)
    assert whole.completion_ids == [10, 11, 20, 21, 12]
