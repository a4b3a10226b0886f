"""Sample merging, advantages, loss weights and packing on hand-computed cases (Agent Lightning v1.0, Sec. 2)."""

from __future__ import annotations

import math

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


def test_tokens_sampled_under_a_constraint_can_be_left_out_of_the_loss() -> None:
    """A gateway call sampled under a JSON format (``ModelCall.structured``) has the masked distribution's
    log-probs; ``mask_constrained`` weights its output 0 and leaves the free calls' tokens as they were."""
    from prorl_cli.training.samples import samples_from_results

    def rollout() -> dict:
        return Trajectory(calls=[
            ModelCall([1, 2], [3, 4], [-0.5, -1.0], "stop"),  # a free tool call
            ModelCall([1, 2, 3, 4, 9], [5, 6, 7], [-0.25, 0.0, 0.0], "stop", structured={"json": {"type": "object"}}),
        ]).to_dict()

    results = [_Result("a", rollout(), 1.0), _Result("b", rollout(), 0.0)]
    kept = samples_from_results(results).samples[0]
    assert kept.constrained_positions == [5, 6, 7] and all(w > 0 for w in kept.loss_weights[5:])
    masked = samples_from_results(results, mask_constrained=True).samples[0]
    assert masked.loss_weights[5:] == [0.0] * 3
    assert masked.loss_weights[:5] == kept.loss_weights[:5] and masked.loss_weights[2] > 0


def test_the_sampler_reports_the_off_policy_token_fraction() -> None:
    from prorl_cli.training.sampler import off_policy_fraction

    results = [_Result("a", _stale_rollout(), 1.0)]
    assert off_policy_fraction(results, 2) == pytest.approx(2 / 3)  # the 2 tokens of version 1 of 3
    assert off_policy_fraction(results, 1) == 0.0


# --------------------------------------------------------------------- what a trainer must never receive silently


def test_nan_inf_and_missing_rewards_are_refused_by_name() -> None:
    """A NaN or infinite reward would make every advantage of its group NaN: refused, naming the rollout."""
    from prorl_cli.training.samples import SampleError, samples_from_results

    traj = Trajectory(calls=[call([1, 2], [3])])
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(SampleError, match="rollout 'r': reward .* is not finite"):
            build_samples(traj, rollout_id="r", group_id="g", reward=bad)
        ss = [sample("a", "g", 1.0, 2), sample("b", "g", bad, 2), sample("b", "g", bad, 2)]
        with pytest.raises(SampleError, match="rollout 'b': reward .* is not finite"):
            assign_advantages(ss)
    with pytest.raises(SampleError, match="rollout 'b': reward None is not a number"):
        assign_advantages([sample("a", "g", 1.0, 2), sample("b", "g", None, 2)])  # type: ignore[arg-type]
    with pytest.raises(SampleError, match="rollout 'x'"):
        samples_from_results([_Result("x", traj.to_dict(), float("nan"))])


def test_logprobs_that_do_not_match_the_output_ids_are_refused() -> None:
    """Appending a call's log-probs as they are would shift every later one off its token."""
    from prorl_cli.training.samples import SampleError

    good = call([1, 2], [3, 4])
    short = ModelCall(prompt_ids=[1, 2, 3, 4, 5], output_ids=[6, 7], logprobs=[-0.5], finish_reason="stop")
    with pytest.raises(SampleError, match="rollout 'r': call 1 has 1 logprobs for 2 output ids"):
        build_samples(Trajectory(calls=[good, short]), rollout_id="r", group_id="g", reward=1.0)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("level", ["rollout", "sample"])
def test_all_equal_rewards_give_exactly_zero_advantages(estimator: str, level: str) -> None:
    """Equal rewards carry no signal; rounding in the mean (0.1 * 3 / 3) must not become advantages of order 1."""
    for rewards in ([0.1, 0.1, 0.1], [1.0, 1.0], [0.7]):
        ss = [sample(f"r{i}", "g", r, 2) for i, r in enumerate(rewards)]
        assign_advantages(ss, estimator=estimator, level=level, std_normalize=True, eps=0.0)
        assert [s.advantage for s in ss] == [0.0] * len(rewards)


def test_advantages_of_groups_whose_rollouts_split_differently() -> None:
    """Rollout level: a rollout counts once however many samples it split into; groups never mix."""
    ss = [sample("a", "g", 1.0, 2)] + [sample("b", "g", 0.0, 2)] * 3 + [sample("c", "h", 2.0, 1), sample("d", "h", 0.0, 1)]
    assign_advantages(ss, std_normalize=True, eps=0.0)
    std = 0.5 ** 0.5  # sample std of [1, 0]
    assert [s.advantage for s in ss[:4]] == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, -0.5 / std])
    assert [s.advantage for s in ss[4:]] == pytest.approx([1.0 / 2 ** 0.5, -1.0 / 2 ** 0.5])  # std of [2, 0] is sqrt 2


