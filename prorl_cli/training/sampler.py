"""DAPO dynamic sampling over the broker, with asynchronous replenishment.

:class:`DapoSampler` turns a prompt list into training steps of
*informative* groups (``group_size`` rollouts of one prompt whose rewards
are not all equal), the way ProRL Agent's trainer does:

- **continuous throughput**: up to ``max_in_flight`` jobs run at once; a
  new prompt group is submitted as soon as there is room, not batch by batch;
- **zero-variance filtering**: a finished group that fails ``informative``
  (default: rewards not all equal) is dropped; failed jobs drop their group,
  count as reward 0, or are left out, as ``failed`` says;
- **early termination**: groups that cannot help (a member failed under
  ``failed="drop_group"``, too stale, or still running at the end of a step
  without carry-over) are cancelled at the broker; the step reports how many
  jobs that was and how long they had been in flight;
  (``cancel_dropped=False`` leaves them running, results ignored: an ablation);
- **carry-over**: with ``carry_over`` on, groups still running when a step
  reaches its target complete into the next step, tagged with the policy
  version they were submitted under; groups older than ``max_staleness``
  versions are cancelled. So that carried work is work the next steps can
  use, groups in flight (or finished and not yet taken) are capped at
  ``carry_window_steps`` steps' worth (default 1.75; 0: no cap), a step's
  worth being ``target_groups`` over the share of finished groups that were
  informative so far. Without the cap, replenishment keeps refilling the
  job slots a group's finished members free, the groups in flight pile up
  to several steps' worth, a group waits that many steps to complete (the
  short ones overtake it), and the long ones run for several steps only to
  be cancelled as stale. The window is what sets the steps' lag: in steady
  state a step lasts about a group's time to finish over the window (in
  steps), so a window of ``w`` steps makes a group complete ``w`` steps
  after it was submitted on average. The window also sets how many jobs
  share the engines, and an engine's cost per token falls as its batches
  grow: 1.75 keeps about as many jobs live as the backends' KV caches hold
  (the broker's KV admission starts the rest when there is room), and
  ``max_staleness: 2`` lets the tail of a 1.75-step lag finish instead of
  being cancelled. Narrower (1.0 with staleness 1) is fresher data and
  smaller batches; wider makes the lag's tail run into the staleness limit
  (docs/benchmarks.md, Table 3);
- **skipping prompts that stopped teaching** (``skip_filtered_prompts``, off by
  default): over several epochs, a prompt whose last group was filtered
  (the policy solved it every time, or never) is skipped with that
  probability when the walk comes back to it, instead of paying a whole
  group of rollouts to learn that again; below 1, so it is still tried now
  and then (the policy moves), as GRESO's pre-rollout filtering does. The
  draw is fixed by the run id and the prompt's position, so a resumed run
  skips the same ones;
- **bounded steps**: a step that cannot reach its target stops with an error
  instead of submitting rollouts for ever: after ``max_groups_per_step``
  groups all finished with too few informative ones among them
  (:class:`~prorl_cli.exceptions.StepGroupsExhausted`: the task's rewards
  never vary, or too rarely; verl's ``filter_groups.max_num_gen_batches``),
  or once ``max_consecutive_failures`` job results in a row failed
  (:class:`~prorl_cli.exceptions.RolloutsFailing`, with the failures grouped
  by stage, error type and message: the task fails every rollout). Both
  defaults are far from what a healthy run meets (see :class:`SamplerConfig`);
  0 turns either off. A ``step()`` that raised leaves its step open: the next
  call goes on with it, and the step's :class:`StepStats` (and its group
  bound) count every attempt;
- **resumable**: job ids are ``{run_id}-s{step}-p{prompt_id}-k{k}``; a trainer
  restarted from :meth:`DapoSampler.state` resubmits the same ids and gets
  the broker's existing jobs (and finished results) back. A trainer that
  stops on purpose closes with ``close(cancel_in_flight=False)`` after saving
  the state, so its carried groups run on; jobs of theirs that a plain
  ``close()`` cancelled are run again under the same ids
  (``StepStats.rerun_jobs``), not counted as failed;
- **one run per run id**: each job's meta carries a digest of its work (task,
  sampling, instance); a result of a job under one of the run's ids that holds
  other work (another run under the same ``run_id``, whose job the broker
  returned for the id) raises :class:`~prorl_cli.exceptions.ConfigError`
  naming the run id instead of being trained on, and that run's jobs are
  neither cancelled nor forgotten.

``mode="sync"`` is the batch-by-batch baseline: submit a batch of groups,
wait for all of it, filter, repeat until the target is met.

Every generate call records the policy version it was served under in its
trajectory (``ModelCall.policy_version``), so stale token spans stay visible
after merging (``TrainingSample.policy_versions``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Any

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.client import AsyncRolloutClient
from prorl_cli.exceptions import (  # SamplerTimeout: importable from here too, where it was defined
    ClientMisuse,
    ConfigError,
    RolloutsFailing,
    RunIdTaken,
    SamplerClosed,
    SamplerTimeout,
    StepGroupsExhausted,
)
from prorl_cli.observe.failures import FailureGroups
from prorl_cli.protocol import JobResult, JobSpec, JobState, SamplingParams
from prorl_cli.protocol.checks import FieldError, Int, List, record_of

log = logging.getLogger(__name__)

FAILED_POLICIES = ("drop_group", "zero_reward", "exclude")
MODES = ("async", "sync")

#: ``max_groups_per_step``'s default is ``GROUPS_PER_TARGET * target_groups + GROUPS_SLACK``: a step then gives
#: up only below an informative rate of about 1/32 (verl's DAPO recipe, 10 generation batches of 3x the train
#: batch, stops at 1/30). The slack is for small targets, where luck weighs more: at a 5% rate a target of one
#: group still ends within 288 groups but once in a million steps, a target of 8 within 512 (6 standard
#: deviations above its mean of 160).
GROUPS_PER_TARGET = 32
GROUPS_SLACK = 256
#: ``max_consecutive_failures``'s default is the larger of this and the jobs a step has in flight at once. At a
#: 20% failure rate, 32 in a row come once in 10^22 results. However many fail in a row, the step stops only once
#: every job that was in flight when they began has ended as well (failed: a finished one starts the count over),
#: so jobs failing fast beside healthy long rollouts (a broken node) never stop a run that still works.
FAILURES_FLOOR = 32


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """DAPO's filter: keep a group whose rewards are not all equal (at least two needed)."""
    return len(rewards) >= 2 and max(rewards) != min(rewards)


