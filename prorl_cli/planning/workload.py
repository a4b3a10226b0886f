"""The workload a capacity plan runs: rollout shapes, from a results file or from a description.

A rollout's *shape* is what the GPU and the sampler see of it: its generate
calls in order (prompt and output tokens of each), the time between one
call's end and the next call's start (tool and agent time), the time before
its first call and after its last one (sandbox start, grading), and its
reward. Two sources:

* a results JSONL as ``prorl submit --out``, ``prorl sample --out`` and
  ``prorl results --out`` write it (one ``JobResult`` per line), or their
  Parquet (which holds only the jobs with a token-level trajectory): the
  shapes come from each finished job's timeline (``events``: ``generate``
  spans with their ``prompt``/``output`` token counts);
* a description with the fields (and meaning) of a ``sim_agent`` instance
  (``prorl_cli/testing/handlers/sim_agent.py``): ``turns``, ``prompt_tokens``,
  ``output_tokens``/``observation_tokens``/``tool_s`` as ``{median, sigma,
  max}``, ``action_delay_s``, ``p_solve``; drawn with a seeded generator,
  the next prompt being the whole context so far as sim_agent's is.

Errors name the file, the line and the field (:class:`PlanError`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prorl_cli import yamlfiles
from prorl_cli.exceptions import PlanError
from prorl_cli.jsonl import jsonl_objects


@dataclass(frozen=True)
class Call:
    """One generate call of a rollout: the tokens it sends and the tokens it gets back."""

    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class RolloutShape:
    """What one rollout asks of the cluster, in the order it asks it."""

    calls: tuple[Call, ...]
    #: Seconds between call i's end and call i+1's start (tool and agent time); one fewer than ``calls``.
    gaps_s: tuple[float, ...]
    #: Seconds in its slot before the first call (sandbox start, init) and after the last one (grading).
    lead_s: float = 0.0
    tail_s: float = 0.0
    reward: float | None = None
    group_id: str | None = None
    #: Seconds each call took as recorded (results only; on the recording's clock, not scaled): what
    #: :func:`prorl_cli.planning.plan.make_plan` compares with the profile to tell a faster recording.
    call_s: tuple[float, ...] = ()
    #: Calls that started before the one before them ended (sub-agents, parallel requests through a
    #: gateway): the simulation replays a rollout's calls one after another (results only).
    overlapping_calls: int = 0


@dataclass
class Workload:
    """Rollout shapes and the chance that a group of them is informative (rewards not all equal)."""

    source: str
    shapes: list[RolloutShape]
    #: Per prompt, its probability of success (a description's ``p_solve``), when known.
    p_solve: tuple[float, ...] = ()
    #: Rollouts of the results file skipped (not done, no generate call), for the report.
    skipped: int = 0
    #: Why they were skipped: the count per reason (a state other than ``done``, or ``done without generate
    #: events``), in the order first met; what :func:`prorl_cli.planning.plan.plan_notes` reports.
    skipped_by: tuple[tuple[str, int], ...] = ()
    #: A description's fields that steer a live replay only (``time_scale``, ``seed``, ...): read, not used.
    ignored: tuple[str, ...] = ()
    #: The ``time_scale`` results were read with (their clock ran this many times faster than the workload's).
    time_scale: float = 1.0

    def p_informative(self, group_size: int) -> float:
        """The probability that a group of ``group_size`` rollouts is informative.

        From a description: the mean over its prompts of ``1 - p**n - (1-p)**n``. From results with
        groups (``group_id``) of exactly ``group_size`` rollouts: the measured share of informative ones
        among those groups. Otherwise, per group (or, without groups, for the whole file), the chance
        that ``n`` rewards drawn from its rewards are not all equal, ``1 - sum(share_v**n)`` over its
        distinct reward values ``v`` (for 0/1 rewards, ``1 - p**n - (1-p)**n`` with ``p`` the success
        rate), averaged over groups. Any reward scale counts: -1/1 as 0/1, and a group whose rewards
        are all 0.5 is not informative.
        """
        n = group_size

        def formula(p: float) -> float:
            p = min(1.0, max(0.0, p))
            return 1.0 - p ** n - (1.0 - p) ** n

        def mixed(rewards: list[float]) -> float:
            shares: dict[float, int] = {}
            for r in rewards:
                shares[r] = shares.get(r, 0) + 1
            return 1.0 - sum((k / len(rewards)) ** n for k in shares.values())

        if self.p_solve:
            return sum(formula(p) for p in self.p_solve) / len(self.p_solve)
        groups: dict[str, list[float]] = {}
        for s in self.shapes:
            if s.reward is not None and s.group_id is not None:
                groups.setdefault(s.group_id, []).append(s.reward)
        full = [g for g in groups.values() if len(g) >= 2]
        exact = [g for g in full if len(g) == n]  # a run's last, partial groups aside
        if exact:
            return sum(len(set(g)) > 1 for g in exact) / len(exact)
        if full:
            return sum(mixed(g) for g in full) / len(full)
        rewards = [s.reward for s in self.shapes if s.reward is not None]
        return mixed(rewards) if rewards else 0.0

    @property
    def mean_calls(self) -> float:
        return sum(len(s.calls) for s in self.shapes) / len(self.shapes)

    # ------------------------------------------------------------------ results files

    @classmethod
    def from_results(cls, path: str | Path, time_scale: float = 1.0) -> Workload:
        """The shapes of the finished rollouts in a results JSONL or Parquet (``state: done``, one generate call or more).

        ``time_scale``: the results were recorded on a clock that ran this many times faster than the
        workload's (a sim replay's ``speedup``); the tool gaps and lead/tail times are multiplied by it.
        """
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"{p}: no such results file")
        if not time_scale > 0:
            raise PlanError(f"time scale must be positive, got {time_scale}")
        shapes: list[RolloutShape] = []
        skipped: dict[str, int] = {}
        for where, row in _result_rows(p):
            shape = _shape_of_result(row, where, time_scale)
            if shape is None:
                state = row.get("state", "done")
                reason = "done without generate events" if state == "done" else str(state)
                skipped[reason] = skipped.get(reason, 0) + 1
            else:
                shapes.append(shape)
        if not shapes:
            if not skipped:
                raise PlanError(f"{p}: no results in the file (it is empty)")
            raise PlanError(f"{p}: no finished rollout with generate events (state 'done' and a timeline) "
                            f"among {sum(skipped.values())} result(s): {_counts(skipped)}")
        return cls(str(p), shapes, skipped=sum(skipped.values()), skipped_by=tuple(skipped.items()),
                   time_scale=time_scale)

    # ------------------------------------------------------------------ descriptions

    @classmethod
    def from_file(cls, path: str | Path, count: int, seed: int = 0) -> Workload:
        """A description in YAML (or JSON), ``count`` shapes drawn from it with ``seed``."""
        p = Path(path)
        try:
            data = yamlfiles.load(p.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise PlanError(f"{p}: no such workload file") from e
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise PlanError(f"{p}: not a readable YAML workload description: {e}") from e
        return cls.from_description(data, count, seed, where=str(p))

    @classmethod
    def from_description(cls, desc: Any, count: int, seed: int = 0, where: str = "workload") -> Workload:
        """``count`` shapes drawn from a sim_agent-style description (a map; see the module docstring)."""
        spec = _Description.parse(desc, where)
        if count < 1:
            raise PlanError(f"{where}: need at least one rollout, got {count}")
        rng = random.Random(seed)
        shapes = [spec.draw(rng) for _ in range(count)]
        ignored = tuple(sorted(set(map(str, desc)) & _REPLAY_ONLY))
        return cls(f"{where} (seed {seed})", shapes, p_solve=spec.p_solve, ignored=ignored)


def _counts(counts: Mapping[str, int]) -> str:
    """``failed 3, timed_out 1``."""
    return ", ".join(f"{reason} {n}" for reason, n in counts.items())


def _result_rows(p: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(where, result fields)`` of each job in a results file, ``where`` naming its line (JSONL) or row (Parquet)."""
    if p.suffix != ".parquet":
        for lineno, row in jsonl_objects(p, PlanError, expected="a job's result (prorl results --out)"):
            yield f"{p}:{lineno}", row
        return
    # The Parquet columns (events as JSON text, state, reward, group_id) decoded as prorl report reads them.
    from prorl_cli.observe.results import ResultsFileError, load_results

    try:
        results = load_results(p)
    except ResultsFileError as e:
        raise PlanError(str(e)) from e
    for i, result in enumerate(results):
        yield f"{p} row {i}", result.to_wire()


