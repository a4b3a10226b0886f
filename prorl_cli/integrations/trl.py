"""TRL's ``GRPOTrainer`` with prorl as its rollout engine (the ``rollout_func`` hook).

TRL (1.16) calls ``rollout_func(prompts, trainer)`` with the prompts of one
generation batch (each prompt ``num_generations`` times in a row, as its
``RepeatSampler`` lays them out) and expects a dict of lists, one entry per
prompt: ``prompt_ids``, ``completion_ids``, ``logprobs`` (per completion
token), optionally ``env_mask`` (1 on tokens the model sampled, 0 on tool or
observation tokens: they stay in the sequence but out of the loss); any
other key is handed to the reward functions as a keyword argument.

:class:`ProrlRollout` is such a function. Per call it

1. syncs weights when the trainer's ``global_step`` moved: saves the model,
   then ``client.sync_weights(checkpoint, step)`` (drains, every bridge
   loads it in place, resumes even when a load fails); the step is the
   policy version;
2. submits each prompt group as ``num_generations`` prorl jobs of ``task``
   (multi-turn agent episodes in sandboxes) through a DAPO sampler in sync
   mode that keeps every group (TRL needs one completion per prompt), then
   cancels what is left and forgets the results at the broker;
3. turns each trajectory into one training sequence with
   :func:`prorl_cli.training.samples.samples_from_results` (calls merged
   only where token-prefix continuity holds): the sample's prompt ids, its
   response ids (model output and tool tokens), the engine's log-probs,
   ``env_mask`` = the response mask, and ``prorl_reward`` (read it with
   :func:`prorl_reward`).

A rollout whose calls do not all merge into one sample (a prompt that is not
a token-exact extension) gives TRL its first sample only; :attr:`history`
counts those (``split_rollouts``) with the merge ratio, per call.

TRL's ``max_completion_length`` bounds what TRL gets, as it bounds TRL's own
generation: each model call's ``max_tokens`` is at most that (that, when
``sampling`` sets none), and a multi-turn completion longer than it (several
calls, tool tokens between them) is cut to it, its ids, log-probs and mask
alike (``truncated_rollouts``); TRL's ``dr_grpo`` loss divides by it.

Job ids are ``{run_id}-s{call}-p{i}-k{k}``. The default ``run_id`` is
``trl-`` and a random suffix, one per :class:`ProrlRollout`: two trainers on
one deployment, or a trainer restarted after a crash, never share ids (the
broker returns the job it holds for a known id, so a shared id would hand
one run the other's rollouts). An explicit ``run_id`` is used as given,
so a run's jobs are found by it (``prorl results --prefix RUN_ID-``). A
call whose ids the broker holds with other work (a trainer restarted from a
checkpoint or requeued, whose calls are numbered from 0 again, or another
trainer under the same ``run_id``) is not handed that work: it and every
later call go on under ``{run_id}-r1`` (``-r2``, ...), and a warning says
so. With the same work (prompts and sampling), the jobs held are used (a
warning says how many).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import ProrlError, RunIdTaken
from prorl_cli.protocol import JobResult
from prorl_cli.training.samples import (
    NO_VERSION,
    TrainingSample,
    filler_token_id,
    samples_from_results,
)

log = logging.getLogger(__name__)

# How many prefixes one call tries before a RunIdTaken is the caller's: each try that found other work moved on
# to a new one, so more means trainers racing under one run_id.
_ID_TRIES = 4

#: The extra field that carries prorl's reward to TRL's reward functions.
REWARD_FIELD = "prorl_reward"


class RolloutMismatch(ProrlError, ValueError):
    """TRL handed the rollout function prompts that do not come in groups of ``num_generations``."""


@dataclass
class TrlRow:
    """One completion as TRL takes it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    reward: float
    #: Policy versions of the sampled tokens (``-1`` where not reported); empty for a failed rollout.
    policy_versions: list[int] = field(default_factory=list)


