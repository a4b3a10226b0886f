"""Sample merging, advantages, loss weights and packing on hand-computed cases (Agent Lightning v1.0, Sec. 2)."""

from __future__ import annotations

import pytest

from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.training.samples import (
    NO_VERSION,
    MergeReport,
    TrainingSample,
    assign_advantages,
    assign_loss_weights,
    build_samples,
    pack_micro_batches,
)


def call(prompt: list[int], out: list[int], version: int | None = None) -> ModelCall:
    return ModelCall(prompt_ids=prompt, output_ids=out, logprobs=[-0.5] * len(out), finish_reason="stop",
                     policy_version=version)


def test_merge_when_the_next_prompt_extends_prompt_plus_output() -> None:
    traj = Trajectory(calls=[call([1, 2, 3], [10, 11], 0), call([1, 2, 3, 10, 11, 20, 21], [12], 1)])
    samples, report = build_samples(traj, rollout_id="r", group_id="g", reward=1.0)
    assert len(samples) == 1
    s = samples[0]
    assert s.input_ids == [1, 2, 3, 10, 11, 20, 21, 12]
    assert s.response_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert s.old_log_probs == [0.0, 0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5]
    assert s.policy_versions == [NO_VERSION] * 3 + [0, 0] + [NO_VERSION] * 2 + [1]
    assert s.calls == [0, 1] and s.prompt_length == 3
    assert report.merge_ratio == 1.0 and report.samples_per_rollout == 1.0


def test_template_boundary_breaks_the_merge() -> None:
    # The template re-rendered the history without the model's end token (11): not a token-exact extension.
    traj = Trajectory(calls=[call([1, 2, 3], [10, 11]), call([1, 2, 3, 10, 20, 21], [12])])
    samples, report = build_samples(traj, rollout_id="r", group_id="g", reward=0.0)
    assert [s.input_ids for s in samples] == [[1, 2, 3, 10, 11], [1, 2, 3, 10, 20, 21, 12]]
    # The second output is trained under the prompt it was really sampled under, not a stitched one.
    assert samples[1].response_mask == [0] * 6 + [1]
    assert report.merge_ratio == 0.0 and report.samples == 2


def test_retokenization_breaks_the_merge() -> None:
    # Same text, different ids: the model sampled 10 11 ("h" "aving"); the harness re-tokenized it as 99 ("having").
    traj = Trajectory(calls=[call([1, 2], [10, 11]), call([1, 2, 99, 5], [7]), call([1, 2, 99, 5, 7, 6], [8])])
    samples, report = build_samples(traj, rollout_id="r", group_id="g", reward=1.0)
    assert [s.calls for s in samples] == [[0], [1, 2]]
    assert samples[1].input_ids == [1, 2, 99, 5, 7, 6, 8]
    assert report.calls == 3 and report.samples == 2 and report.merge_ratio == pytest.approx(0.5)


def sample(rollout: str, group: str, reward: float, n_tokens: int, prompt: int = 2) -> TrainingSample:
    mask = [0] * prompt + [1] * n_tokens
    return TrainingSample(rollout_id=rollout, group_id=group, job_id=rollout, input_ids=list(range(len(mask))),
                          response_mask=mask, old_log_probs=[0.0] * len(mask), policy_versions=[0] * len(mask), reward=reward)


def paper_group() -> list[TrainingSample]:
    """Figure 4: rollout 1 (reward 1) split into 3 samples, rollout 2 (reward 0) one sample."""
    return [sample("r1", "g", 1.0, 4), sample("r1", "g", 1.0, 4), sample("r1", "g", 1.0, 4), sample("r2", "g", 0.0, 4)]


def test_rollout_level_grpo_baseline_ignores_sample_counts() -> None:
    ss = paper_group()
    assign_advantages(ss)
    assert [s.advantage for s in ss] == [0.5, 0.5, 0.5, -0.5]  # baseline (1 + 0) / 2


def test_sample_level_grpo_baseline_counts_samples() -> None:
    ss = paper_group()
    assign_advantages(ss, level="sample")
    assert [s.advantage for s in ss] == [0.25, 0.25, 0.25, -0.75]  # baseline (1 + 1 + 1 + 0) / 4


def test_rloo_and_std_normalisation() -> None:
    ss = paper_group()
    assign_advantages(ss, estimator="rloo")
    assert [s.advantage for s in ss] == [1.0, 1.0, 1.0, -1.0]
    ss = [sample("a", "g", 1.0, 1), sample("b", "g", 0.0, 1), sample("c", "g", 0.0, 1), sample("d", "h", 3.0, 1)]
    assign_advantages(ss, std_normalize=True, eps=0.0)
    std = (((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2) ** 0.5  # sample std of [1, 0, 0]
    assert [s.advantage for s in ss[:3]] == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std])
    assert ss[3].advantage == 0.0  # a group of one has nothing to compare with


def abc_batch() -> list[TrainingSample]:
    """Figure 5: A = 50 + 100 tokens, B = 3 x 30, C = 40."""
    return [sample("A", "g1", 1.0, 50), sample("A", "g1", 1.0, 100), sample("B", "g2", 0.0, 30),
            sample("B", "g2", 0.0, 30), sample("B", "g2", 0.0, 30), sample("C", "g3", 1.0, 40)]


