"""Trajectories into training samples: merging, advantages, loss weights, micro-batches.

Follows the Agent Lightning v1.0 analysis of harnessed agentic RL:

- **Merging** (:func:`build_samples`): consecutive model calls of one
  rollout share a sample only when the later prompt is a token-exact
  extension of the earlier prompt + output. Otherwise a new sample starts:
  sampled ids are never stitched into a prompt they were not sampled under.
- **Advantages** (:func:`assign_advantages`): GRPO or RLOO baselines over the
  rollouts of a group by default, so a rollout that happened to split into
  more samples does not move its group's baseline; sample level on request;
  std normalisation off by default (Dr. GRPO).
- **Loss normalisation** (:func:`assign_loss_weights`): token-mean,
  seq-mean-token-mean or rollout-level token-mean, emitted as per-token
  weights: ``loss = sum(weight_t * loss_t)`` over the batch.
- **Packing** (:func:`pack_micro_batches`): micro-batches by token budget,
  never splitting a rollout.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.agent.trajectory import Trajectory
from prorl_cli.exceptions import ProrlError

log = logging.getLogger(__name__)

#: Policy version of a token the model did not sample (prompt, tool output).
NO_VERSION = -1


class SampleError(ProrlError, ValueError):
    """A trajectory, reward or sample a trainer cannot use as it is (the message names the rollout and the problem)."""


def filler_token_id(tokenizer: Any) -> int:
    """The token that fills a failed rollout's masked row: end-of-sequence, else padding, else 0.

    Trainers need a row for every prompt they asked for, failed or not, and
    one token the model would end on keeps that row harmless.
    """
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _finite_reward(reward: Any, rollout_id: str) -> float:
    """``reward`` as a float; a missing, NaN or infinite reward would put NaN into every loss of its group."""
    try:
        value = float(reward)
    except (TypeError, ValueError):
        raise SampleError(f"rollout {rollout_id!r}: reward {reward!r} is not a number") from None
    if not math.isfinite(value):
        raise SampleError(f"rollout {rollout_id!r}: reward {reward!r} is not finite")
    return value


class AdvantageEstimator(str, enum.Enum):
    """How a group's baseline is formed."""

    GRPO = "grpo"  # reward minus the group mean
    RLOO = "rloo"  # reward minus the mean of the other members


class AdvantageLevel(str, enum.Enum):
    """What counts as one member of a group when forming the baseline."""

    ROLLOUT = "rollout"
    SAMPLE = "sample"


class OffPolicy(str, enum.Enum):
    """What to do with sampled tokens served under an older policy version than their sample's newest."""

    KEEP = "keep"  # train on them as they are
    MASK = "mask"  # loss weight 0
    TRUNCATED_IS = "truncated_is"  # loss weight times min(exp(current - old log-prob), cap)


class LossNorm(str, enum.Enum):
    """Loss normalisation (Agent Lightning v1.0, Eqs. 14-16)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    ROLLOUT_TOKEN_MEAN = "rollout-token-mean"


@dataclass
class TrainingSample:
    """One training sequence: token ids with, per token, what a trainer needs.

    All per-token lists are aligned with ``input_ids``. ``response_mask`` is
    1 on tokens the model sampled; ``old_log_probs`` are the sampling
    log-probs there (0.0 elsewhere); ``policy_versions`` the policy version
    each sampled token was served under (:data:`NO_VERSION` elsewhere, and
    where the broker did not say). ``prompt_length`` counts the ids before
    the first sampled token.
    """

    rollout_id: str
    group_id: str
    job_id: str
    input_ids: list[int]
    response_mask: list[int]
    old_log_probs: list[float]
    policy_versions: list[int]
    reward: float
    #: Indices of the trajectory's model calls merged into this sample.
    calls: list[int] = field(default_factory=list)
    advantage: float = 0.0
    loss_weights: list[float] = field(default_factory=list)
    #: The agent whose calls these are (``ModelCall.agent``; None: unnamed).
    agent: str | None = None
    #: Positions (in ``input_ids``) of sampled tokens drawn under a constraint (``ModelCall.structured``): their
    #: ``old_log_probs`` are the masked distribution's, not the model's own (docs/inference.md).
    constrained_positions: list[int] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return next((i for i, m in enumerate(self.response_mask) if m), len(self.response_mask))

    @property
    def n_response_tokens(self) -> int:
        return sum(self.response_mask)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def newest_version(self) -> int:
        """The newest policy version among the sample's sampled tokens (:data:`NO_VERSION` if none was reported)."""
        return max((v for v, m in zip(self.policy_versions, self.response_mask, strict=True) if m), default=NO_VERSION)

    def check_aligned(self) -> None:
        """Raise :class:`SampleError` unless every per-token list is as long as ``input_ids`` (``loss_weights``: or empty)."""
        n = len(self.input_ids)
        lists: dict[str, Sequence[Any]] = {
            "response_mask": self.response_mask, "old_log_probs": self.old_log_probs,
            "policy_versions": self.policy_versions,
        }
        if self.loss_weights:
            lists["loss_weights"] = self.loss_weights
        for name, values in lists.items():
            if len(values) != n:
                raise SampleError(f"sample of rollout {self.rollout_id!r} has {len(values)} {name} for {n} input_ids")

    def off_policy_positions(self) -> list[int]:
        """Indices of sampled tokens served under an older version than :attr:`newest_version`."""
        newest = self.newest_version
        return [i for i, (v, m) in enumerate(zip(self.policy_versions, self.response_mask, strict=True))
                if m and v != NO_VERSION and v < newest]


