"""The token-exact trajectory record and its JSONL / Parquet export.

A :class:`Trajectory` holds, per model call, the exact prompt ids it was
sampled under, the output ids, their log-probs, the finish reason and the
backend that served it; plus the whole sequence (last prompt + last output)
with a loss mask (1 on model tokens) and aligned log-probs (0.0 off the
mask). ``docs/protocol.md`` ("Trajectories") documents the fields.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli.jsonl import write_jsonl_atomic

TRAJECTORY_FORMAT = "prorl.trajectory/1"


@dataclass
class ModelCall:
    """One generate call as it happened."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    backend_id: str | None = None
    #: Whether ``prompt_ids`` extends the previous call of its conversation (``segment``) token-exactly:
    #: true for the first call of a conversation; false when a harness edited a conversation's history.
    prefix_ok: bool = True
    #: Decoded output, for people and tool parsing; never used to rebuild tokens.
    text: str = ""
    #: The trainer's policy version the broker served this call under (``None``: not reported).
    policy_version: int | None = None
    #: Which token buffer (conversation) the call extends: the gateway keeps one per conversation of a job
    #: (a main agent and its sub-agents), and starts a new one when a harness edits a conversation's history.
    segment: int = 0
    #: The agent that made the call, as the harness named it (the gateway's ``X-Prorl-Agent`` header or
    #: ``/jobs/<token>/agents/<name>/v1`` path); None when unnamed. Trainers can pick agents by it.
    agent: str | None = None
    #: Generations the gateway discarded before this one because they did not honour the request's
    #: ``tool_choice`` (no tool call, or none to the named tool); they are not part of the trajectory.
    tool_choice_retries: int = 0
    #: True when no generation honoured ``tool_choice`` within the gateway's bound: this is the last one.
    tool_choice_unmet: bool = False
    #: True when the request constrained its answer beside tools the model may call (a JSON format with tools),
    #: the gateway's free turn answered outside the constraint, and this turn was sampled again under it (then
    #: ``structured`` is set); the free turn is not part of the trajectory.
    format_retried: bool = False
    #: With ``sampling.top_logprobs = k``: per output id, the ``k`` most likely ``(token id, log-prob)`` pairs
    #: the engine reported (a distillation or KL term needs them); None when not asked or not reported.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: The stop string (``sampling.stop``, or a gateway request's ``stop``) that ended the call: its text ends in
    #: the last output id; None when the call ended otherwise.
    stop_string: str | None = None
    #: The constraint the call was sampled under (``sampling.structured``: a JSON schema, a regex, ...), or None.
    #: Its log-probs are then the masked distribution's (docs/inference.md, "Constrained decoding"): a trainer
    #: that wants the model's own can leave such calls out of the loss.
    structured: dict[str, Any] | None = None


