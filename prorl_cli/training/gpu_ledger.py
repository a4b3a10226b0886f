"""Where a sampler's GPU time went: the simulated engines' call ledgers joined with the sampler's job outcomes.

The simulated engine (``inference.sim_ledger_dir``) writes one ledger per
backend: every call with its job id, its share of the engine's busy GPU
seconds, and its prompt tokens found in the prefix cache. A
:class:`~prorl_cli.training.sampler.DapoSampler` with ``job_outcomes`` on
records what became of each job it submitted. :func:`breakdown` joins the
two: busy GPU seconds per outcome (they add up to the engines' ``busy_s``),
and the prefill tokens computed again because a job's earlier context was
no longer cached on the backend its next call went to, split by why (the
prefix was evicted there, or the call went to another backend).

Every figure here is counted on the engines' own step clocks (the latency
model's GPU seconds), not the wall clock, so it does not move with the load
of the machine running the replay; only idle time does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import LedgerError

#: What became of a job (``DapoSampler.job_outcomes`` values), in the order reports list them.
OUTCOMES = (
    "informative",   # its group was informative (returned by a step, or ready for the next)
    "filtered",      # its group finished with no reward variance (DAPO's filter dropped it)
    "failed",        # its group was dropped because a member failed
    "cancelled",     # early termination: still running when its step met the target
    "stale",         # cancelled (or dropped when ready) for lagging more than max_staleness versions
    "abandoned",     # dropped but left running (cancel_dropped off); its results ignored
    "in_flight",     # still running when the replay ended
    "unknown",       # a call the sampler did not submit (or one with no job id)
)


@dataclass
class Breakdown:
    """GPU seconds and prefill recomputation of one replay (all in simulated GPU time)."""

    busy_s: float
    #: Busy GPU seconds per outcome of the job that spent them; they add up to ``busy_s``.
    gpu_s: dict[str, float] = field(default_factory=dict)
    #: Jobs per outcome, and for cancelled/stale ones the calls and GPU seconds they got before the end.
    jobs: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: Prefill tokens computed again: the job's earlier context was not cached where its call went.
    recomputed_tokens: dict[str, int] = field(default_factory=lambda: {"evicted": 0, "moved": 0})
    #: Calls that went to another backend than the job's previous call.
    moved_calls: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def fraction(self, outcome: str) -> float:
        return self.gpu_s.get(outcome, 0.0) / self.busy_s if self.busy_s else 0.0


#: What :func:`breakdown` and :func:`idle_gpu_s` read of a ledger, and of each of its calls: key -> types.
_LEDGER_FIELDS: dict[str, tuple[type, ...]] = {
    "backend_id": (str, type(None)), "busy_s": (int, float), "speedup": (int, float), "idle_spans": (list,),
    "calls": (list,),
}
_CALL_FIELDS: dict[str, tuple[type, ...]] = {
    "job_id": (str, type(None)), "submitted_at": (int, float), "gpu_s": (int, float), "prompt_tokens": (int,),
    "cached_tokens": (int,), "output_tokens": (int,),
}


def load_ledgers(folder: Path) -> list[dict[str, Any]]:
    """Every ``*.json`` ledger in ``folder`` (one per simulated backend), each checked for the fields the
    breakdown reads; a file that is not such a ledger raises :class:`LedgerError` naming it and the field."""
    docs = []
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LedgerError(f"ledger {path}: not a readable JSON document: {e}") from e
        _check_fields(doc, _LEDGER_FIELDS, f"ledger {path}")
        for i, call in enumerate(doc["calls"]):
            _check_fields(call, _CALL_FIELDS, f"ledger {path}: calls[{i}]")
        docs.append(doc)
    return docs


def _check_fields(value: Any, fields: Mapping[str, tuple[type, ...]], where: str) -> None:
    if not isinstance(value, dict):
        raise LedgerError(f"{where}: expected a JSON object, got {type(value).__name__}")
    for key, types in fields.items():
        if key not in value:
            raise LedgerError(f"{where}: missing field {key!r}")
        if not isinstance(value[key], types) or isinstance(value[key], bool):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise LedgerError(f"{where}: field {key!r} must be {names}, got {value[key]!r:.80}")


def breakdown(ledgers: Iterable[Mapping[str, Any]], outcomes: Mapping[str, str], *, block_tokens: int = 16) -> Breakdown:
    """Join the engines' ``ledgers`` with ``outcomes`` (job id -> one of :data:`OUTCOMES`)."""
    ledgers = list(ledgers)
    out = Breakdown(busy_s=sum(float(led["busy_s"]) for led in ledgers))
    by_job: dict[str | None, list[tuple[str, Mapping[str, Any]]]] = {}
    for led in ledgers:
        for call in led["calls"]:
            by_job.setdefault(call["job_id"], []).append((str(led["backend_id"]), call))
    for job_id, calls in by_job.items():
        outcome = outcomes.get(job_id, "unknown") if job_id is not None else "unknown"
        if outcome not in OUTCOMES:
            raise LedgerError(f"job {job_id}: unknown outcome {outcome!r} (expected one of {OUTCOMES})")
        out.jobs[outcome] = out.jobs.get(outcome, 0) + 1
        out.calls[outcome] = out.calls.get(outcome, 0) + len(calls)
        calls.sort(key=lambda bc: bc[1]["submitted_at"])
        prev: tuple[str, Mapping[str, Any]] | None = None
        for backend, call in calls:
            out.gpu_s[outcome] = out.gpu_s.get(outcome, 0.0) + float(call["gpu_s"])
            out.prompt_tokens += int(call["prompt_tokens"])
            out.cached_tokens += int(call["cached_tokens"])
            if prev is not None:
                pb, pc = prev
                # The previous call's prompt and output were in KV on its backend (full blocks only).
                held = min(int(pc["prompt_tokens"]) + int(pc["output_tokens"]), int(call["prompt_tokens"]) - 1)
                lost = max(0, held // block_tokens * block_tokens - int(call["cached_tokens"]))
                why = "evicted" if pb == backend else "moved"
                out.recomputed_tokens[why] += lost
                out.moved_calls += pb != backend
            prev = (backend, call)
    return out


def idle_gpu_s(ledgers: Iterable[Mapping[str, Any]], start: float, end: float) -> float:
    """GPU seconds the engines sat idle (nothing running or waiting) between wall times ``start`` and ``end``."""
    total = 0.0
    for led in ledgers:
        speedup = float(led["speedup"])
        for a, b in led["idle_spans"]:
            total += max(0.0, min(b, end) - max(a, start)) * speedup
    return total