@dataclass
class MergeReport:
    """How well calls merged: ``merge_ratio`` is merged call boundaries / all call boundaries (1.0 if none).

    A call boundary is a call after its agent's first in the rollout: a sample never spans two agents, so a
    main agent and a sub-agent each merged whole into one sample merge at 1.0.
    """

    rollouts: int = 0
    calls: int = 0
    samples: int = 0
    #: Each rollout's distinct agents, summed (0: counted as one per rollout, as a report built by hand is).
    agents: int = 0

    @property
    def merge_ratio(self) -> float:
        starts = self.agents or self.rollouts
        boundaries = self.calls - starts
        return 1.0 if boundaries <= 0 else (self.calls - self.samples) / boundaries

    @property
    def samples_per_rollout(self) -> float:
        return self.samples / self.rollouts if self.rollouts else 0.0

    def add(self, other: MergeReport) -> None:
        self.rollouts += other.rollouts
        self.calls += other.calls
        self.samples += other.samples
        self.agents += other.agents or other.rollouts


def _call_version(call: Any) -> int:
    v = getattr(call, "policy_version", None)
    return NO_VERSION if v is None else int(v)


def build_samples(
    trajectory: Trajectory | dict[str, Any],
    *,
    rollout_id: str,
    group_id: str,
    reward: float,
    job_id: str | None = None,
) -> tuple[list[TrainingSample], MergeReport]:
    """Split one rollout's model calls into samples under token-exact prefix continuity.

    A call joins the sample of its agent whose ids so far (its calls' prompts
    and outputs) are the longest exact prefix of the call's prompt; only the
    new suffix of the prompt (observation, template tokens) is appended,
    unmasked, then its output, masked. A call that extends no sample opens a
    new one with its own prompt. Interleaved conversations (a main agent and
    its sub-agents) so merge into one sample each. A rollout without calls
    yields no sample.
    """
    traj = Trajectory.from_dict(trajectory) if isinstance(trajectory, dict) else trajectory
    reward = _finite_reward(reward, rollout_id)
    samples: list[TrainingSample] = []
    for i, call in enumerate(traj.calls):
        if len(call.logprobs) != len(call.output_ids):
            # Appending them as they are would shift every later log-prob off its token.
            raise SampleError(f"rollout {rollout_id!r}: call {i} has {len(call.logprobs)} logprobs "
                              f"for {len(call.output_ids)} output ids")
        prompt = list(call.prompt_ids)
        version = _call_version(call)
        cur: TrainingSample | None = None
        for sample in samples:
            n = len(sample.input_ids)
            if (sample.agent == call.agent and len(prompt) >= n and (cur is None or n > len(cur.input_ids))
                    and prompt[:n] == sample.input_ids):
                cur = sample
        if cur is not None:
            new = prompt[len(cur.input_ids) :]
        else:
            cur = TrainingSample(
                rollout_id=rollout_id, group_id=group_id, job_id=job_id or rollout_id,
                input_ids=[], response_mask=[], old_log_probs=[], policy_versions=[], reward=reward,
                agent=call.agent,
            )
            samples.append(cur)
            new = prompt
        out = list(call.output_ids)
        if call.structured is not None:
            start = len(cur.input_ids) + len(new)
            cur.constrained_positions += range(start, start + len(out))
        cur.input_ids += new + out
        cur.response_mask += [0] * len(new) + [1] * len(out)
        cur.old_log_probs += [0.0] * len(new) + [float(x) for x in call.logprobs]
        cur.policy_versions += [NO_VERSION] * len(new) + [version] * len(out)
        cur.calls.append(i)
    return samples, MergeReport(rollouts=1, calls=len(traj.calls), samples=len(samples),
                                agents=len({call.agent for call in traj.calls}) or 1)