@dataclass
class Trajectory:
    """A multi-turn rollout in tokens. See the module docstring."""

    calls: list[ModelCall] = field(default_factory=list)
    sequence_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: Chat messages as the handler saw them (text; for people, not for training).
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: Token-continuity violations: ``{"call": i, "message": ...}``; never silently fixed.
    violations: list[dict[str, Any]] = field(default_factory=list)
    #: Why the loop stopped: ``stop`` (answer), ``max_turns``, ``length``; or, for a RUN that did not
    #: finish, ``timeout``, ``error`` or ``cancelled`` (the trajectory then holds the calls made so far).
    stop_reason: str | None = None
    #: The error that ended the rollout, ``{"call": i, "type": ..., "message": ...}``: a failed generate call, or
    #: (the ``harness`` task) an agent harness that exited non-zero (``HarnessExited``); ``call`` is the calls before it.
    error: dict[str, Any] | None = None
    model: str | None = None
    format: str = TRAJECTORY_FORMAT

    @property
    def conversations(self) -> int:
        """Token buffers the calls extend (``ModelCall.segment``): above 1 for sub-agents or a history edit,
        where ``sequence_ids``/``loss_mask``/``logprobs`` hold the last one only (the calls hold them all)."""
        return len({c.segment for c in self.calls})

    @property
    def token_exact(self) -> bool:
        """Every call's prompt extends its conversation's previous prompt + output exactly, with no history edit."""
        return not self.violations and all(c.prefix_ok for c in self.calls)

    def to_dict(self) -> dict[str, Any]:
        """A msgpack/JSON-ready dict (what a handler puts in its output)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        data = dict(data)
        calls = [ModelCall(**c) for c in data.pop("calls", [])]
        return cls(calls=calls, **data)


def trajectory_rows(
    records: Iterable[dict[str, Any] | Trajectory], **extra: Any
) -> list[dict[str, Any]]:
    """Flatten trajectories (or dicts holding one under ``trajectory``) into export rows."""
    rows = []
    for rec in records:
        if isinstance(rec, Trajectory):
            row: dict[str, Any] = {"trajectory": rec.to_dict()}
        else:
            row = dict(rec)
            if isinstance(row.get("trajectory"), Trajectory):
                row["trajectory"] = row["trajectory"].to_dict()
        row.update(extra)
        rows.append(row)
    return rows


def write_jsonl(path: str | os.PathLike[str], records: Iterable[dict[str, Any] | Trajectory]) -> Path:
    """One JSON object per line: ``{..., "trajectory": {...}}``. Returns the path."""
    return write_jsonl_atomic(path, trajectory_rows(records), allow_nan=True)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows written by :func:`write_jsonl`, with ``trajectory`` as a :class:`Trajectory`."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if isinstance(row.get("trajectory"), dict):
                row["trajectory"] = Trajectory.from_dict(row["trajectory"])
            rows.append(row)
    return rows


def write_parquet(path: str | os.PathLike[str], records: Iterable[dict[str, Any] | Trajectory]) -> Path:
    """The same rows as Parquet (needs ``pyarrow``: ``pip install prorl[parquet]``).

    Top-level columns: ``job_id``, ``state`` (the job's end state, when the
    rows carry one), ``reward`` (when present), ``sequence_ids`` (int32 list), ``loss_mask`` (int8 list), ``logprobs`` (float32 list),
    ``token_exact``, ``stop_reason``, ``n_calls``, ``conversations`` (token
    buffers: above 1, sub-agents or a history edit, the three lists hold the
    last conversation only; ``samples_from_results`` makes a sample of each)
    and ``trajectory`` (the whole record as JSON text, calls included). Rows that carry a job's
    result fields get their columns too: ``task``, ``node_id``, ``events``,
    ``stage_s``, ``active_s``, ``attempt``, ``group_id``, ``critical_error``,
    ``error``, ``meta`` and ``log_path`` (docs/protocol.md lists their types).
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("Parquet export needs pyarrow: pip install 'prorl[parquet]'") from e
    rows = trajectory_rows(records)
    trajs = [Trajectory.from_dict(r["trajectory"]) for r in rows]
    result_columns = {"active_s": pa.float64(), "attempt": pa.int32(), "group_id": pa.string(),
                      "critical_error": pa.string(), "log_path": pa.string()}
    columns = {"job_id": pa.array([r.get("job_id") for r in rows], pa.string())}
    if any("state" in r for r in rows):
        columns["state"] = pa.array([r.get("state") for r in rows], pa.string())
    table = pa.table(
        {
            **columns,
            "reward": pa.array([r.get("reward") for r in rows], pa.float64()),
            "sequence_ids": pa.array([t.sequence_ids for t in trajs], pa.list_(pa.int32())),
            "loss_mask": pa.array([t.loss_mask for t in trajs], pa.list_(pa.int8())),
            "logprobs": pa.array([t.logprobs for t in trajs], pa.list_(pa.float32())),
            "token_exact": pa.array([t.token_exact for t in trajs], pa.bool_()),
            "stop_reason": pa.array([t.stop_reason for t in trajs], pa.string()),
            "n_calls": pa.array([len(t.calls) for t in trajs], pa.int32()),
            "conversations": pa.array([t.conversations for t in trajs], pa.int32()),
            "trajectory": pa.array([json.dumps(r["trajectory"]) for r in rows], pa.string()),
            # The job's record beside its trajectory, where given (prorl trace/inspect/report read them).
            **{
                name: pa.array([r.get(name) for r in rows], pa.string())
                for name in ("task", "state", "node_id") if any(r.get(name) is not None for r in rows)
            },
            **({"events": pa.array([json.dumps(r["events"]) if r.get("events") is not None else None for r in rows], pa.string())}
               if any(r.get("events") for r in rows) else {}),
            # The rest of a job's result, where the rows carry it (prorl submit/results --out do): a column per
            # field any row has, null in rows without it, so a file's schema does not depend on which jobs failed.
            **{name: pa.array([r.get(name) for r in rows], kind) for name, kind in result_columns.items()
               if any(name in r for r in rows)},
            **{name: pa.array([json.dumps(r[name]) if r.get(name) is not None else None for r in rows], pa.string())
               for name in ("stage_s", "error", "meta") if any(name in r for r in rows)},
        }
    )
    out = Path(path)
    pq.write_table(table, str(out))
    return out