@pytest.mark.parametrize("norm", ["token-mean", "seq-mean-token-mean", "rollout-token-mean"])
def test_loss_weights_sum_to_one_with_a_sample_without_sampled_tokens(norm: str) -> None:
    """A sample (here a whole rollout) with no sampled token has no token mean: it must not dilute the others."""
    ss = [sample("a", "g", 1.0, 4), sample("a", "g", 1.0, 2), sample("b", "g", 0.0, 3), sample("e", "g", 0.0, 0)]
    assign_loss_weights(ss, norm)
    assert sum(w for s in ss for w in s.loss_weights) == pytest.approx(1.0)
    assert ss[3].loss_weights == [0.0, 0.0]
    assert all(len(s.loss_weights) == len(s.input_ids) for s in ss)


def test_truncated_is_caps_a_huge_ratio_and_refuses_a_nan_one() -> None:
    """An old log-prob of -1000 (exp overflows) is capped; a NaN one (an engine's null) is refused, not trained on."""
    from prorl_cli.training.samples import SampleError, samples_from_results

    def stale(old: float) -> dict:
        return Trajectory(calls=[
            ModelCall([1, 2], [3, 4], [old, -1.0], "stop", policy_version=1),
            ModelCall([1, 2, 3, 4, 9], [5], [-0.25], "stop", policy_version=2),
        ]).to_dict()

    now = [0.0, 0.0, 0.0, -1.5, 0.0, 0.0]
    w = samples_from_results([_Result("a", stale(-1000.0), 1.0)]).samples[0].loss_weights
    s = samples_from_results([_Result("a", stale(-1000.0), 1.0)], off_policy="truncated_is",
                             current_log_probs=lambda _s: now, is_cap=2.0).samples[0]
    assert s.loss_weights[2] == w[2] * 2.0 and s.loss_weights[3] == pytest.approx(w[3] * math.exp(-0.5))
    with pytest.raises(SampleError, match="ratio at token 2 is NaN"):
        samples_from_results([_Result("a", stale(float("nan")), 1.0)], off_policy="truncated_is",
                             current_log_probs=lambda _s: now)
    with pytest.raises(SampleError, match="ratio at token 3 is NaN"):
        samples_from_results([_Result("a", stale(-0.5), 1.0)], off_policy="truncated_is",
                             current_log_probs=lambda _s: [0.0, 0.0, 0.0, float("nan"), 0.0, 0.0])


def test_off_policy_before_loss_weights_is_a_named_error() -> None:
    from prorl_cli.training.samples import SampleError, apply_off_policy

    (s,), _ = build_samples(_stale_rollout(), rollout_id="a", group_id="g", reward=1.0)
    with pytest.raises(SampleError, match="call assign_loss_weights before apply_off_policy"):
        apply_off_policy([s], "mask")


def test_sub_agent_calls_never_merge_into_another_agents_sample() -> None:
    """A sub-agent's prompt that happens to extend the main agent's ids exactly still opens its own sample."""
    traj = Trajectory(calls=[
        ModelCall([1, 2], [3], [-0.1], "stop", agent="main"),
        ModelCall([1, 2, 3, 4], [5], [-0.2], "stop", agent="sub"),
        ModelCall([1, 2, 3, 6], [7], [-0.3], "stop", agent="main"),
        ModelCall([1, 2, 3, 4, 5, 8], [9], [-0.4], "stop", agent="sub"),
    ])
    samples, report = build_samples(traj, rollout_id="r", group_id="g", reward=1.0)
    assert [(s.agent, s.calls) for s in samples] == [("main", [0, 2]), ("sub", [1, 3])]
    assert samples[0].input_ids == [1, 2, 3, 6, 7] and samples[0].response_mask == [0, 0, 1, 0, 1]
    assert samples[1].input_ids == [1, 2, 3, 4, 5, 8, 9] and samples[1].response_mask == [0, 0, 0, 0, 1, 0, 1]
    assert samples[1].old_log_probs == [0.0] * 4 + [-0.2, 0.0, -0.4]
    # Two agents, each merged whole: every boundary after an agent's first call merged.
    assert report.samples == 2 and report.agents == 2 and report.merge_ratio == 1.0
    total = MergeReport()
    total.add(report)
    total.add(build_samples(Trajectory(calls=[ModelCall([1], [2], [-0.1], "stop"), ModelCall([9], [3], [-0.1], "stop")]),
                            rollout_id="r2", group_id="g", reward=0.0)[1])
    assert (total.agents, total.calls, total.samples) == (3, 6, 4) and total.merge_ratio == pytest.approx(2 / 3)