def _baselines(rewards: Sequence[float], estimator: AdvantageEstimator, std_normalize: bool, eps: float) -> list[float]:
    n = len(rewards)
    if max(rewards) == min(rewards):
        # No signal, exactly: rounding in the mean (0.1 * 3 / 3 != 0.1) would leave ~1e-17 residues,
        # which std normalisation with a small eps blows up to advantages of order 1 (and eps=0 divides by 0).
        return [0.0] * n
    mean = sum(rewards) / n
    if estimator == AdvantageEstimator.RLOO:
        # Leave-one-out: r_i - mean(r_j, j != i); a group of one has no baseline to compare with.
        adv = [0.0] * n if n == 1 else [r - (mean * n - r) / (n - 1) for r in rewards]
    else:
        adv = [r - mean for r in rewards]
    if std_normalize and n > 1:
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        adv = [a / (std + eps) for a in adv]
    return adv


def assign_advantages(
    samples: Sequence[TrainingSample],
    *,
    estimator: AdvantageEstimator | str = AdvantageEstimator.GRPO,
    level: AdvantageLevel | str = AdvantageLevel.ROLLOUT,
    std_normalize: bool = False,
    eps: float = 1e-6,
    sampleless: Mapping[str, Sequence[float]] | None = None,
) -> None:
    """Set ``advantage`` on every sample from its group's baseline (in place).

    At the rollout level each rollout of a group counts once, whatever its
    number of samples, and all its samples get its advantage. At the sample
    level every sample counts once. ``std_normalize`` divides by the group's
    (sample) standard deviation + ``eps``. ``sampleless``: per group, the
    rewards of its rollouts that left no sample (a job that failed before its
    first model call, scored 0): they count in the group's baseline as the
    group was judged, though nothing of theirs is trained.
    """
    estimator = AdvantageEstimator(estimator)
    level = AdvantageLevel(level)
    groups: dict[str, list[TrainingSample]] = defaultdict(list)
    for s in samples:
        _finite_reward(s.reward, s.rollout_id)
        groups[s.group_id].append(s)
    extra = sampleless or {}
    for group_id, members in groups.items():
        others = [float(r) for r in extra.get(group_id, ())]
        for r in others:
            _finite_reward(r, group_id)
        if level == AdvantageLevel.SAMPLE:
            advantages = _baselines([s.reward for s in members] + others, estimator, std_normalize, eps)
            for s, a in zip(members, advantages[: len(members)], strict=True):
                s.advantage = a
            continue
        rewards: dict[str, float] = {}
        for s in members:
            if rewards.setdefault(s.rollout_id, s.reward) != s.reward:
                raise SampleError(f"rollout {s.rollout_id!r} has samples with different rewards")
        advantages = _baselines(list(rewards.values()) + others, estimator, std_normalize, eps)
        by_rollout = dict(zip(rewards, advantages[: len(rewards)], strict=True))
        for s in members:
            s.advantage = by_rollout[s.rollout_id]


def assign_loss_weights(samples: Sequence[TrainingSample], norm: LossNorm | str = LossNorm.ROLLOUT_TOKEN_MEAN) -> None:
    """Set per-token ``loss_weights`` (0 off the response mask) so that ``sum(w * loss)`` over the batch is the chosen mean.

    - token-mean: every response token of the batch weighs ``1 / total tokens``;
    - seq-mean-token-mean: ``1 / (samples * tokens of its sample)``;
    - rollout-token-mean: ``1 / (rollouts * tokens of its rollout, all samples)``.

    A sample (rollout) without any sampled token has no token mean and is not
    counted, so the weights of a batch with sampled tokens sum to 1.
    """
    norm = LossNorm(norm)
    total = sum(s.n_response_tokens for s in samples)
    per_rollout: dict[str, int] = defaultdict(int)
    for s in samples:
        per_rollout[s.rollout_id] += s.n_response_tokens
    n_sequences = sum(1 for s in samples if s.n_response_tokens)
    n_rollouts = sum(1 for n in per_rollout.values() if n)
    for s in samples:
        if norm == LossNorm.TOKEN_MEAN:
            denom = total
        elif norm == LossNorm.SEQ_MEAN_TOKEN_MEAN:
            denom = n_sequences * s.n_response_tokens
        else:
            denom = n_rollouts * per_rollout[s.rollout_id]
        w = 1.0 / denom if denom else 0.0
        s.loss_weights = [w * m for m in s.response_mask]


