"""Read a run's results back: the JSONL of ``prorl submit --out`` (one JobResult per line) or its Parquet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import ProrlError
from prorl_cli.jsonl import is_parquet, jsonl_objects
from prorl_cli.protocol import JobResult

_RESULT_FIELDS = frozenset(JobResult.__dataclass_fields__)
#: Fields that take their default when a file holds null for them (JobResult never holds None there).
_NOT_NULL_FIELDS = frozenset({"task", "state", "attempt", "stage_s", "active_s"})


class ResultsFileError(ProrlError, ValueError):
    """A results file that cannot be read; the message names the file and the line or column."""


def _from_row(row: dict[str, Any], where: str) -> JobResult:
    if not isinstance(row.get("job_id"), str):
        raise ResultsFileError(f"{where}: no 'job_id' string; is this a results file (prorl submit --out)?")
    # A Parquet column holds null in the rows written without its field (write_parquet of mixed rows):
    # such a field takes its default, as when a file has no such column at all.
    fields = {k: v for k, v in row.items() if k in _RESULT_FIELDS and not (v is None and k in _NOT_NULL_FIELDS)}
    if "trajectory" in row and "output" not in row:
        # A trajectories file (Parquet, or rows of write_jsonl): the trajectory is the output.
        traj = row["trajectory"]
        fields["output"] = {"trajectory": _json_field(traj, "trajectory", where) if isinstance(traj, str) else traj}
    fields.setdefault("task", "")
    fields.setdefault("state", "done")
    for name in ("events", "error", "meta", "stage_s"):
        if isinstance(fields.get(name), str):
            fields[name] = _json_field(fields[name], name, where)
    return JobResult(**fields)


def _json_field(text: str, name: str, where: str) -> Any:
    """A field a file holds as JSON text (Parquet's columns), decoded; :class:`ResultsFileError` naming it if not JSON."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise ResultsFileError(f"{where}: field {name!r} is not JSON ({e})") from e


def load_results(path: str | Path) -> list[JobResult]:
    """The results in ``path`` (JSON lines, or Parquet: by its name in any case, or its magic bytes), in file order."""
    p = Path(path)
    if not p.is_file():
        raise ResultsFileError(f"{p}: no such file")
    if is_parquet(p):
        return _load_parquet(p)
    return [_from_row(row, f"{p}:{lineno}") for lineno, row in jsonl_objects(p, ResultsFileError)]


def _load_parquet(p: Path) -> list[JobResult]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ResultsFileError("reading Parquet needs pyarrow: pip install 'prorl[parquet]'") from e
    try:
        rows = pq.read_table(str(p)).to_pylist()
    except Exception as e:  # pyarrow raises its own types for files that are not Parquet
        raise ResultsFileError(f"{p}: not a readable Parquet file: {e}") from e
    return [_from_row(row, f"{p} row {i}") for i, row in enumerate(rows)]