@dataclass
class RolloutStats:
    """What one ``rollout_func`` call did."""

    global_step: int
    policy_version: int
    groups: int = 0
    #: Groups whose rewards are not all equal: the others get advantage 0 on every token under GRPO.
    informative_groups: int = 0
    rollouts: int = 0
    failed: int = 0
    #: Rollouts whose calls made more than one sample (TRL got the first).
    split_rollouts: int = 0
    merge_ratio: float = 1.0
    sampled_tokens: int = 0
    #: Completion tokens the model did not sample (tool output, observations, chat scaffolding): masked out.
    masked_tokens: int = 0
    #: Policy versions of the sampled tokens (sorted, distinct).
    policy_versions: list[int] = field(default_factory=list)
    #: Completions longer than the trainer's ``max_completion_length``, cut to it.
    truncated_rollouts: int = 0
    #: Jobs the broker already held under this call's ids (an explicit ``run_id`` used before): their results used.
    existing_jobs: int = 0
    sync_s: float = 0.0
    wall_s: float = 0.0


def prorl_reward(prompts: Any = None, completions: Any = None, **kwargs: Any) -> list[float]:
    """A TRL reward function that returns prorl's reward of each completion (the handler's EVAL)."""
    rewards = kwargs.get(REWARD_FIELD)
    if rewards is None:
        raise RolloutMismatch(f"no {REWARD_FIELD!r} field: the trainer's rollout_func is not prorl's ProrlRollout")
    return [float(r) for r in rewards]


def row_from_sample(sample: TrainingSample) -> TrlRow:
    """A training sample as TRL's prompt / completion / log-probs / mask.

    A sample whose per-token lists differ in length raises :class:`~prorl_cli.training.samples.SampleError`.
    """
    sample.check_aligned()
    p = sample.prompt_length
    return TrlRow(
        prompt_ids=list(sample.input_ids[:p]),
        completion_ids=list(sample.input_ids[p:]),
        logprobs=list(sample.old_log_probs[p:]),
        env_mask=list(sample.response_mask[p:]),
        reward=float(sample.reward),
        policy_versions=[v for v, m in zip(sample.policy_versions[p:], sample.response_mask[p:], strict=True) if m],
    )


def truncate_row(row: TrlRow, length: int) -> TrlRow:
    """``row`` with its completion cut to ``length`` tokens: ids, log-probs, mask and the versions of the sampled
    tokens kept alike (TRL bounds a completion by ``max_completion_length``, as its own generation does)."""
    mask = row.env_mask[:length]
    return TrlRow(prompt_ids=row.prompt_ids, completion_ids=row.completion_ids[:length], logprobs=row.logprobs[:length],
                  env_mask=mask, reward=row.reward, policy_versions=row.policy_versions[:sum(mask)])


def failed_row(result: JobResult, eos_id: int) -> TrlRow:
    """A rollout that produced no trajectory: one masked end-of-sequence token, reward 0."""
    log.warning("job %s %s (%s): TRL gets a masked empty completion with reward 0", result.job_id, result.state,
                (result.error or {}).get("message") if isinstance(result.error, dict) else result.error)
    return TrlRow(prompt_ids=[eos_id], completion_ids=[eos_id], logprobs=[0.0], env_mask=[0], reward=0.0)


