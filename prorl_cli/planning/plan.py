"""A capacity plan: one simulation per candidate of jobs in flight, and the recommended one.

The figures per candidate (:class:`Prediction`) are in simulated seconds of
compute; informative groups per GPU-hour are rollouts/s times the chance that
a group is informative (:meth:`Workload.p_informative`), over the group size,
per GPU the plan holds. The recommendation rule is :data:`RULE`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prorl_cli.inference.sim_engine import SimProfile
from prorl_cli.planning.simulator import ClusterShape, SimResult, simulate
from prorl_cli.planning.workload import PlanError, Workload

#: Within this share of the best informative groups per GPU-hour, fewer jobs in flight win.
TOLERANCE = 0.05
#: A candidate is simulated for at least this many rollouts per rollout it keeps running: the first quarter
#: is warm-up (all of them start at once), and the measured rest must see each slot turn over a few times.
#: With fewer, the window ends with the first burst and counts its quickest rollouts only (a rate many times
#: what a saturated GPU can do).
STEADY_ROLLOUTS_PER_SLOT = 8
#: Candidates above this many rollouts running at once are refused: far past any cluster's slots, and
#: simulated at a cost that grows with the number.
MAX_RUNNING = 20_000
RULE = ("the smallest in_flight within 5% of the best informative groups per GPU-hour "
        "(fewer jobs in flight: less off-policy lag, less KV pressure)")
#: The rule when no group of the workload is ever informative (every rollout got the same reward).
RULE_NO_SIGNAL = ("the smallest in_flight within 5% of the best rollouts/s: no group of this workload is informative "
                  "(every reward the same), so a DAPO sampler's filter would keep none; mix in easier or harder "
                  "tasks, or a stronger model, before planning for groups")


@dataclass(frozen=True)
class Prediction:
    """What one sampler setting (jobs in flight) delivers on the cluster shape."""

    in_flight: int
    rollouts_per_s: float
    informative_groups_per_gpu_hour: float
    gpu_busy_share: float
    mean_rollout_s: float
    prefix_hit_rate: float
    #: Rollouts measured (after warm-up) and the simulated seconds they took.
    measured_rollouts: int
    window_s: float
    #: Rollouts simulated, warm-up included (``rollouts``, or more for a steady state: :func:`steady_rollouts`).
    simulated_rollouts: int = 0


@dataclass(frozen=True)
class Plan:
    """The sweep over ``in_flight`` and the recommended setting, with what it was computed from."""

    workload: str
    workload_rollouts: int
    mean_calls_per_rollout: float
    profile: str
    cluster: ClusterShape
    group_size: int
    p_informative: float
    rollouts: int
    seed: int
    sweep: tuple[Prediction, ...]
    recommended: Prediction
    rule: str = RULE
    #: What the figures cannot show by themselves (:func:`plan_notes`): candidates the slots cap, a
    #: recommendation at the sweep's edge, results recorded faster than the profile runs.
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``prorl plan --json``)."""
        return dataclasses.asdict(self)


def informative(sweep: Sequence[Prediction]) -> bool:
    """Whether any candidate of ``sweep`` yields informative groups (else :data:`RULE_NO_SIGNAL` applies)."""
    return any(p.informative_groups_per_gpu_hour > 0 for p in sweep)


def recommend(sweep: Sequence[Prediction]) -> Prediction:
    """:data:`RULE` applied to ``sweep``; :data:`RULE_NO_SIGNAL` (the same by rollouts/s) when no group is
    ever informative."""
    if not sweep:
        raise PlanError("no in_flight candidate to recommend from")
    by_groups = informative(sweep)

    def value(p: Prediction) -> float:
        return p.informative_groups_per_gpu_hour if by_groups else p.rollouts_per_s

    best = max(value(p) for p in sweep)
    return min((p for p in sweep if value(p) >= best * (1 - TOLERANCE)), key=lambda p: p.in_flight)


def make_plan(
    workload: Workload, profile: SimProfile, cluster: ClusterShape, *, group_size: int, in_flight: Sequence[int],
    rollouts: int, seed: int = 0,
) -> Plan:
    """Simulate each ``in_flight`` candidate for ``rollouts`` rollouts and recommend one."""
    cluster.validate()
    if not isinstance(group_size, int) or group_size < 2:
        raise PlanError(f"group size must be at least 2, got {group_size!r}")
    candidates = sorted(set(in_flight))
    if not candidates or candidates[0] < 1:
        raise PlanError(f"in_flight candidates must be positive integers, got {list(in_flight)!r}")
    slots = cluster.nodes * cluster.slots if cluster.slots is not None else None
    running = {n: min(n, slots) if slots is not None else n for n in candidates}
    too_many = [n for n in candidates if running[n] > MAX_RUNNING]
    if too_many:
        raise PlanError(f"in_flight {too_many}: more than {MAX_RUNNING} rollouts running at once is beyond what the "
                        "planner simulates (give --slots, or smaller candidates)")
    p_inf = workload.p_informative(group_size)
    sweep = tuple(_prediction(simulate(workload, profile, cluster, n, steady_rollouts(rollouts, running[n]), seed), p_inf,
                              group_size, cluster, steady_rollouts(rollouts, running[n]))
                  for n in candidates)
    best = recommend(sweep)
    return Plan(
        workload=workload.source, workload_rollouts=len(workload.shapes), mean_calls_per_rollout=workload.mean_calls,
        profile=profile.name, cluster=cluster, group_size=group_size, p_informative=p_inf, rollouts=rollouts,
        seed=seed, sweep=sweep, recommended=best, rule=RULE if informative(sweep) else RULE_NO_SIGNAL,
        notes=plan_notes(workload, profile, slots, sweep, best),
    )