def test_merged_samples_stay_aligned_with_the_calls_they_hold() -> None:
    """Random mixes of extending and non-extending calls: every call's prompt is its sample's ids before its
    output, and its output sits there with mask 1, its log-probs and its version; everything else is mask 0."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        calls: list[ModelCall] = []
        for k in range(rng.randint(1, 6)):
            if calls and rng.random() < 0.7:
                prev = rng.choice(calls)
                base = prev.prompt_ids + prev.output_ids if rng.random() < 0.8 else prev.prompt_ids[:-1]
            else:
                base = [rng.randint(0, 3)]
            prompt = base + [rng.randint(0, 50) for _ in range(rng.randint(0, 2))]
            out = [rng.randint(0, 50) for _ in range(rng.randint(0, 3))]
            calls.append(ModelCall(prompt, out, [-rng.random() for _ in out], "stop", policy_version=k,
                                   agent=rng.choice([None, "sub"])))
        samples, report = build_samples(Trajectory(calls=calls), rollout_id="r", group_id="g", reward=1.0)
        assert sorted(i for s in samples for i in s.calls) == list(range(len(calls)))
        for s in samples:
            s.check_aligned()
            sampled = set()
            for i in s.calls:
                c = calls[i]
                assert c.agent == s.agent
                n = len(c.prompt_ids)
                assert s.input_ids[:n] == c.prompt_ids
                assert s.input_ids[n:n + len(c.output_ids)] == c.output_ids
                assert s.response_mask[n:n + len(c.output_ids)] == [1] * len(c.output_ids)
                assert s.old_log_probs[n:n + len(c.output_ids)] == c.logprobs
                assert s.policy_versions[n:n + len(c.output_ids)] == [c.policy_version] * len(c.output_ids)
                sampled.update(range(n, n + len(c.output_ids)))
            assert {i for i, m in enumerate(s.response_mask) if m} == sampled
            assert all(lp == 0.0 and v == NO_VERSION for lp, v, m in
                       zip(s.old_log_probs, s.policy_versions, s.response_mask, strict=True) if not m)
        assert report.samples == len(samples)


def test_micro_batches_of_nothing_and_of_an_oversized_rollout() -> None:
    assert pack_micro_batches([], 10) == []
    big = [sample("big", "g", 1.0, 20), sample("big", "g", 1.0, 20)]  # 44 ids, over the budget of 30
    small = [sample("s1", "g", 0.0, 8), sample("s2", "g", 0.0, 8)]  # 10 ids each
    batches = pack_micro_batches(big + small, 30)
    assert batches[0] == big  # alone, whole, in order
    assert [len(b) for b in batches[1:]] == [2] and sum(len(s) for s in batches[1]) == 20


@pytest.mark.parametrize("level", ["rollout", "sample"])
def test_a_failed_job_without_a_trajectory_still_counts_in_its_groups_baseline(level: str) -> None:
    """Under the sampler's ``zero_reward`` a job that failed before its first model call has reward 0 and no
    trajectory: the group [1, 1, 1, 0] the filter judged informative must train as that group (advantage 1/4
    each), not as [1, 1, 1] (all advantages 0)."""
    from prorl_cli.protocol import JobResult
    from prorl_cli.training.samples import samples_from_results

    traj = Trajectory(calls=[call([1, 2], [3])]).to_dict()
    results = [JobResult(job_id=f"j{k}", task="t", state="done", reward=1.0, group_id="g", output={"trajectory": traj})
               for k in range(3)]
    results.append(JobResult(job_id="j3", task="t", state="failed", reward=0.0, group_id="g"))
    batch = samples_from_results(results, level=level)
    assert [s.advantage for s in batch.samples] == [pytest.approx(0.25)] * 3
    assert batch.skipped == 1
    # Without a reward it says nothing of the group: skipped, and out of the baseline.
    unscored = [*results[:3], JobResult(job_id="j3", task="t", state="failed", reward=None, group_id="g")]
    assert [s.advantage for s in samples_from_results(unscored, level=level).samples] == [0.0] * 3


def test_rollouts_each_in_a_group_of_their_own_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """Results without a group (``group_id`` None: submitted one by one, or before ``submit(n=)`` grouped them)
    each made a group of one, so every advantage was 0 and the step trained nothing, without a word."""
    from prorl_cli.protocol import JobResult
    from prorl_cli.training.samples import samples_from_results

    traj = Trajectory(calls=[call([1, 2], [3])]).to_dict()
    ungrouped = [JobResult(job_id=f"j{k}", task="t", state="done", reward=float(k % 2), output={"trajectory": traj})
                 for k in range(4)]
    said = "each of the 4 rollouts is in a group of its own, so every advantage is 0"
    for estimator in ("grpo", "rloo"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="prorl_cli.training.samples"):
            batch = samples_from_results(ungrouped, estimator=estimator)
        assert [s.advantage for s in batch.samples] == [0.0] * 4
        assert said in caplog.text and "group_of=" in caplog.text, caplog.text
    # Grouped (by group_of, or by a sampleless member's reward in the same group), or one rollout alone: nothing said.
    caplog.clear()
    with caplog.at_level("WARNING", logger="prorl_cli.training.samples"):
        grouped = samples_from_results(ungrouped, group_of={"j0": "a", "j1": "a", "j2": "b", "j3": "b"})
        samples_from_results(ungrouped[:1])
        samples_from_results([*ungrouped[:2], *(JobResult(job_id=f"x{k}", task="t", state="failed", reward=0.0,
                                                           group_id=f"j{k}") for k in range(2))])
    assert [s.advantage for s in grouped.samples] == [-0.5, 0.5, -0.5, 0.5]
    assert "group of its own" not in caplog.text, caplog.text