class ProrlRollout:
    """``rollout_func`` for ``trl.GRPOTrainer``: prompts become prorl jobs (see the module docstring).

    ``client``: a :class:`prorl_cli.client.RolloutClient` of the deployment.
    ``task``: the prorl task (``math_agent``, ``math``, a harness...).
    ``instance_of(prompt)``: the task instance of a dataset prompt (default:
    the prompt itself, which must then be what the task takes).
    ``checkpoint_dir``: where weights are saved for the bridges to load
    (a directory every bridge can read); ``sync_weights=False`` leaves the
    bridges' weights alone (evaluation, or a trainer that syncs itself).
    ``max_consecutive_failures``: a call whose rollouts fail this many in a
    row, none finishing between them, raises
    :class:`~prorl_cli.exceptions.RolloutsFailing` with the failures grouped
    instead of handing TRL zero-reward rows from a deployment that works no
    more (``None``: the sampler's default; ``0``: never, every failure is a
    zero-reward row).
    ``run_id``: the job ids' prefix; ``None`` (the default) makes one of its own,
    ``trl-`` and a random suffix (see the module docstring).
    """

    def __init__(
        self,
        client: Any,
        task: str,
        *,
        instance_of: Callable[[Any], Any] | None = None,
        sampling: dict[str, Any] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        sync_weights: bool = True,
        timeout_s: float | None = None,
        step_timeout_s: float | None = None,
        drain_timeout_s: float = 300.0,
        run_id: str | None = None,
        max_consecutive_failures: int | None = None,
    ) -> None:
        if sync_weights and checkpoint_dir is None:
            raise ValueError("ProrlRollout: sync_weights needs a checkpoint_dir the bridges can read")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(f"ProrlRollout: run_id must be a non-empty string or None (one of its own), got {run_id!r}")
        self.client = client
        self.task = task
        self.instance_of = instance_of or (lambda prompt: prompt)
        self.sampling = sampling
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.sync_weights = sync_weights
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.drain_timeout_s = drain_timeout_s
        # Calls are numbered from 0 in every ProrlRollout: under one fixed id, two trainers on one deployment (or one
        # restarted) would submit the same job ids and be handed each other's rollouts.
        self.run_id = run_id if run_id is not None else f"trl-{secrets.token_hex(4)}"
        self.max_consecutive_failures = max_consecutive_failures
        #: The policy version the bridges serve (the trainer step of the weights last synced); None before the first sync.
        self.policy_version: int | None = None
        #: One entry per call.
        self.history: list[RolloutStats] = []
        #: The rows of the last call (for inspection and tests).
        self.last_rows: list[TrlRow] = []
        self._calls = 0
        #: How many times this ProrlRollout's job ids were found to hold another run's work (see :attr:`job_prefix`).
        self._restarts = 0
        self._warned_capped = False
        #: Prompt positions the calls so far took (the next call's sampler starts there).
        self._positions = 0
        # TRL checks the function's name in logs; give instances one.
        self.__name__ = "prorl_rollout"

    # ------------------------------------------------------------- weights

    def sync(self, trainer: Any) -> float:
        """Hand the trainer's current weights to every bridge under version ``global_step``; return seconds spent."""
        step = int(trainer.state.global_step)
        if not self.sync_weights or step == self.policy_version:
            return 0.0
        assert self.checkpoint_dir is not None
        started = time.monotonic()
        path = self.checkpoint_dir / f"v{step}"
        model = trainer.accelerator.unwrap_model(trainer.model)
        model.save_pretrained(str(path))
        tokenizer = getattr(trainer, "processing_class", None)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(path))
        self.client.sync_weights(path, step, drain_timeout_s=self.drain_timeout_s)
        self.policy_version = step
        return time.monotonic() - started

    # ------------------------------------------------------------- rollouts

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, Any]:
        started = time.monotonic()
        group_size = int(trainer.num_generations if trainer.model.training else trainer.num_generations_eval)
        groups = _groups(prompts, group_size)
        sync_s = self.sync(trainer)
        version = self.policy_version if self.policy_version is not None else int(trainer.state.global_step)
        stats = RolloutStats(global_step=int(trainer.state.global_step), policy_version=version, sync_s=sync_s)
        limit = _completion_limit(trainer)
        results = self._run(groups, group_size, version, self.sampling_for(limit), stats)
        eos_id = _eos_id(trainer)
        rows = self._rows(results, stats, eos_id, limit)
        stats.groups, stats.rollouts = len(groups), len(rows)
        stats.informative_groups = sum(
            len({r.reward for r in rows[i: i + group_size]}) > 1 for i in range(0, len(rows), group_size))
        stats.wall_s = time.monotonic() - started
        self.history.append(stats)
        self.last_rows = rows
        log.info("rollout %d: %d groups, %d failed, merge ratio %.2f, %d split, versions %s, %.1f s",
                 self._calls, stats.groups, stats.failed, stats.merge_ratio, stats.split_rollouts,
                 stats.policy_versions, stats.wall_s)
        return {
            "prompt_ids": [r.prompt_ids for r in rows],
            "completion_ids": [r.completion_ids for r in rows],
            "logprobs": [r.logprobs for r in rows],
            "env_mask": [r.env_mask for r in rows],
            REWARD_FIELD: [r.reward for r in rows],
        }

    def sampling_for(self, max_completion_length: int | None) -> dict[str, Any] | None:
        """``sampling`` with ``max_tokens`` at most ``max_completion_length`` (that, where none is given).

        One call's tokens are part of the completion: more than TRL's bound could never be trained on whole.
        """
        if max_completion_length is None:
            return self.sampling
        sampling = dict(self.sampling or {})
        given = sampling.get("max_tokens")
        if given is not None and not (type(given) is int and given > max_completion_length):
            return sampling  # within the bound, or not a count at all (the sampler's check names it)
        if given is not None and not self._warned_capped:
            self._warned_capped = True
            log.warning("sampling max_tokens %r is over the trainer's max_completion_length (%d): each call's "
                        "max_tokens is capped at it", given, max_completion_length)
        sampling["max_tokens"] = max_completion_length
        return sampling

    def _run(self, groups: list[Any], group_size: int, version: int, sampling: dict[str, Any] | None = None,
             stats: RolloutStats | None = None) -> list[JobResult]:
        """Every group's results, in prompt order, through a sync-mode DAPO sampler that keeps every group."""
        instances = [self.instance_of(prompt) for prompt in groups]
        call, positions = self._calls, self._positions
        self._calls += 1
        self._positions += len(instances)
        for tries in itertools.count(1):
            try:
                batch = self._step(instances, group_size, version, sampling, call, positions)
                break
            except RunIdTaken as e:
                # Another run's jobs under these ids: this run restarted (from a checkpoint, by a requeue) or a
                # trainer beside it under the same run_id. Their results are not this call's rollouts; ids of their
                # own under the run_id are (``-r1``, ``-r2``, ...), for this call and every later one.
                if tries >= _ID_TRIES:
                    raise
                self._restarts += 1
                log.warning("rollout call %d: %s; this ProrlRollout goes on under job ids %s-r%d-*", call, e,
                            self.run_id, self._restarts)
        if batch.stats.existing_jobs:
            # The sampler stays quiet here (a state= was passed, to number the call): held jobs with the same work
            # under these ids are a restarted run's or a twin's, used as they are.
            log.warning("rollout call %d: %d job id(s) of run_id %r were already at the broker with the same work: "
                        "their results are used, not new rollouts (another run under this run_id, or this one "
                        "restarted; leave run_id unset for ids of this ProrlRollout's own)",
                        call, batch.stats.existing_jobs, self.run_id)
        if stats is not None:
            stats.existing_jobs = batch.stats.existing_jobs
        by_position = sorted(batch.groups, key=lambda g: int(g.prompt_id))
        results = [r for g in by_position for r in g.results]
        ids = [r.job_id for r in results]
        self.client.forget(ids)  # the rows below are all TRL keeps
        return results


    def _step(self, instances: list[Any], group_size: int, version: int, sampling: dict[str, Any] | None,
              call: int, positions: int) -> Any:
        """One sync-mode sampler step over ``instances`` as call number ``call`` (its prompts from ``positions`` on)."""
        from prorl_cli.training.sampler import BlockingDapoSampler, SamplerConfig, SamplerState

        config = SamplerConfig(
            group_size=group_size, target_groups=len(instances), mode="sync", carry_over=False,
            failed="zero_reward", informative=lambda rewards: True, run_id=self.job_prefix,
            timeout_s=self.timeout_s, sampling=sampling, step_timeout_s=self.step_timeout_s,
            max_consecutive_failures=self.max_consecutive_failures,
        )
        # Positions go on from the last call's, so a seed in ``sampling`` numbers every rollout of the run
        # (each call's would otherwise start again at the same seeds); a group's prompt id is its index here.
        sampler = BlockingDapoSampler(self.client, self.task, instances, config,
                                      state=SamplerState(step=call, cursor=positions),
                                      prompt_id=lambda position, _instance: str(position % len(instances)))
        try:
            return sampler.step(policy_version=version)
        finally:
            sampler.close()  # cancels whatever still runs (a step that timed out, or one given up for other work)

    @property
    def job_prefix(self) -> str:
        """What the job ids start with: ``run_id``, then ``-rN`` once its ids were found to hold other work N times."""
        return self.run_id if self._restarts == 0 else f"{self.run_id}-r{self._restarts}"

    def _rows(self, results: list[JobResult], stats: RolloutStats, eos_id: int,
              max_completion_length: int | None = None) -> list[TrlRow]:
        built = samples_from_results([r for r in results if r.ok])
        stats.merge_ratio = built.report.merge_ratio
        by_rollout: dict[str, list[TrainingSample]] = {}
        for s in built.samples:
            by_rollout.setdefault(s.rollout_id, []).append(s)
        rows: list[TrlRow] = []
        versions: set[int] = set()
        for r in results:
            samples = by_rollout.get(r.job_id)
            if not samples:
                stats.failed += 1
                rows.append(failed_row(r, eos_id))
                continue
            if len(samples) > 1:
                stats.split_rollouts += 1
            row = row_from_sample(samples[0])
            if max_completion_length is not None and len(row.completion_ids) > max_completion_length:
                row = truncate_row(row, max_completion_length)
                stats.truncated_rollouts += 1
            stats.sampled_tokens += sum(row.env_mask)
            stats.masked_tokens += len(row.env_mask) - sum(row.env_mask)
            versions.update(v for v in row.policy_versions if v != NO_VERSION)
            rows.append(row)
        stats.policy_versions = sorted(versions)
        if stats.truncated_rollouts:
            log.warning("%d of %d completions were longer than the trainer's max_completion_length (%d) and were cut "
                        "to it (their reward is the whole episode's): raise max_completion_length, or bound the "
                        "episodes (fewer turns, a lower max_tokens)", stats.truncated_rollouts, len(results),
                        max_completion_length)
        return rows


def _groups(prompts: Sequence[Any], group_size: int) -> list[Any]:
    """The distinct prompt of each run of ``group_size`` equal prompts (TRL's ``RepeatSampler`` order)."""
    if group_size < 1 or len(prompts) % group_size:
        raise RolloutMismatch(f"{len(prompts)} prompts do not split into groups of num_generations={group_size}")
    groups = []
    for i in range(0, len(prompts), group_size):
        chunk = prompts[i: i + group_size]
        if any(p != chunk[0] for p in chunk[1:]):
            raise RolloutMismatch(f"prompts {i}..{i + group_size - 1} are not one prompt repeated num_generations times")
        groups.append(chunk[0])
    return groups


def _completion_limit(trainer: Any) -> int | None:
    """The trainer's ``max_completion_length`` (``GRPOTrainer`` keeps it, from ``GRPOConfig``); None: no bound."""
    limit = getattr(trainer, "max_completion_length", None)
    if limit is None:
        limit = getattr(getattr(trainer, "args", None), "max_completion_length", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def _eos_id(trainer: Any) -> int:
    tok = getattr(trainer, "processing_class", None)
    return filler_token_id(getattr(tok, "tokenizer", tok))