#: Results whose calls took less than this share of the least time the profile needs for them were recorded on a
#: faster clock (a sim engine's speedup) or a faster server than the profile; a busy engine only adds time.
FAST_RECORDING_SHARE = 0.5


def plan_notes(workload: Workload, profile: SimProfile, slots: int | None, sweep: Sequence[Prediction],
               best: Prediction) -> tuple[str, ...]:
    """What a reader of the sweep needs to know that its figures do not say:

    - candidates above ``--nodes`` x ``--slots`` run that many at once, so their rows repeat the capped one;
    - a recommendation at the largest candidate (not capped by slots) may be short of the best: the sweep did
      not reach the point where more in flight stops paying;
    - results left out (not ``done``, or no generate call) by reason: the figures do not count their cost;
    - rollouts whose calls overlapped (sub-agents): replayed one call after another, slower than they ran;
    - results whose calls took less than :data:`FAST_RECORDING_SHARE` of the least time the profile needs for
      them (decoding alone, one sequence) were recorded on a faster clock: their tool gaps are short by the
      same factor unless ``--time-scale`` says so.
    """
    notes: list[str] = []
    capped = [p.in_flight for p in sweep if slots is not None and p.in_flight > slots]
    if capped:
        notes.append(f"in flight {capped} exceed the {slots} rollout slots (--nodes x --slots): they run {slots} at "
                     f"once, so they deliver what {slots} in flight would")
    largest = sweep[-1]
    if len(sweep) > 1 and best.in_flight == largest.in_flight and largest.in_flight not in capped:
        notes.append(f"the recommendation is the largest candidate tried ({largest.in_flight}): more in flight may "
                     "deliver more; add larger --in-flight candidates to find where it stops paying")
    if workload.skipped_by:
        counts = ", ".join(f"{reason} {n}" for reason, n in workload.skipped_by)
        notes.append(f"{workload.source}: {workload.skipped} of {workload.skipped + len(workload.shapes)} results "
                     f"left out ({counts}): the figures replay the {len(workload.shapes)} finished rollouts only, so "
                     "they leave out the GPU and slot time that rollouts which fail, time out or are cancelled take "
                     "in a run like this one")
    overlapping = [s for s in workload.shapes if s.overlapping_calls]
    if overlapping:
        notes.append(f"{workload.source}: {len(overlapping)} of {len(workload.shapes)} rollouts made generate calls "
                     "while another of theirs ran (sub-agents, parallel requests): the simulation replays each "
                     "rollout's calls one after another, so its rollout seconds are long and its rollouts/s short "
                     "for such rollouts")
    recorded = [(c, s) for shape in workload.shapes if len(shape.call_s) == len(shape.calls)
                for c, s in zip(shape.calls, shape.call_s, strict=True)]
    if recorded:
        measured_s = sum(s for _, s in recorded) * workload.time_scale
        least_s = sum(profile.decode_steps_s(1, c.prompt_tokens, max(0, c.output_tokens - 1)) for c, _ in recorded)
        if least_s > 0 and measured_s < FAST_RECORDING_SHARE * least_s:
            factor = least_s / measured_s if measured_s > 0 else math.inf
            scaled = f" (times --time-scale {workload.time_scale:g})" if workload.time_scale != 1 else ""
            notes.append(f"{workload.source}: its generate calls took {measured_s:.3g} s in all{scaled}, "
                         f"{factor:.3g} times less than the {least_s:.3g} s the {profile.name} profile needs for them "
                         "even one at a time: they were recorded on a faster clock (a sim engine's speedup: pass it as "
                         "--time-scale, so their tool gaps count in GPU seconds) or on a faster server than the "
                         "profile (calibrate one: docs/inference.md)")
    return tuple(notes)


def steady_rollouts(rollouts: int, running: int) -> int:
    """Rollouts to simulate for a candidate keeping ``running`` rollouts going: ``rollouts``, raised to reach a
    steady state (:data:`STEADY_ROLLOUTS_PER_SLOT`)."""
    return max(rollouts, STEADY_ROLLOUTS_PER_SLOT * running)


def _prediction(r: SimResult, p_informative: float, group_size: int, cluster: ClusterShape, simulated: int) -> Prediction:
    return Prediction(
        in_flight=r.in_flight, rollouts_per_s=r.rollouts_per_s,
        informative_groups_per_gpu_hour=r.rollouts_per_s * p_informative / group_size * 3600.0 / cluster.gpus,
        gpu_busy_share=r.gpu_busy_share, mean_rollout_s=r.mean_rollout_s, prefix_hit_rate=r.prefix_hit_rate,
        measured_rollouts=r.rollouts, window_s=r.window_s, simulated_rollouts=simulated,
    )