def _shape_of_result(row: Mapping[str, Any], where: str, time_scale: float) -> RolloutShape | None:
    """A finished job's shape from its timeline; ``None`` for a job that did not end done or made no call."""
    if row.get("state", "done") != "done":
        return None
    events = row.get("events")
    if events is None:
        return None
    if not isinstance(events, list):
        raise PlanError(f"{where}: events must be a list of [name, t_s, dur_s, attrs], got {type(events).__name__}")
    spans: list[tuple[float, float, int, int]] = []  # (start, end, prompt, output) of each generate
    stages: list[tuple[float, float]] = []
    for i, ev in enumerate(events):
        if (not isinstance(ev, list) or len(ev) < 3 or not isinstance(ev[0], str)
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in ev[1:3])):
            raise PlanError(f"{where}: events[{i}] is not [name, t_s, dur_s, attrs]: {ev!r:.80}")
        name, t, dur = ev[0], float(ev[1]), float(ev[2])
        attrs = ev[3] if len(ev) > 3 and isinstance(ev[3], dict) else {}
        if name == "generate" and attrs.get("ok", True) is not False:  # a failed call has no output: skipped
            prompt, output = attrs.get("prompt"), attrs.get("output")
            for key, value in (("prompt", prompt), ("output", output)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise PlanError(f"{where}: events[{i}] (generate) needs a token count attrs.{key}, got {value!r}")
            assert isinstance(prompt, int) and isinstance(output, int)
            if prompt > 0:
                spans.append((t, t + dur, prompt, max(1, output)))
        elif name == "stage":
            stages.append((t, t + dur))
    if not spans:
        return None
    spans.sort()
    calls = tuple(Call(p, o) for _, _, p, o in spans)
    gaps = tuple(max(0.0, b[0] - a[1]) * time_scale for a, b in zip(spans, spans[1:], strict=False))
    lead = max(0.0, spans[0][0] - min(s for s, _ in stages)) * time_scale if stages else 0.0
    tail = max(0.0, max(e for _, e in stages) - spans[-1][1]) * time_scale if stages else 0.0
    reward = row.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise PlanError(f"{where}: reward must be a number or null, got {reward!r}")
    group = row.get("group_id")
    overlapping = sum(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))
    return RolloutShape(calls, gaps, lead, tail, None if reward is None else float(reward),
                        group if isinstance(group, str) else None, tuple(max(0.0, e - s) for s, e, _, _ in spans),
                        overlapping)


