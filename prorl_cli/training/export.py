"""Training samples as JSONL or Parquet, with the field names veRL and NeMo-RL read.

One row per :class:`~prorl_cli.training.samples.TrainingSample`. Per-token
columns are aligned with ``input_ids`` (prompt and response together, no
padding); ``docs/training.md`` maps every column to veRL's ``DataProto``
and NeMo-RL's ``BatchedDataDict`` and shows how to load an export into each.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prorl_cli.jsonl import jsonl_objects, write_jsonl_atomic
from prorl_cli.training.samples import SampleError, TrainingSample

EXPORT_FORMAT = "prorl.samples/1"

#: Column -> (pyarrow type name, meaning). The schema of both formats; a test keeps docs/training.md in step.
COLUMNS: dict[str, tuple[str, str]] = {
    "rollout_id": ("string", "the rollout (job) this sample came from"),
    "group_id": ("string", "the prompt group (GRPO group) of the rollout"),
    "job_id": ("string", "the prorl job id"),
    "reward": ("float64", "the rollout's reward"),
    "advantage": ("float64", "the sample's scalar advantage"),
    "prompt_length": ("int32", "ids before the first sampled token"),
    "input_ids": ("list<int32>", "prompt + response ids (veRL input_ids, NeMo-RL input_ids)"),
    "attention_mask": ("list<int8>", "1 on every id (veRL attention_mask)"),
    "response_mask": ("list<int8>", "1 on sampled ids (veRL response_mask)"),
    "loss_mask": ("list<int8>", "same as response_mask (veRL's older name)"),
    "token_mask": ("list<int8>", "same as response_mask (NeMo-RL token_mask)"),
    "old_log_probs": ("list<float32>", "sampling log-probs, 0 off the mask (veRL old_log_probs)"),
    "prev_logprobs": ("list<float32>", "same as old_log_probs (NeMo-RL prev_logprobs)"),
    "generation_logprobs": ("list<float32>", "same as old_log_probs (NeMo-RL generation_logprobs)"),
    "advantages": ("list<float32>", "advantage on sampled ids, 0 elsewhere (veRL / NeMo-RL advantages)"),
    "token_level_scores": ("list<float32>", "reward on the last sampled id, 0 elsewhere (veRL token_level_scores)"),
    "loss_weights": ("list<float32>", "per-token loss weight of the chosen normalisation"),
    "policy_versions": ("list<int32>", "policy version each sampled id was served under, -1 elsewhere"),
    "input_lengths": ("int32", "len(input_ids) (NeMo-RL input_lengths)"),
    "sample_mask": ("float32", "1.0 (NeMo-RL sample_mask)"),
}


def _check_finite(s: TrainingSample) -> None:
    """Raise :class:`SampleError` naming the rollout, column and token at the first NaN or infinity.

    JSON cannot hold one and Parquet would store it silently; either way a trainer would get NaN or an
    infinite importance ratio in its loss. The engines report log-probs of the unmodified distribution
    (:class:`~prorl_cli.inference.contract.Generation`), so a sampled token never has -inf legitimately,
    and NaN is a log-prob the server did not return.
    """
    for name, value in (("reward", s.reward), ("advantage", s.advantage)):
        if not math.isfinite(value):
            raise SampleError(f"sample of rollout {s.rollout_id!r}: {name} is {value!r}, not a finite number")
    for name, values in (("old_log_probs", s.old_log_probs), ("loss_weights", s.loss_weights)):
        for i, v in enumerate(values):
            if not math.isfinite(v):
                raise SampleError(f"sample of rollout {s.rollout_id!r}: {name}[{i}] is {v!r}, not a finite number "
                                  "(JSON cannot hold it and a trainer's loss would be NaN or infinite)")


def sample_row(s: TrainingSample) -> dict[str, Any]:
    """The export row of one sample (plain Python values).

    Raises :class:`~prorl_cli.training.samples.SampleError` naming the rollout when a per-token list is not
    as long as ``input_ids``: such a row would be written with columns that do not line up, and a trainer
    would read every token after the gap against the wrong log-prob, mask or version. Also when the sample's
    ``loss_weights`` were never assigned (:func:`~prorl_cli.training.samples.assign_loss_weights`), and when
    a reward, advantage, log-prob or loss weight is not finite (see :func:`_check_finite`).
    """
    if not isinstance(s, TrainingSample):
        raise TypeError(f"a TrainingSample to export, got {type(s).__name__} {s!r:.60}: {_ORDER}")
    s.check_aligned()
    if s.input_ids and not s.loss_weights:
        # Written as zeros, the column would train on nothing without a word: build_samples leaves it empty.
        raise SampleError(f"sample of rollout {s.rollout_id!r} has no loss_weights: call assign_loss_weights "
                          "(or build the samples with samples_from_results) before exporting")
    _check_finite(s)
    mask = list(s.response_mask)
    last = max((i for i, m in enumerate(mask) if m), default=-1)
    scores = [0.0] * len(mask)
    if last >= 0:
        scores[last] = s.reward
    return {
        "rollout_id": s.rollout_id,
        "group_id": s.group_id,
        "job_id": s.job_id,
        "reward": s.reward,
        "advantage": s.advantage,
        "prompt_length": s.prompt_length,
        "input_ids": list(s.input_ids),
        "attention_mask": [1] * len(s.input_ids),
        "response_mask": mask,
        "loss_mask": mask,
        "token_mask": mask,
        "old_log_probs": list(s.old_log_probs),
        "prev_logprobs": list(s.old_log_probs),
        "generation_logprobs": list(s.old_log_probs),
        "advantages": [s.advantage * m for m in mask],
        "token_level_scores": scores,
        "loss_weights": list(s.loss_weights),
        "policy_versions": list(s.policy_versions),
        "input_lengths": len(s.input_ids),
        "sample_mask": 1.0,
    }


#: How the writers are called: said when they are called otherwise.
_ORDER = "the writers take (path, samples), e.g. write_samples_parquet('samples.parquet', built.samples)"


def _out_path(path: object) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: a file name, got {type(path).__name__}: {_ORDER}")
    return Path(path)


def write_samples_jsonl(path: str | os.PathLike[str], samples: Iterable[TrainingSample]) -> Path:
    """One JSON object per sample (the columns of :data:`COLUMNS`); written atomically."""
    return write_jsonl_atomic(_out_path(path), (sample_row(s) for s in samples))


def read_samples_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of :func:`write_samples_jsonl`; a line that is not a JSON object raises :class:`SampleError`
    naming the file and the line (and a last line cut off mid-write as such)."""
    return [row for _, row in jsonl_objects(Path(path), SampleError, expected="a sample's export columns")]