def apply_off_policy(
    samples: Sequence[TrainingSample],
    mode: OffPolicy | str = OffPolicy.KEEP,
    *,
    current_log_probs: Callable[[TrainingSample], Sequence[float]] | None = None,
    is_cap: float = 2.0,
) -> int:
    """Reweight the off-policy tokens of each sample (in place, after :func:`assign_loss_weights`); return how many.

    A token is off-policy when it was sampled under an older policy version
    than the newest version among its sample's sampled tokens (a carried-over
    rollout whose later calls were served by newer weights).

    - ``mask``: its loss weight becomes 0;
    - ``truncated_is``: its loss weight is multiplied by the truncated
      importance ratio ``min(exp(logp_now - logp_old), is_cap)``, where
      ``logp_old`` is the engine's sampling log-prob (``old_log_probs``) and
      ``logp_now`` the trainer's current policy's, from
      ``current_log_probs(sample)`` (aligned with ``input_ids``).

    Loss normalisation is left as computed over all sampled tokens, so a
    masked token contributes nothing and the others keep their weights.
    """
    mode = OffPolicy(mode)
    if mode == OffPolicy.TRUNCATED_IS:
        if current_log_probs is None:
            raise ValueError("off_policy='truncated_is' needs current_log_probs(sample): the trainer's log-probs per token")
        if not (is_cap > 0 and math.isfinite(is_cap)):
            raise ValueError(f"is_cap must be a positive finite number, got {is_cap!r}")
    count = 0
    for s in samples:
        positions = s.off_policy_positions()
        count += len(positions)
        if mode == OffPolicy.KEEP or not positions:
            continue
        if len(s.loss_weights) != len(s.input_ids):
            raise SampleError(f"sample of rollout {s.rollout_id!r} has {len(s.loss_weights)} loss weights for "
                              f"{len(s.input_ids)} ids: call assign_loss_weights before apply_off_policy")
        if mode == OffPolicy.MASK:
            for i in positions:
                s.loss_weights[i] = 0.0
            continue
        assert current_log_probs is not None
        now = list(current_log_probs(s))
        if len(now) != len(s.input_ids):
            raise SampleError(f"current_log_probs of sample {s.rollout_id!r} has {len(now)} values for "
                              f"{len(s.input_ids)} ids")
        for i in positions:
            delta = float(now[i]) - s.old_log_probs[i]
            if math.isnan(delta):
                raise SampleError(f"sample of rollout {s.rollout_id!r}: log-prob ratio at token {i} is NaN "
                                  f"(current {now[i]!r}, old {s.old_log_probs[i]!r})")
            # min(exp(delta), cap) without exp overflowing on a large delta (an old log-prob of -1e4, say).
            s.loss_weights[i] *= is_cap if delta >= math.log(is_cap) else math.exp(delta)
    return count