@dataclass
class SamplerConfig:
    """What one :class:`DapoSampler` does (see the module docstring)."""

    group_size: int
    target_groups: int
    #: Jobs running at once (async mode); default ``2 * group_size * target_groups``.
    max_in_flight: int | None = None
    mode: str = "async"
    carry_over: bool = True
    #: Policy versions a carried-over group may lag behind the current one before it is cancelled.
    max_staleness: int = 2
    failed: str = "drop_group"
    informative: Callable[[Sequence[float]], bool] = has_reward_variance
    run_id: str = "dapo"
    timeout_s: float | None = None
    #: Every job's sampling. A ``seed`` here seeds the run: the group at prompt position ``p`` samples its
    #: rollout ``k`` with ``derive_seed(seed, p * group_size + k)``, so a group's rollouts differ (one seed would
    #: make them the same on an engine that honours it: no variance, every group filtered) and a rerun repeats them.
    sampling: dict[str, Any] | None = None
    max_attempts: int | None = None
    #: Groups per batch in sync mode (default ``target_groups``).
    sync_batch_groups: int | None = None
    step_timeout_s: float | None = None
    #: With carry-over: at most this many steps' worth of groups in flight (module docstring); 0: no cap. A step
    #: with nothing in flight submits a group whatever the window, so a window under one step still makes progress.
    carry_window_steps: float = 1.75
    #: Off: groups the sampler drops (early termination, staleness, failed siblings) are abandoned but
    #: left running at the broker, their results ignored: the paper's "no stale-job cleanup" ablation.
    cancel_dropped: bool = True
    #: The chance of skipping, in a later epoch, a prompt whose last group was filtered (module docstring);
    #: 0: off. Below 1: such a prompt is still tried now and then.
    skip_filtered_prompts: float = 0.0
    #: Groups one step may submit, in all its attempts: once that many were submitted and every group in flight
    #: finished with fewer than ``target_groups`` informative ones, the step raises
    #: :class:`~prorl_cli.exceptions.StepGroupsExhausted` rather than submitting more. None: ``32 * target_groups +
    #: 256`` (:data:`GROUPS_PER_TARGET`); 0: no limit.
    max_groups_per_step: int | None = None
    #: Job results in a row that may fail (failed, timed out, or cancelled by another hand), none finishing
    #: between them, before the step raises :class:`~prorl_cli.exceptions.RolloutsFailing` with the failures
    #: grouped, once every job in flight when they began has ended too. It counts across steps; one finished job
    #: starts it over. None: the larger of 32 and the jobs a step
    #: has in flight at once (``max_in_flight``; in sync mode a batch's); 0: no limit.
    max_consecutive_failures: int | None = None

    def __post_init__(self) -> None:
        """Check every setting here, before a step runs: a bad one raises :class:`ConfigError` naming it."""

        def bad(name: str, rule: str) -> ConfigError:
            return ConfigError(f"sampler {name} must be {rule}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("group_size", "target_groups"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "a positive integer")
        for name in ("max_in_flight", "sync_batch_groups", "max_attempts"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise bad(name, "a positive integer or None")
        for name in ("max_groups_per_step", "max_consecutive_failures"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                raise bad(name, "an integer >= 0 (0: no limit) or None (the default)")
        if not is_int(self.max_staleness) or self.max_staleness < 0:
            raise bad("max_staleness", "an integer >= 0 (policy versions)")
        if not is_number(self.carry_window_steps) or self.carry_window_steps < 0:
            raise bad("carry_window_steps", "a number >= 0 (0: no cap)")
        if not is_number(self.skip_filtered_prompts) or not 0 <= self.skip_filtered_prompts < 1:
            raise bad("skip_filtered_prompts", "a probability in [0, 1) (below 1: a skipped prompt is tried again "
                                               "now and then, as the policy moves)")
        for name in ("timeout_s", "step_timeout_s"):
            v = getattr(self, name)
            if v is not None and (not is_number(v) or v <= 0):
                raise bad(name, "a positive number of seconds or None")
        for name in ("carry_over", "cancel_dropped"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        if self.mode not in MODES:
            raise bad("mode", f"one of {MODES}")
        if self.failed not in FAILED_POLICIES:
            raise bad("failed", f"one of {FAILED_POLICIES}")
        if not callable(self.informative):
            raise bad("informative", "a function of a group's rewards")
        if self.group_size == 1 and self.informative is has_reward_variance:
            # One reward never varies: no step could ever end, and it would submit rollouts until stopped.
            raise ConfigError("sampler group_size 1 can never pass the default filter (rewards that vary within a "
                              "group): use groups of 2 or more, or pass informative= a predicate of one reward")
        if not isinstance(self.run_id, str) or not self.run_id:
            raise bad("run_id", "a non-empty string")
        if self.sampling is not None and not isinstance(self.sampling, dict):
            raise bad("sampling", "a map of sampling parameters or None")
        if self.sampling is not None:
            # The submit schema's own check (unknown keys, types, ranges), here rather than at the first submit: a
            # typo (max_token) would otherwise pass until a step runs, or for ever where no step submits.
            try:
                SamplingParams.from_wire(self.sampling, "sampling")
            except FieldError as e:
                raise ConfigError(f"sampler {e.path} {e.detail}") from None
        if self.max_in_flight is None:
            self.max_in_flight = 2 * self.group_size * self.target_groups
        if self.max_in_flight < self.group_size:
            raise ConfigError(f"sampler max_in_flight ({self.max_in_flight}) is smaller than one group ({self.group_size})")

    # Properties, not values set above: ``dataclasses.replace(cfg, target_groups=...)`` then moves the defaults too.
    @property
    def group_limit(self) -> int:
        """``max_groups_per_step`` in effect (its default resolved); 0: no limit."""
        if self.max_groups_per_step is not None:
            return self.max_groups_per_step
        return GROUPS_PER_TARGET * self.target_groups + GROUPS_SLACK

    @property
    def failure_limit(self) -> int:
        """``max_consecutive_failures`` in effect (its default resolved); 0: no limit."""
        if self.max_consecutive_failures is not None:
            return self.max_consecutive_failures
        if self.mode == "sync":
            window = (self.sync_batch_groups or self.target_groups) * self.group_size
        else:
            window = self.max_in_flight or 2 * self.group_size * self.target_groups
        return max(FAILURES_FLOOR, window)


@dataclass
class Group:
    """A finished, informative group of one prompt: its ``group_size`` results, less the failed ones under
    ``failed="exclude"``; under ``failed="zero_reward"`` a failed one has reward 0."""

    group_id: str
    prompt_id: str
    instance: Any
    #: The step it was submitted in and the policy version current then.
    step: int
    policy_version: int
    results: list[JobResult]

    @property
    def rewards(self) -> list[float]:
        return [float(r.reward or 0.0) for r in self.results]


@dataclass
class StepStats:
    """What one step cost. ``cancelled_inflight_s`` is submit-to-cancel time of the cancelled jobs.

    A step is counted whole however many calls it took: a ``step()`` that raised (a :class:`SamplerTimeout`, an
    error of the broker's) leaves its step open, and the next call goes on with it and these stats. Every group
    the step saw is in one bucket: ``carried_in + submitted_groups == informative + filtered + failed_groups +
    stale_groups + carried_out`` (with carry-over; without it, the groups still running at the target are
    cancelled instead of carried out).
    """

    step: int
    policy_version: int
    #: Groups this step submitted, in all its attempts (a timed-out attempt's groups are the step's own).
    submitted_groups: int = 0
    informative: int = 0
    filtered: int = 0
    #: Groups dropped for failed jobs: under ``failed="drop_group"`` a group with one, under ``"exclude"`` a group
    #: whose jobs all failed (nothing left to judge).
    failed_groups: int = 0
    cancelled_jobs: int = 0
    cancelled_inflight_s: float = 0.0
    stale_groups: int = 0
    #: Prompts passed over because their last group was filtered (``skip_filtered_prompts``).
    skipped_prompts: int = 0
    #: Jobs a submit found already at the broker (a restarted trainer's resubmission: the submit reply's ``existing``).
    existing_jobs: int = 0
    #: Jobs of a restarted trainer's saved groups that the broker held cancelled (the earlier process's ``close()``
    #: cancels what is in flight by default), run again under the same ids instead of counting as failed.
    rerun_jobs: int = 0
    #: Groups the step began with, submitted before it (in flight, or informative and waiting): the previous step's
    #: ``carried_out``, or a restarted trainer's saved groups. Those too stale are among them, and in ``stale_groups``.
    carried_in: int = 0
    carried_out: int = 0
    in_flight: int = 0
    #: Seconds from the start of the step's first attempt to its return (the time between attempts included: the
    #: step's rollouts ran on through it).
    wall_s: float = 0.0
    #: Of the sampled tokens of the returned groups, the share served under an older policy version than
    #: the step's (carried-over groups); 0.0 when no call reported its version.
    off_policy_token_fraction: float = 0.0
    #: ``step()`` calls the step took: 1, or more when one raised and the step was called again.
    attempts: int = 1


@dataclass
class StepBatch:
    """One step's informative groups and its stats."""

    step: int
    policy_version: int
    groups: list[Group]
    stats: StepStats

    @property
    def results(self) -> list[JobResult]:
        return [r for g in self.groups for r in g.results]

    @property
    def group_of(self) -> dict[str, str]:
        """Job id -> group id (for :func:`prorl_cli.training.samples.samples_from_results`)."""
        return {r.job_id: g.group_id for g in self.groups for r in g.results}


#: A count in a saved state (a step, a prompt position, a policy version): an integer >= 0, never a boolean.
_COUNT = Int()
#: A saved state's lists have no length of their own to keep to (``filtered_prompts`` can hold every prompt).
_ANY_LENGTH = sys.maxsize


@dataclass
class CarriedGroup:
    """A group in flight at a checkpoint: enough to resubmit its exact ids."""

    position: Annotated[int, _COUNT]
    step: Annotated[int, _COUNT]
    policy_version: Annotated[int, _COUNT]


@dataclass
class SamplerState:
    """Checkpoint of a sampler between steps: save :meth:`to_dict` (JSON, YAML, a torch checkpoint) with the
    trainer's checkpoint; :meth:`from_dict` (or ``DapoSampler(..., state=that_dict)``) reads it back.

    Its fields declare their checks (``Annotated[type, check]``, :mod:`prorl_cli.protocol.checks`), as the wire
    records do: :meth:`from_dict` reads it with the same checkers.
    """

    step: Annotated[int, _COUNT] = 0
    cursor: Annotated[int, _COUNT] = 0
    carried: Annotated[list[CarriedGroup], List(record_of(CarriedGroup, strict=True), _ANY_LENGTH)] = \
        field(default_factory=list)
    #: Prompts (index in the prompt list) whose last finished group was filtered: what ``skip_filtered_prompts``
    #: reads.
    filtered_prompts: Annotated[list[int], List(_COUNT, _ANY_LENGTH)] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ints and lists of them, keyed by field."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplerState:
        """The state :meth:`to_dict` wrote. A field unknown, null or of the wrong type raises :class:`ConfigError`
        naming it (``carried[0].step``): a damaged checkpoint must not resubmit other jobs' ids. A field left out
        takes its default (``to_dict`` writes them all)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"sampler state: a mapping of {sorted(f.name for f in fields(cls))}, "
                              f"got {type(data).__name__}")
        # The checkers read plain dicts (as JSON gives them); a state may come as any mapping, with CarriedGroups.
        data = dict(data)
        if isinstance(data.get("carried"), list):
            data["carried"] = [asdict(g) if isinstance(g, CarriedGroup) else dict(g) if isinstance(g, Mapping) else g
                               for g in data["carried"]]
        # A record reads null as left out; a null here is damage (a cursor of null is not the first prompt).
        nulls = sorted(str(k) for k, v in data.items() if v is None)
        if nulls:
            raise ConfigError(f"sampler state: {', '.join(nulls)} must not be null")
        try:
            state: SamplerState = _STATE_RECORD(data, "")
        except FieldError as e:
            raise ConfigError(f"sampler state: {e.path + ' ' if e.path else ''}{e.detail}") from None
        return state


_STATE_RECORD = record_of(SamplerState, strict=True)


@dataclass
class _OpenStep:
    """A step begun and not yet returned: a ``step()`` that raised leaves it open, and the next call goes on with it
    (its stats, its group bound, its start time), so the step that returns reports all of it."""

    stats: StepStats
    started: float
    #: Its start is done (earlier steps' results forgotten, a restarted trainer's groups resubmitted, what it carried
    #: in counted): a step called again does not do it twice.
    begun: bool = False


@dataclass
class _Pending:
    group_id: str
    position: int
    prompt_id: str
    instance: Any
    step: int
    policy_version: int
    job_ids: list[str]
    submitted_at: float
    results: dict[str, JobResult] = field(default_factory=dict)
    #: Submission order (groups submitted before a run of failures began have a lower one).
    seq: int = 0
    #: Job id -> the digest of the work submitted under it (task, sampling, instance), also in the job's meta: a
    #: result whose meta holds another digest is another run's job under the same id.
    work: dict[str, str] = field(default_factory=dict)
    #: Ids the submit found already at the broker (a resumed run's own jobs, or another run's).
    existing: set[str] = field(default_factory=set)


def _check_prompts(prompts: Any) -> None:
    """Refuse, once and up front, prompts the sampler cannot walk by position: it would otherwise submit a string's
    characters (32 failed jobs later, ``RolloutsFailing``), or fail deep inside a step (a dict's ``KeyError: 0``)."""
    if isinstance(prompts, (str, bytes, bytearray, Mapping)):
        raise TypeError(f"prompts: a sequence of task instances (a list, a datasets.Dataset), got one "
                        f"{type(prompts).__name__}; put a single instance in a list")
    if not hasattr(prompts, "__len__") or not hasattr(prompts, "__getitem__"):
        # An iterator or generator: the sampler comes back to positions (epochs, a resumed cursor), so it needs them all.
        raise TypeError(f"prompts: a sequence of task instances indexed by position (a list, a datasets.Dataset), got "
                        f"{type(prompts).__name__}; make it a list first (list(prompts))")
    if len(prompts) == 0:
        raise ValueError("the sampler needs at least one prompt")
    try:
        prompts[0]
    except (KeyError, TypeError, IndexError) as e:
        # A table indexed by column (a pandas DataFrame): its rows are what the sampler submits.
        raise TypeError(f"prompts: a sequence indexed by position 0, 1, ..., but {type(prompts).__name__}[0] raised "
                        f"{type(e).__name__}: {e}; pass a list of its rows") from None


class DapoSampler:
    """Dynamic sampling over an :class:`AsyncRolloutClient` (see the module docstring).

    ``prompts`` is a sequence, walked in order and wrapped around; the
    prompt id of position ``i`` is ``prompt_id(i, prompts[i % len])`` (default
    ``str(i)``), so ids differ across epochs. With a ``seed`` in the sampling,
    rollout ``k`` of position ``i`` is seeded as rollout ``seed_index(i,
    prompt) * group_size + k`` of the run (default ``seed_index``: ``i``); a
    caller whose ids name something steadier than a place in ``prompts`` (a row
    of a file) gives its seeds the same footing, so a resumed run's jobs hold
    the same work. Anything with a length and
    integer indexing will do (a list, a ``datasets.Dataset``); one prompt (a
    ``str``, a ``dict``) or an iterator is refused with a ``TypeError``.

    One step at a time: a ``step()`` while another is under way raises
    :class:`~prorl_cli.exceptions.ClientMisuse`.
    """

    def __init__(
        self,
        client: AsyncRolloutClient,
        task: str,
        prompts: Sequence[Any],
        config: SamplerConfig,
        *,
        state: SamplerState | Mapping[str, Any] | None = None,
        prompt_id: Callable[[int, Any], str] | None = None,
        seed_index: Callable[[int, Any], int] | None = None,
    ) -> None:
        _check_prompts(prompts)
        if state is not None and not isinstance(state, SamplerState):
            state = SamplerState.from_dict(state)  # saved as plain data (to_dict, JSON)
        self.client = client
        self.task = task
        self.prompts = prompts
        self.config = config
        self.prompt_id = prompt_id or (lambda pos, _inst: str(pos))
        self.seed_index = seed_index or (lambda pos, _inst: pos)
        #: Existing jobs at the broker under this run's ids are its own, resubmitted to be collected, and no
        #: warning says otherwise: set when restarted from a ``state``, or by a caller that knows the run id
        #: names an earlier run of its own (``prorl sample --id-prefix`` after an interrupt).
        self.resuming = state is not None
        self._warned_existing = False
        self._closed = False
        #: A step() under way: a second one at once would take the same step and its stats (two batches of one step).
        self._stepping = False
        #: The highest policy version a step was called with; a resumed sampler starts from its saved groups'.
        self._last_version: int | None = max((c.policy_version for c in state.carried), default=None) if state else None
        #: Set once a result showed that this run's ids name another run's jobs: what every later step() raises.
        self._conflict: str | None = None
        state = state or SamplerState()
        self.step_index = state.step
        self.cursor = state.cursor
        self._restore = list(state.carried)
        #: Prompts (index in ``prompts``) whose last finished group was filtered.
        self._filtered: set[int] = set(state.filtered_prompts)
        self._pending: dict[str, _Pending] = {}
        self._ready: list[Group] = []
        #: The prompt position of each ready group (what ``state()`` needs to resubmit it).
        self._positions: dict[str, int] = {}
        self._job_group: dict[str, str] = {}
        #: Job ids of groups done with (returned, filtered, dropped), forgotten at the start of the next step.
        self._retired: list[str] = []
        self._stream: Any = None  # the client's open-ended ResultStream, from the first step on
        self._stats: StepStats | None = None
        self._open: _OpenStep | None = None
        #: Jobs this sampler cancelled at the broker (early termination, staleness, failed siblings).
        self.cancelled_ids: set[str] = set()
        #: Results that arrived for jobs of groups the sampler had already dropped (never counted).
        self.ignored_results = 0
        #: Called after every result with the running step's stats (progress lines).
        self.on_progress: Callable[[StepStats], None] | None = None
        #: Set to a dict to record what became of every job (job id -> an outcome of
        #: :data:`prorl_cli.training.gpu_ledger.OUTCOMES`; replays account GPU time with it). Off: nothing kept.
        self.job_outcomes: dict[str, str] | None = None
        #: Groups finished (informative or filtered) and informative, over the sampler's life: the informative rate.
        self._finished_groups = 0
        self._informative_groups = 0
        #: Job results that failed in a row (``max_consecutive_failures``), and those failures grouped.
        self._streak = 0
        self._streak_failures = FailureGroups()
        #: Groups submitted from now on (:attr:`_Pending.seq`), and the first one submitted once the failures in a
        #: row began: the run stops only once every group in flight then has ended too (all failed, or the run
        #: would have started over).
        self._next_seq = 0
        self._streak_from = 0
        #: The running step's failed results, grouped, and the reward of each of its filtered groups whose rewards
        #: were all equal: what :class:`StepGroupsExhausted` says of the step.
        self._step_failures = FailureGroups()
        self._filtered_rewards: Counter[float] = Counter()

    def _record(self, job_ids: Sequence[str], outcome: str) -> None:
        if self.job_outcomes is not None:
            for j in job_ids:
                self.job_outcomes[j] = outcome

    # ------------------------------------------------------------ plumbing

    async def _start(self) -> None:
        if self._stream is None:
            # Open-ended: every result this client receives, from now on (it registers at once).
            self._stream = self.client.results()

    async def close(self, *, cancel_in_flight: bool = True) -> None:
        """Stop reading results; cancel what is still in flight unless told not to. A closed sampler takes no
        more steps (its new groups would run unwatched, and nothing would cancel them).

        Before saving :meth:`state` to resume from, close with ``cancel_in_flight=False``: the groups it carries
        then run on at the broker, and the restarted sampler collects them (cancelled ones are run again).

        After its client was closed it can cancel nothing: it closes, and logs a warning naming the jobs it left
        running (close the sampler first, inside the client's ``with`` block)."""
        if getattr(self.client, "closed", False):
            self._close_without_client(cancel_in_flight)
            return
        self._mark_closed()
        if cancel_in_flight and self._pending:
            await self._cancel(list(self._pending.values()), StepStats(self.step_index, 0), "in_flight")
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    def _mark_closed(self) -> None:
        """No more steps; the groups still pending are recorded as left in flight (cancelled or not)."""
        self._closed = True
        for p in self._pending.values():
            self._record(p.job_ids, "in_flight")

    def _close_without_client(self, cancel_in_flight: bool) -> None:
        """Close when the client is gone: nothing to await (a blocking client's event loop is closed too).

        Not an error: raised at the end of a run (a ``with RolloutClient`` block that ended first) it would hide the
        run's own outcome, while the jobs are what matters, and a warning says how to cancel them."""
        self._mark_closed()
        self._stream = None  # the client's close ended it, and took it off the client
        if cancel_in_flight and self._pending:
            log.warning("the client was closed before this sampler: its %d job(s) in flight (%d group(s)) were left "
                        "running at the broker, nothing can cancel them through a closed client; close the sampler "
                        "first (inside the client's with block), or cancel them: prorl cancel --prefix %s-",
                        self.in_flight_jobs, len(self._pending), self.config.run_id)

    def state(self) -> SamplerState:
        """Where to resume from: the next step, the prompt cursor, and the groups not yet returned: those in
        flight and the informative ones finished beyond a step's target (a restarted sampler resubmits their
        ids and the broker answers with the results it holds)."""
        ready = [CarriedGroup(self._positions[g.group_id], g.step, g.policy_version) for g in self._ready]
        return SamplerState(
            step=self.step_index,
            cursor=self.cursor,
            carried=ready + [CarriedGroup(p.position, p.step, p.policy_version) for p in self._pending.values()],
            filtered_prompts=sorted(self._filtered),
        )

    def group_cap(self) -> int | None:
        """Groups that may be in flight with carry-over's cap (None: no cap beyond ``max_in_flight``)."""
        cfg = self.config
        if cfg.mode != "async" or not cfg.carry_over or cfg.carry_window_steps <= 0:
            return None
        # Laplace-smoothed informative rate: one half before any group finished.
        rate = (self._informative_groups + 1) / (self._finished_groups + 2)
        return max(1, math.ceil(cfg.carry_window_steps * cfg.target_groups / rate))

    def _room_for_group(self) -> bool:
        assert self.config.max_in_flight is not None
        if self.in_flight_jobs + self.config.group_size > self.config.max_in_flight:
            return False
        if not self._pending:
            # Nothing in flight: a step short of its target waits for a result, so one must be coming.
            # (A window under one step's worth can be full of ready groups that are still too few.)
            return True
        cap = self.group_cap()
        # Ready groups wait to be taken by a step: they count against the window too.
        return cap is None or self.groups_in_window < cap

    @property
    def groups_in_window(self) -> int:
        """Groups submitted and not yet taken by a step: in flight, or finished informative and waiting."""
        return len(self._pending) + len(self._ready)

    @property
    def in_flight_jobs(self) -> int:
        return sum(self.config.group_size - len(p.results) for p in self._pending.values())

    def job_ids(self, step: int, prompt_id: str) -> list[str]:
        """The deterministic job ids of one group."""
        return [f"{self.config.run_id}-s{step}-p{prompt_id}-k{k}" for k in range(self.config.group_size)]

    async def _submit_group(self, position: int, step: int, version: int) -> None:
        instance = self.prompts[position % len(self.prompts)]
        pid = self.prompt_id(position, instance)
        ids = self.job_ids(step, pid)
        gid = f"{self.config.run_id}-s{step}-p{pid}"
        specs = self.client.make_specs(
            self.task, len(ids), job_ids=ids, timeout_s=self.config.timeout_s,
            sampling=self.config.sampling, max_attempts=self.config.max_attempts,
            seed_from=self.seed_index(position, instance) * self.config.group_size,
        )
        work = _work_digests(self.task, specs, instance)
        _tag(specs, gid, step, version, work)
        pending = _Pending(gid, position, pid, instance, step, version, ids, timebase.now(), seq=self._next_seq,
                           work={j: w for j, w in zip(ids, work, strict=True) if w is not None})
        self._next_seq += 1
        self._pending[gid] = pending
        for j in ids:
            self._job_group[j] = gid
        submitted = await self.client.submit_specs(specs, [instance] * len(ids))
        existing = getattr(submitted, "existing", ())
        pending.existing.update(existing)
        if self._stats is not None:
            self._stats.existing_jobs += len(existing)
        if existing and not self.resuming and not self._warned_existing:
            # The same ids return the broker's earlier jobs and results: a new experiment under an old run_id
            # would train on another run's rollouts (generated by another policy) without a word.
            self._warned_existing = True
            log.warning("job ids of this run already exist at the broker (e.g. %r): their earlier results are "
                        "used, not new rollouts; give each experiment its own SamplerConfig.run_id (now %r; "
                        "prorl sample: --id-prefix), or pass state= to resume a run", existing[0], self.config.run_id)

    def _skips(self, position: int) -> bool:
        """Whether ``skip_filtered_prompts`` passes over the prompt at ``position`` (a draw fixed by the run and
        the position: a resumed run decides the same)."""
        chance = self.config.skip_filtered_prompts
        if chance <= 0 or position % len(self.prompts) not in self._filtered:
            return False
        return random.Random(f"{self.config.run_id}:skip:{position}").random() < chance

    async def _submit_next(self, stats: StepStats) -> None:
        # At most one pass over the prompts: when every one is skippable, the next is tried anyway.
        for _ in range(len(self.prompts)):
            if not self._skips(self.cursor):
                break
            self.cursor += 1
            stats.skipped_prompts += 1
        await self._submit_group(self.cursor, self.step_index, stats.policy_version)
        self.cursor += 1
        stats.submitted_groups += 1

    async def _cancel(self, groups: list[_Pending], stats: StepStats, why: str) -> None:
        """Drop ``groups`` (``why``: an outcome for :attr:`job_outcomes`) and cancel their unfinished jobs."""
        now = timebase.now()
        ids = []
        for p in groups:
            self._record(p.job_ids, why if self.config.cancel_dropped or why == "in_flight" else "abandoned")
            self._pending.pop(p.group_id, None)
            self._retired += self._own(p, p.job_ids)
            left = self._own(p, [j for j in p.job_ids if j not in p.results])
            ids += left
            stats.cancelled_inflight_s += len(left) * (now - p.submitted_at)
        if ids and not self.config.cancel_dropped:
            return
        if ids:
            states = await self.client.cancel(ids)
            # A job that finished just before the cancel reached the broker stays done (its result is ignored).
            gone = [j for j in ids if states.get(j) == "cancelled"]
            self.cancelled_ids.update(gone)
            stats.cancelled_jobs += len(gone)

    # ------------------------------------------------------------ results

    async def _take(self, result: JobResult, stats: StepStats) -> None:
        gid = self._job_group.get(result.job_id)
        pending = self._pending.get(gid) if gid else None
        if pending is None or result.job_id in pending.results:
            if gid is not None:
                self.ignored_results += 1
                if pending is None and result.state != JobState.CANCELLED.value:
                    # A member of a group already dropped (a failed sibling's) that ended before the cancel reached
                    # it still tells whether the task works; one this sampler cancelled tells nothing.
                    self._note_health(result)
            return
        got = result.meta.get("work") if isinstance(result.meta, dict) else None
        expected = pending.work.get(result.job_id)
        if got is not None and expected is not None and got != expected:
            raise self._other_work(pending, result)
        self._note_health(result)
        pending.results[result.job_id] = result
        if not result.ok and self.config.failed == "drop_group":
            stats.failed_groups += 1
            await self._cancel([pending], stats, "failed")
            return
        if len(pending.results) < self.config.group_size:
            return
        del self._pending[pending.group_id]
        ordered = [pending.results[j] for j in pending.job_ids]
        if self.config.failed == "exclude" and not any(r.ok for r in ordered):
            # Nothing left to judge: a failed group, as under drop_group (not a filtered one, which says the prompt
            # stopped teaching, and not handed to ``informative`` with no rewards).
            self._record(pending.job_ids, "failed")
            self._retired += pending.job_ids
            stats.failed_groups += 1
            return
        # The group a trainer gets is the one the filter judged: under ``exclude`` a failed member is left out,
        # under ``zero_reward`` it carries reward 0 (a failed job may hold a partial trajectory and whatever reward
        # its handler set before failing; training on those would judge one group and train on another).
        if self.config.failed == "exclude":
            ordered = [r for r in ordered if r.ok]
        else:  # zero_reward (drop_group never gets here with a failure)
            ordered = [r if r.ok else replace(r, reward=0.0) for r in ordered]
        rewards = [float(r.reward or 0.0) for r in ordered]
        self._record(pending.job_ids, "informative" if self.config.informative(rewards) else "filtered")
        self._finished_groups += 1
        self._informative_groups += bool(self.config.informative(rewards))
        index = pending.position % len(self.prompts)
        if self.config.informative(rewards):
            self._filtered.discard(index)
        else:
            self._filtered.add(index)
        if self.config.informative(rewards):
            # Kept at the broker until a step returns it: a trainer restarted before then gets it back by id.
            self._ready.append(Group(pending.group_id, pending.prompt_id, pending.instance,
                                     pending.step, pending.policy_version, ordered))
            self._positions[pending.group_id] = pending.position
        else:
            self._retired += pending.job_ids
            stats.filtered += 1
            if rewards and len(set(rewards)) == 1:
                self._filtered_rewards[rewards[0]] += 1

    def _other_work(self, pending: _Pending, result: JobResult) -> RunIdTaken:
        """The error for a result of another run's job under one of this run's ids; its group is let go of.

        Its jobs are not this run's to cancel or forget (the other run still needs them), and no later step may go on:
        every id of this run may name that run's jobs.
        """
        self._pending.pop(pending.group_id, None)
        for j in pending.job_ids:
            self._job_group.pop(j, None)
        self._conflict = (
            f"job {result.job_id!r} at the broker holds other work (another task, instance or sampling) than this "
            f"sampler submitted under that id: SamplerConfig.run_id {self.config.run_id!r} names another run's jobs "
            "(one running beside this one, or an earlier one over other prompts), whose results would be trained on "
            "as this run's; give each run its own run_id (a resumed run: the same prompts and sampling as when its "
            "state was saved)")
        return RunIdTaken(self._conflict)

    def _own(self, p: _Pending, ids: Sequence[str]) -> list[str]:
        """Of ``ids`` (of ``p``), those this run may cancel or forget: all, unless the run's ids were found to name
        another run's jobs: then not those the broker already held when ``p`` was submitted."""
        if self._conflict is None:
            return list(ids)
        return [j for j in ids if j not in p.existing]

    def _note_health(self, result: JobResult) -> None:
        """Count ``result`` toward the failures in a row (``max_consecutive_failures``) and the step's failures."""
        if result.ok:
            self._streak = 0
            self._streak_failures.clear()
            return
        if self._streak == 0:
            self._streak_from = self._next_seq
        self._streak += 1
        self._streak_failures.add(result)
        self._step_failures.add(result)

    async def _next_result(self, stats: StepStats, deadline: float | None) -> None:
        timeout = None if deadline is None else max(0.0, deadline - timebase.now())
        try:
            async with asyncio.timeout(timeout):
                result = await anext(self._stream)
        except TimeoutError as e:
            raise self._timed_out(stats) from e
        await self._take(result, stats)
        if self.on_progress is not None:
            stats.informative = len(self._ready)
            stats.in_flight = self.in_flight_jobs
            self.on_progress(stats)
        limit = self.config.failure_limit
        # Not while a job that was in flight when the failures began still runs: refilled at once, a fast-failing
        # job (a broken node, a prompt that fails at INIT) can fail many times while healthy long rollouts run on.
        # _pending keeps submission order (groups are added as submitted), so its first group is the oldest.
        oldest = next(iter(self._pending.values()), None)
        if limit and self._streak >= limit and (oldest is None or oldest.seq >= self._streak_from):
            raise self._failing(stats, limit)

    def _may_submit(self, stats: StepStats, groups: int = 1) -> int:
        """How many of ``groups`` more groups the step may submit under ``max_groups_per_step``."""
        limit = self.config.group_limit
        return groups if not limit else max(0, min(groups, limit - stats.submitted_groups))

    def _failing(self, stats: StepStats, limit: int) -> RolloutsFailing:
        ranked = self._streak_failures.ranked()
        why = ranked[0].describe() if ranked else "no error recorded"
        others = len(ranked) - 1 + (self._streak_failures.other > 0)
        if others > 0:
            rest = self._streak_failures.total - (ranked[0].count if ranked else 0)
            why += f"; {rest} more of {others} other kind(s)"
        return RolloutsFailing(
            f"step {stats.step}: the last {self._streak} job results all failed, none finished between them ({why}); "
            f"SamplerConfig.max_consecutive_failures ({limit}) stops a run that fails every rollout: raise it if "
            f"these failures pass (0: no limit)",
            setting="max_consecutive_failures", limit=limit, step=stats.step, failures=ranked,
            other_failures=self._streak_failures.other,
        )

    def _timed_out(self, stats: StepStats) -> SamplerTimeout:
        cfg = self.config
        limit = cfg.step_timeout_s or 0.0
        ranked = self._step_failures.ranked()
        failed = f", {self._step_failures.total} failed job(s), most: {ranked[0].describe()}" if ranked else ""
        carried = f", {stats.carried_in} carried in" if stats.carried_in else ""
        # Each attempt has the limit; a step called again after a timeout says how long it has run in all.
        attempt = ""
        if stats.attempts > 1 and self._open is not None:
            attempt = f" of attempt {stats.attempts} ({timebase.now() - self._open.started:.1f} s into the step)"
        return SamplerTimeout(
            f"step {stats.step}: {len(self._ready)} of {cfg.target_groups} informative groups within {limit:g} s"
            f"{attempt} ({stats.submitted_groups} groups submitted{carried}, {stats.filtered} filtered, "
            f"{self.in_flight_jobs} job(s) still in flight{failed}); SamplerConfig.step_timeout_s bounds a step's "
            "wall time: raise it for longer rollouts, or leave it unset",
            setting="step_timeout_s", limit=limit, step=stats.step, failures=ranked,
            other_failures=self._step_failures.other,
        )

    def _exhausted(self, stats: StepStats) -> StepGroupsExhausted:
        cfg = self.config
        stats.informative, stats.in_flight = len(self._ready), self.in_flight_jobs
        # Every group the step saw, in one bucket each (nothing is in flight here): the numbers add up to ``tried``.
        tried = stats.carried_in + stats.submitted_groups
        origin = f" ({stats.submitted_groups} submitted, {stats.carried_in} carried in)" if stats.carried_in else ""
        common = self._filtered_rewards.most_common(3)
        # Filtered groups whose rewards were not all one value (a predicate of one's own), or past the three shown.
        other = stats.filtered - sum(n for _, n in common)
        equal = ", ".join([f"{n} all {reward}" for reward, n in common] + ([f"{other} other"] if other and common else []))
        filtered = f"{stats.filtered} filtered" + (f" (rewards {equal})" if equal else "")
        stale = f", {stats.stale_groups} stale (cancelled)" if stats.stale_groups else ""
        failed = f"{stats.failed_groups} failed"
        ranked = self._step_failures.ranked()
        if ranked:
            failed += f" (of {self._step_failures.total} failed job(s), most: {ranked[0].describe()})"
        # One reward value over every group the run finished: the task's reward, not the policy, is the likely cause.
        hint = ""
        if not self._informative_groups and len(self._filtered_rewards) == 1 and stats.filtered:
            hint = f"; no group's rewards ever varied (the task may always reward {next(iter(self._filtered_rewards))})"
        return StepGroupsExhausted(
            f"step {stats.step}: {tried} groups tried{origin}, all finished: {stats.informative} of "
            f"{cfg.target_groups} informative, {filtered}, {failed}{stale}{hint}; SamplerConfig.max_groups_per_step "
            f"({cfg.group_limit}) bounds a step's groups: raise it if informative groups are only rare (0: no limit)",
            setting="max_groups_per_step", limit=cfg.group_limit, step=stats.step, failures=ranked,
            other_failures=self._step_failures.other,
        )

    def _retire_group(self, group: Group) -> None:
        """A ready group is done with (returned, or too stale): forgotten with the next step's retired jobs."""
        self._positions.pop(group.group_id, None)
        self._retired += self.job_ids(group.step, group.prompt_id)

    async def _forget_retired(self) -> None:
        """Drop the results of groups from earlier steps, here and at the broker, so a long run's memory stays flat.

        Only earlier steps: a trainer restarted within a step resubmits that step's ids and needs them.
        """
        ids, self._retired = self._retired, []
        for j in ids:
            self._job_group.pop(j, None)
        if not ids:
            return
        await self.client.forget(ids)

    # ------------------------------------------------------------ steps

    async def step(self, policy_version: int = 0) -> StepBatch:
        """Collect ``target_groups`` informative groups; ``policy_version`` is the trainer's current weights.

        Versions are integers >= 0 that only grow (the trainer's step, or a count of weight syncs): a lower one than
        an earlier step's raises ``ValueError``, since carried groups would look fresher than they are and staleness
        would never cancel them. One step at a time: a call while another is under way raises
        :class:`~prorl_cli.exceptions.ClientMisuse`.
        """
        if self._closed:
            raise SamplerClosed("this sampler was closed: make a new one (state=sampler.state() resumes it)")
        self._check_version(policy_version)
        if self._stepping:
            # It would take the same step: two batches of one step sharing its stats, the step counter moved twice.
            raise ClientMisuse(f"this sampler is already taking step {self.step_index}: a sampler takes one step at a "
                               "time (await that step() before the next)")
        if self._conflict is not None:
            raise RunIdTaken(self._conflict)
        self._last_version = policy_version
        self._stepping = True
        try:
            return await self._step(policy_version)
        finally:
            self._stepping = False

    def _check_version(self, policy_version: Any) -> None:
        """``ValueError`` for a version ``step()`` cannot take."""
        if not isinstance(policy_version, int) or isinstance(policy_version, bool) or policy_version < 0:
            # As the client's sync_weights says it: -1 is the "not reported" mark on tokens (NO_VERSION).
            raise ValueError(f"policy_version must be a non-negative integer, got {policy_version!r}")
        if self._last_version is not None and policy_version < self._last_version:
            raise ValueError(
                f"policy_version {policy_version} is lower than {self._last_version}, an earlier step's (or a "
                "restarted trainer's saved groups'): versions "
                "only grow (a trainer resumed from a checkpoint passes its version on, not 0; weights rolled back "
                "take a new, higher version); below it, carried groups would look fresher than they are and "
                "max_staleness would never cancel them")

    async def _rerun_cancelled(self, stats: StepStats, policy_version: int, deadline: float | None) -> None:
        """Before a restarted trainer's saved groups are resubmitted: forget at the broker the jobs of theirs it holds
        cancelled, so that they run again under the same ids.

        The earlier sampler's ``close()`` cancels what is in flight unless told not to; resubmitted as they are,
        those jobs would come back cancelled and their groups count as failed (and toward the failures in a row),
        though nothing failed. Cancelled by whichever hand, before this sampler started: the run still wants them.
        Done before this sampler's result stream opens, and only once the old results are in: an earlier sampler
        on the same client may still have their pushes on the way, which the stream would take for the new jobs'.
        """
        wanted: set[str] = set()
        for c in self._restore:
            if policy_version - c.policy_version > self.config.max_staleness:
                continue  # cancelled as stale at once: not worth running again
            instance = self.prompts[c.position % len(self.prompts)]
            wanted.update(self.job_ids(c.step, self.prompt_id(c.position, instance)))
        if not wanted:
            return
        cancelled: list[str] = []
        for step in sorted({c.step for c in self._restore}):
            held = await self.client.list_jobs(prefix=f"{self.config.run_id}-s{step}-p")
            cancelled += [j for j, state in held.items() if state == JobState.CANCELLED.value and j in wanted]
        if cancelled:
            timeout = None if deadline is None else max(0.0, deadline - timebase.now())
            try:
                async with asyncio.timeout(timeout):
                    async for _ in self.client.results(cancelled):
                        pass
            except TimeoutError as e:
                raise self._timed_out(stats) from e
            await self.client.forget(cancelled)
            stats.rerun_jobs += len(cancelled)
            log.info("%d job(s) of the saved groups were cancelled at the broker (an earlier close()): run again",
                     len(cancelled))

    async def _step(self, policy_version: int) -> StepBatch:
        cfg = self.config
        run = self._open
        if run is None:
            run = self._open = _OpenStep(StepStats(step=self.step_index, policy_version=policy_version), timebase.now())
        else:
            # The step an earlier call left when it raised: go on with it. Its stats (and so the group bound) count
            # every attempt; each attempt has its own step_timeout_s.
            run.stats.attempts += 1
            run.stats.policy_version = policy_version
        stats = self._stats = run.stats
        deadline = None if cfg.step_timeout_s is None else timebase.now() + cfg.step_timeout_s
        if not run.begun and self._restore and self._stream is None:
            await self._rerun_cancelled(stats, policy_version, deadline)
        await self._start()
        if not run.begun:
            self._step_failures.clear()
            self._filtered_rewards.clear()
            # Once a step, at its start: a retried step's own dropped groups are kept until the next step (a trainer
            # restarted within it resubmits their ids).
            await self._forget_retired()
            for c in self._restore:  # a restarted trainer: the same ids; the broker returns the existing jobs
                await self._submit_group(c.position, c.step, c.policy_version)
            self._restore = []
            # What the step began with, the stale ones among them (dropped below, its stale_groups).
            stats.carried_in = len(self._pending) + len(self._ready)
            run.begun = True
        stale = [p for p in self._pending.values() if policy_version - p.policy_version > cfg.max_staleness]
        stats.stale_groups += len(stale)
        await self._cancel(stale, stats, "stale")
        fresh = [g for g in self._ready if policy_version - g.policy_version <= cfg.max_staleness]
        for g in self._ready:
            if g not in fresh:
                self._record([r.job_id for r in g.results], "stale")
                self._retire_group(g)
        stats.stale_groups += len(self._ready) - len(fresh)
        self._ready = fresh
        if cfg.mode == "async":
            while len(self._ready) < cfg.target_groups:
                while self._may_submit(stats) and self._room_for_group():
                    await self._submit_next(stats)
                if not self._pending:  # the bound is reached and every group it allowed has finished
                    raise self._exhausted(stats)
                await self._next_result(stats, deadline)
            if not cfg.carry_over:
                await self._cancel(list(self._pending.values()), stats, "cancelled")
        else:
            batch = cfg.sync_batch_groups or cfg.target_groups
            while self._pending:  # a restarted trainer's groups first: they may already make the step
                await self._next_result(stats, deadline)
            while len(self._ready) < cfg.target_groups:
                allowed = self._may_submit(stats, batch)  # the last batch under the bound may be a partial one
                if not allowed:
                    raise self._exhausted(stats)
                for _ in range(allowed):
                    await self._submit_next(stats)
                while self._pending:
                    await self._next_result(stats, deadline)
        groups, self._ready = self._ready[: cfg.target_groups], self._ready[cfg.target_groups :]
        for g in groups:
            self._retire_group(g)
        stats.informative = len(groups)
        stats.off_policy_token_fraction = off_policy_fraction([r for g in groups for r in g.results], policy_version)
        stats.carried_out = len(self._pending) + len(self._ready)
        stats.in_flight = self.in_flight_jobs
        stats.wall_s = timebase.now() - run.started
        self._open = None
        self.step_index += 1
        return StepBatch(stats.step, policy_version, groups, stats)


def off_policy_fraction(results: Sequence[JobResult], policy_version: int) -> float:
    """Share of the sampled tokens in ``results`` served under a policy version older than ``policy_version``."""
    stale = total = 0
    for r in results:
        traj = r.output.get("trajectory") if isinstance(r.output, dict) else None
        calls = traj.get("calls") if isinstance(traj, dict) else None
        for call in calls if isinstance(calls, list) else []:
            n = len(call.get("output_ids") or [])
            version = call.get("policy_version")
            if not isinstance(version, int) or isinstance(version, bool):
                continue
            total += n
            stale += n if version < policy_version else 0
    return stale / total if total else 0.0


def _work_digests(task: str, specs: list[JobSpec], instance: Any) -> list[str | None]:
    """Each spec's work (task, sampling, instance: what the broker compares when an id comes again) as a short digest.

    An id the broker already holds returns its job whatever was submitted; the job's meta carries the digest it was
    submitted with, so a result tells this run's job from another run's under the same id. ``None`` where the
    instance cannot be packed (the submit then refuses it, naming it).
    """
    try:
        packed = P.pack_obj(instance)
    except (TypeError, ValueError, OverflowError):
        return [None] * len(specs)
    out: list[str | None] = []
    for s in specs:
        h = hashlib.blake2b(P.pack_obj([task, s.sampling.to_wire() if s.sampling is not None else None]), digest_size=8)
        h.update(packed)
        out.append(h.hexdigest())
    return out


def _tag(specs: list[JobSpec], group_id: str, step: int, version: int, work: Sequence[str | None]) -> None:
    """Put the group, the sampler's step/version and the work's digest on each spec (they come back on each result)."""
    for s, w in zip(specs, work, strict=True):
        s.group_id = group_id
        s.meta = {"step": step, "policy_version": version}
        if w is not None:
            s.meta["work"] = w


class BlockingDapoSampler:
    """:class:`DapoSampler` for blocking code, on a :class:`prorl_cli.client.RolloutClient`'s event loop."""

    def __init__(self, client: Any, task: str, prompts: Sequence[Any], config: SamplerConfig, **kwargs: Any) -> None:
        if isinstance(client, AsyncRolloutClient):
            raise TypeError("BlockingDapoSampler takes a blocking RolloutClient; on an AsyncRolloutClient use "
                            "DapoSampler (await sampler.step())")
        self._client = client
        self._sampler: DapoSampler = client._run(_make(client._aio, task, prompts, config, kwargs))

    @property
    def sampler(self) -> DapoSampler:
        return self._sampler

    def step(self, policy_version: int = 0) -> StepBatch:
        return self._client._run(self._sampler.step(policy_version))

    def state(self) -> SamplerState:
        return self._sampler.state()

    def close(self, *, cancel_in_flight: bool = True) -> None:
        """:meth:`DapoSampler.close`; after the client's own close (its ``with`` block ended first) it cancels
        nothing and warns, naming the jobs left running, instead of raising ``ClientClosed``."""
        if self._client._aio.closed or self._client._loop.is_closed():
            self._sampler._close_without_client(cancel_in_flight)  # the client's event loop is gone: nothing to await
            return
        self._client._run(self._sampler.close(cancel_in_flight=cancel_in_flight))


async def _make(client: AsyncRolloutClient, task: str, prompts: Sequence[Any], config: SamplerConfig, kwargs: dict[str, Any]) -> DapoSampler:
    return DapoSampler(client, task, prompts, config, **kwargs)