@pytest.mark.parametrize("norm", ["token-mean", "seq-mean-token-mean", "rollout-token-mean"])
def test_loss_weights_reproduce_the_papers_formulas(norm: str) -> None:
    ss = abc_batch()
    assign_loss_weights(ss, norm)
    # Per-token loss l = k on sample k: the sums A1..C1 of the paper are k * L_k.
    losses = {k: float(k + 1) for k in range(6)}
    got = sum(w * losses[k] for k, s in enumerate(ss) for w in s.loss_weights)
    sums = [losses[k] * n for k, n in enumerate([50, 100, 30, 30, 30, 40])]
    A1, A2, B1, B2, B3, C1 = sums
    expected = {
        "token-mean": (A1 + A2 + B1 + B2 + B3 + C1) / (50 + 100 + 30 + 30 + 30 + 40),
        "seq-mean-token-mean": (A1 / 50 + A2 / 100 + B1 / 30 + B2 / 30 + B3 / 30 + C1 / 40) / 6,
        "rollout-token-mean": ((A1 + A2) / 150 + (B1 + B2 + B3) / 90 + C1 / 40) / 3,
    }[norm]
    assert got == pytest.approx(expected)
    assert all(w == 0.0 for s in ss for w, m in zip(s.loss_weights, s.response_mask, strict=True) if not m)


def test_rollout_token_mean_weights_each_rollout_equally() -> None:
    ss = abc_batch()
    assign_loss_weights(ss, "rollout-token-mean")
    per_rollout: dict[str, float] = {}
    for s in ss:
        per_rollout[s.rollout_id] = per_rollout.get(s.rollout_id, 0.0) + sum(s.loss_weights)
    assert per_rollout == pytest.approx({"A": 1 / 3, "B": 1 / 3, "C": 1 / 3})


def test_micro_batches_never_split_a_rollout() -> None:
    ss = abc_batch()  # ids per sample: prompt 2 + response
    batches = pack_micro_batches(ss, max_tokens=100)
    homes = {}
    for i, b in enumerate(batches):
        for s in b:
            assert homes.setdefault(s.rollout_id, i) == i
        assert sum(len(s) for s in b) <= 100 or len({s.rollout_id for s in b}) == 1
    assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in ss)
    assert len(homes) == 3
    with pytest.raises(ValueError, match="max_tokens"):
        pack_micro_batches(ss, 0)


def test_merge_report_adds_up() -> None:
    r = MergeReport()
    r.add(MergeReport(rollouts=1, calls=3, samples=1))
    r.add(MergeReport(rollouts=1, calls=2, samples=2))
    assert r.merge_ratio == pytest.approx(2 / 3) and r.samples_per_rollout == 1.5


def _stale_rollout() -> dict:
    """A carried-over rollout: call 0 served under version 1, call 1 (merging into it) under version 2."""
    return Trajectory(calls=[
        ModelCall([1, 2], [3, 4], [-0.5, -1.0], "stop", policy_version=1),
        ModelCall([1, 2, 3, 4, 9], [5], [-0.25], "stop", policy_version=2),
    ]).to_dict()


class _Result:
    def __init__(self, job_id: str, traj: dict, reward: float) -> None:
        self.job_id, self.reward, self.output, self.group_id = job_id, reward, {"trajectory": traj}, "g"


def test_off_policy_tokens_are_counted_and_masked() -> None:
    from prorl_cli.training.samples import samples_from_results

    results = [_Result("a", _stale_rollout(), 1.0), _Result("b", _stale_rollout(), 0.0)]
    kept = samples_from_results(results)
    assert kept.off_policy_tokens == 4 and kept.off_policy_fraction == pytest.approx(4 / 6)
    (a, _) = kept.samples
    assert a.off_policy_positions() == [2, 3] and a.newest_version == 2
    w = a.loss_weights
    masked = samples_from_results(results, off_policy="mask").samples[0]
    assert masked.loss_weights[2:4] == [0.0, 0.0]  # sampled under version 1, the sample's newest is 2
    assert masked.loss_weights[5] == w[5] > 0  # the on-policy token keeps its weight


def test_truncated_importance_ratio_weights_off_policy_tokens() -> None:
    import math

    from prorl_cli.training.samples import samples_from_results

    results = [_Result("a", _stale_rollout(), 1.0)]
    w = samples_from_results(results).samples[0].loss_weights
    # The trainer's current log-probs: token 2 became likelier (ratio e^0.25), token 3 much likelier (ratio e^3, capped).
    now = [0.0, 0.0, -0.25, 2.0, 0.0, -0.1]
    s = samples_from_results(results, off_policy="truncated_is", current_log_probs=lambda _s: now, is_cap=2.0).samples[0]
    assert s.loss_weights[2] == pytest.approx(w[2] * math.exp(-0.25 + 0.5))
    assert s.loss_weights[3] == pytest.approx(w[3] * 2.0)
    assert s.loss_weights[5] == pytest.approx(w[5])  # on-policy: untouched
    with pytest.raises(ValueError, match="needs current_log_probs"):
        samples_from_results(results, off_policy="truncated_is")


def test_the_sampler_reports_the_off_policy_token_fraction() -> None:
    from prorl_cli.training.sampler import off_policy_fraction

    results = [_Result("a", _stale_rollout(), 1.0)]
    assert off_policy_fraction(results, 2) == pytest.approx(2 / 3)  # the 2 tokens of version 1 of 3
    assert off_policy_fraction(results, 1) == 0.0