def pack_micro_batches(samples: Sequence[TrainingSample], max_tokens: int) -> list[list[TrainingSample]]:
    """Group samples into micro-batches of at most ``max_tokens`` ids, keeping each rollout's samples together.

    First-fit decreasing over whole rollouts; a rollout longer than the
    budget gets a micro-batch of its own (it is never split). Order within a
    rollout is kept.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    rollouts: dict[str, list[TrainingSample]] = defaultdict(list)
    for s in samples:
        rollouts[s.rollout_id].append(s)
    units = sorted(rollouts.values(), key=lambda ss: -sum(len(s) for s in ss))
    bins: list[tuple[int, list[TrainingSample]]] = []
    for unit in units:
        size = sum(len(s) for s in unit)
        for i, (used, members) in enumerate(bins):
            if used + size <= max_tokens:
                bins[i] = (used + size, members + unit)
                break
        else:
            bins.append((size, list(unit)))
    return [members for _, members in bins]


@dataclass
class SampleBatch:
    """Samples of one training step with their merge report."""

    samples: list[TrainingSample]
    report: MergeReport
    #: Sampled tokens served under an older policy version than their sample's newest (whatever ``off_policy`` did).
    off_policy_tokens: int = 0
    #: Results that gave no sample: no token-level trajectory (a task that records none, a job failed before its
    #: first model call) or no reward. With a reward, they still count in their group's baseline.
    skipped: int = 0

    @property
    def off_policy_fraction(self) -> float:
        """Off-policy tokens / all sampled tokens (0.0 without any)."""
        total = sum(s.n_response_tokens for s in self.samples)
        return self.off_policy_tokens / total if total else 0.0


def _warn_if_ungrouped(samples: Sequence[TrainingSample], sampleless: Mapping[str, Sequence[float]]) -> None:
    """Warn when several rollouts each make a group of one: both estimators compare a rollout with the rest of its
    group, so every advantage is 0 and the step trains nothing, without any error to show it."""
    members: dict[str, set[str]] = defaultdict(set)
    for sample in samples:
        members[sample.group_id].add(sample.rollout_id)
    sizes = [len(rollouts) + len(sampleless.get(group, ())) for group, rollouts in members.items()]
    if len(sizes) > 1 and max(sizes) == 1:
        log.warning("each of the %d rollouts is in a group of its own, so every advantage is 0 (GRPO and RLOO compare "
                    "a rollout with its group): give results a group_id (client.submit(..., n=8) groups each "
                    "instance's jobs; DapoSampler's batches do too) or pass group_of={job_id: group}", len(sizes))


def samples_from_results(
    results: Iterable[Any],
    *,
    group_of: dict[str, str] | None = None,
    estimator: AdvantageEstimator | str = AdvantageEstimator.GRPO,
    level: AdvantageLevel | str = AdvantageLevel.ROLLOUT,
    std_normalize: bool = False,
    loss_norm: LossNorm | str = LossNorm.ROLLOUT_TOKEN_MEAN,
    off_policy: OffPolicy | str = OffPolicy.KEEP,
    current_log_probs: Callable[[TrainingSample], Sequence[float]] | None = None,
    is_cap: float = 2.0,
    agents: Iterable[str | None] | None = None,
    mask_constrained: bool = False,
) -> SampleBatch:
    """Job results (``JobResult`` with a ``trajectory`` in its output) into weighted samples.

    The group of a result is ``group_of[job_id]``, else its ``group_id``
    field, else its job id (``client.submit(..., n=8)`` groups each instance's 8 jobs; with every rollout in
    a group of its own, every advantage is 0, and a warning says so). Results without a trajectory or reward are skipped (counted in
    ``SampleBatch.skipped``); one with a reward still counts in its group's baseline, so a group is trained
    as the sampler judged it (a job that failed before its first model call, scored 0 under ``zero_reward``).
    ``off_policy`` (with ``current_log_probs``, ``is_cap``): see :func:`apply_off_policy`.
    ``agents``: train only these agents' samples (``ModelCall.agent``; ``None`` in it keeps unnamed
    ones), as in selective optimisation of one agent of a multi-agent harness; advantages are
    computed over every sample first, so a rollout's advantage is the same whichever agents are kept.
    ``mask_constrained``: a loss weight of 0 on the tokens sampled under a constraint (a JSON format, a regex:
    ``ModelCall.structured``), whose log-probs are the masked distribution's and whose forced tokens were no
    choice of the model's; the normalisation still counts them, as for masked off-policy tokens.
    """
    report = MergeReport()
    out: list[TrainingSample] = []
    sampleless: dict[str, list[float]] = defaultdict(list)
    skipped = 0
    for r in results:
        output = r.output if isinstance(r.output, dict) else {}
        traj = output.get("trajectory")
        group = (group_of or {}).get(r.job_id) or getattr(r, "group_id", None) or r.job_id
        if traj is None or r.reward is None:
            skipped += 1
            if r.reward is not None:  # judged with its group (a failed job scored 0): part of the baseline
                sampleless[group].append(float(r.reward))
            continue
        samples, rep = build_samples(traj, rollout_id=r.job_id, group_id=group, reward=float(r.reward), job_id=r.job_id)
        out += samples
        report.add(rep)
    if skipped and not out:
        log.warning("no training sample from %d result(s): none holds a token-level trajectory with a reward "
                    "(a task that records no trajectory, such as sim_agent, or jobs that failed before any model call)",
                    skipped)
    _warn_if_ungrouped(out, sampleless)
    assign_advantages(out, estimator=estimator, level=level, std_normalize=std_normalize, sampleless=sampleless)
    if agents is not None:
        chosen = set(agents)
        out = [sample for sample in out if sample.agent in chosen]
    assign_loss_weights(out, loss_norm)
    if mask_constrained:
        for sample in out:
            for i in sample.constrained_positions:
                sample.loss_weights[i] = 0.0
    stale = apply_off_policy(out, off_policy, current_log_probs=current_log_probs, is_cap=is_cap)
    return SampleBatch(out, report, stale, skipped)