@dataclass(frozen=True)
class _LogNormal:
    median: float
    sigma: float
    max: float

    def draw(self, rng: random.Random) -> float:
        # As sim_agent's _lognormal: median * exp(sigma * N(0, 1)), capped at max.
        return min(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)), self.max)


#: sim_agent keys that steer a live replay only (seeding by job id, the replay's clock): accepted, not used.
_REPLAY_ONLY = frozenset({"seed", "rollout_seed", "draws_by_prompt", "time_scale", "absorb_hops"})
_KNOWN = frozenset({"turns", "prompt_tokens", "output_tokens", "observation_tokens", "tool_s", "action_delay_s",
                    "p_solve"}) | _REPLAY_ONLY


@dataclass(frozen=True)
class _Description:
    turns: tuple[int, int]
    prompt_tokens: int
    output_tokens: _LogNormal
    observation_tokens: _LogNormal
    tool_s: _LogNormal
    action_delay_s: float
    p_solve: tuple[float, ...]

    @classmethod
    def parse(cls, desc: Any, where: str) -> _Description:
        if not isinstance(desc, dict):
            raise PlanError(f"{where}: a workload description is a map of sim_agent fields, got {type(desc).__name__}")
        unknown = sorted(set(map(str, desc)) - _KNOWN)
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {unknown} (known: {sorted(_KNOWN - _REPLAY_ONLY)}; a replay's "
                            f"{sorted(_REPLAY_ONLY)} are read and not used)")
        raw_turns = desc.get("turns", [10, 40])
        turns = (raw_turns, raw_turns) if isinstance(raw_turns, int) else raw_turns
        if (not isinstance(turns, (list, tuple)) or len(turns) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in turns) or not 1 <= turns[0] <= turns[1]):
            raise PlanError(f"{where}: turns must be a positive integer or [low, high] with 1 <= low <= high, got {raw_turns!r}")
        p_solve = desc.get("p_solve", 0.5)
        ps = p_solve if isinstance(p_solve, list) else [p_solve]
        if not ps or not all(_number(p) and 0 <= p <= 1 for p in ps):
            raise PlanError(f"{where}: p_solve must be a probability in [0, 1] (or a list of them, one per prompt), "
                            f"got {p_solve!r}")
        return cls(
            turns=(int(turns[0]), int(turns[1])),
            prompt_tokens=int(_positive(desc.get("prompt_tokens", 2000), f"{where}: prompt_tokens", integer=True)),
            output_tokens=_lognormal(desc.get("output_tokens", {}), 150, f"{where}: output_tokens"),
            observation_tokens=_lognormal(desc.get("observation_tokens", {}), 500, f"{where}: observation_tokens"),
            tool_s=_lognormal(desc.get("tool_s", {}), 1.0, f"{where}: tool_s", zero_ok=True),
            action_delay_s=_positive(desc.get("action_delay_s", 0.0), f"{where}: action_delay_s", zero_ok=True),
            p_solve=tuple(float(p) for p in ps),
        )

    def draw(self, rng: random.Random) -> RolloutShape:
        """One rollout, as sim_agent plays it: output, tool wait, observation per turn; the context grows."""
        n_turns = rng.randint(*self.turns)
        prompt = self.prompt_tokens
        calls: list[Call] = []
        gaps: list[float] = []
        for turn in range(n_turns):
            output = max(1, int(self.output_tokens.draw(rng)))
            calls.append(Call(prompt, output))
            if turn == n_turns - 1:
                break
            gaps.append(self.tool_s.draw(rng) + self.action_delay_s)
            observation = max(1, int(self.observation_tokens.draw(rng)))
            prompt += output + observation
        p = self.p_solve[rng.randrange(len(self.p_solve))]
        return RolloutShape(tuple(calls), tuple(gaps), reward=1.0 if rng.random() < p else 0.0)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x: Any, what: str, *, zero_ok: bool = False, integer: bool = False) -> float:
    ok = _number(x) and (x >= 0 if zero_ok else x > 0) and (not integer or isinstance(x, int))
    if not ok:
        kind = "an integer" if integer else "a number"
        raise PlanError(f"{what} must be {kind} {'>= 0' if zero_ok else '> 0'}, got {x!r}")
    return float(x)


def _lognormal(spec: Any, default_median: float, what: str, *, zero_ok: bool = False) -> _LogNormal:
    if not isinstance(spec, dict):
        raise PlanError(f"{what} must be a map {{median, sigma, max}}, got {spec!r}")
    unknown = sorted(set(map(str, spec)) - {"median", "sigma", "max"})
    if unknown:
        raise PlanError(f"{what}: unknown key(s) {unknown} (known: median, sigma, max)")
    return _LogNormal(
        median=_positive(spec.get("median", default_median), f"{what}.median", zero_ok=zero_ok),
        sigma=_positive(spec.get("sigma", 1.0), f"{what}.sigma", zero_ok=True),
        max=_positive(spec.get("max", math.inf), f"{what}.max") if spec.get("max") is not None else math.inf,
    )