def arrow_schema() -> Any:
    """The Parquet schema (pyarrow) of :data:`COLUMNS`."""
    import pyarrow as pa

    scalar = {"string": pa.string(), "float64": pa.float64(), "float32": pa.float32(), "int32": pa.int32(), "int8": pa.int8()}

    def typ(name: str) -> Any:
        if name.startswith("list<"):
            return pa.list_(scalar[name[5:-1]])
        return scalar[name]

    return pa.schema([(k, typ(t)) for k, (t, _) in COLUMNS.items()], metadata={"format": EXPORT_FORMAT})


def write_samples_parquet(path: str | os.PathLike[str], samples: Iterable[TrainingSample]) -> Path:
    """The same rows as Parquet (needs pyarrow: ``pip install 'prorl[parquet]'``); written atomically, as the JSONL."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("Parquet export needs pyarrow: pip install 'prorl[parquet]'") from e
    out = _out_path(path)
    rows = [sample_row(s) for s in samples]
    schema = arrow_schema()
    table = pa.Table.from_pylist(rows, schema=schema) if rows else schema.empty_table()
    # Into a temp file beside it first: a write cut short (a full disk, Ctrl-C) must not leave a truncated
    # Parquet file where the last good export was.
    tmp = out.with_name(out.name + ".tmp")
    try:
        pq.write_table(table, str(tmp))
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
