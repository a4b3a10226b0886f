"""Loading public dataset files (JSONL, Parquet or JSON) into the instances the domain handlers take.

``prorl submit --task NAME FILE [--format F]`` calls :func:`load_instances`.
Shapes understood (``--format auto`` picks by the fields present, and asks
for ``--format`` when a row fits more than one):

- ``math``: DeepScaleR / MATH / AMC rows: ``problem`` (or ``question``) and
  ``answer``, or a ``solution`` whose last ``\\boxed{}`` is the answer.
- ``code``: ``question`` (or ``problem``/``prompt``/``question_content``) with
  hidden tests as ``inputs``/``outputs`` lists (``--format io``), ``test_cases``
  as a list of ``{input, output}`` or ``{inputs, outputs}`` (``test_cases``),
  APPS/TACO ``input_output`` JSON (``apps``), or LiveCodeBench
  ``public_test_cases``/``private_test_cases`` JSON (``livecodebench``).
- ``swe``: SWE-bench (full, Lite, Verified), SWE-Gym, SWE-smith, SWE-rebench,
  nebius SWE-bench-extra and swebench task rows, each with its own field
  names, mapped to the swe instance by :mod:`prorl_cli.swe.sources`
  (``--format`` names the source where ``auto`` should not guess). Fields
  prorl cannot use are kept and reported once per dataset (``warn``).
- ``search``: ``question`` with ``answers``, ``answer`` or ``golden_answers``.

Any other task: each row is passed through unchanged. Errors name the file,
the line (JSONL) or row (Parquet) and the missing field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prorl_cli.domains.answers import last_boxed
from prorl_cli.exceptions import DatasetError
from prorl_cli.jsonl import jsonl_values
from prorl_cli.swe.sources import SOURCES, SweRows

log = logging.getLogger(__name__)
Row = dict[str, Any]
FORMATS: dict[str, tuple[str, ...]] = {
    "math": ("auto",),
    "code": ("auto", "io", "test_cases", "apps", "livecodebench"),
    "swe": ("auto", *SOURCES),
    "search": ("auto",),
}


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of a JSONL, Parquet or JSON file.

    ``where`` is ``FILE:LINE`` for JSONL, ``FILE row N`` for Parquet and
    ``FILE item N`` for JSON (1-based). A ``.json`` file holds one array of
    rows or one row; a file of another name that is not JSONL but one JSON
    document (a pretty-printed instance) is read the same way.
    """
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install 'prorl[parquet]')") from e
        import pyarrow as pa

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(f"{path}: not a readable Parquet file: {e}") from e
        for i, row in enumerate(rows, 1):
            yield f"{path} row {i}", row
        return
    if path.suffix == ".json":
        yield from _json_rows(path)
        return
    read_one = False
    try:
        for lineno, row in jsonl_values(path, DatasetError):
            read_one = True
            yield f"{path}:{lineno}", row
    except DatasetError as e:
        # The first line is not JSON: the file may be one (pretty-printed) JSON document instead.
        document = None if read_one or not isinstance(e.__cause__, json.JSONDecodeError) else _whole_document(path)
        if document is None:
            raise
        yield from _items(path, document)


def _whole_document(path: Path) -> Any:
    """The file as one JSON document, or None when it is not one."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (a .json dataset is one array of rows or one row)") from e
    yield from _items(path, document)


def _items(path: Path, document: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(document, list):
        for i, row in enumerate(document, 1):
            yield f"{path} item {i}", row
    else:
        yield f"{path} item 1", document


def _first(row: Row, where: str, names: tuple[str, ...], what: str) -> Any:
    for name in names:
        if row.get(name) not in (None, ""):
            return row[name]
    raise DatasetError(f"{where}: missing field {names[0]!r} ({what}; also accepted: {list(names[1:]) or 'none'})")


def _json_field(value: Any, where: str, name: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: field {name!r} is a string but not JSON: {e.msg}") from e
    return value


def _keep(row: Row, out: Row) -> Row:
    for key in ("id", "settings", "tokenizer"):
        if key in row:
            out[key] = row[key]
    return out


def _math(row: Row, where: str, fmt: str) -> Row:
    problem = _first(row, where, ("problem", "question"), "the problem text")
    if row.get("answer") not in (None, ""):
        answer = str(row["answer"])
    elif isinstance(row.get("solution"), str):
        boxed = last_boxed(row["solution"])
        if boxed is None:
            raise DatasetError(f"{where}: missing field 'answer', and 'solution' has no \\boxed{{}} answer")
        answer = boxed
    else:
        raise DatasetError(f"{where}: missing field 'answer' (or a 'solution' with a \\boxed{{}} answer)")
    return _keep(row, {"problem": str(problem), "answer": answer})


def _pairs(inputs: Any, outputs: Any, where: str, names: str) -> list[Row]:
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise DatasetError(f"{where}: {names} must be two lists of the same length")
    return [{"input": str(i), "output": str(o)} for i, o in zip(inputs, outputs, strict=True)]


def _tests_from(row: Row, where: str, fmt: str) -> list[Row]:
    shapes = {
        "io": "inputs" in row and "outputs" in row,
        "test_cases": "test_cases" in row,
        "apps": "input_output" in row,
        "livecodebench": "public_test_cases" in row or "private_test_cases" in row,
    }
    if fmt == "auto":
        found = [k for k, ok in shapes.items() if ok]
        if not found:
            raise DatasetError(f"{where}: missing field 'tests' (hidden tests as inputs/outputs, test_cases, "
                               "input_output or public_test_cases/private_test_cases)")
        if len(found) > 1:
            raise DatasetError(f"{where}: the row has tests in several shapes {found}; pick one with --format")
        fmt = found[0]
    elif not shapes[fmt]:
        raise DatasetError(f"{where}: --format {fmt}: missing its test field(s)")
    if fmt == "io":
        return _pairs(row["inputs"], row["outputs"], where, "inputs/outputs")
    if fmt == "apps":
        io = _json_field(row["input_output"], where, "input_output")
        if not isinstance(io, dict):
            raise DatasetError(f"{where}: input_output must hold {{inputs, outputs}}")
        return _pairs(io.get("inputs"), io.get("outputs"), where, "input_output.inputs/outputs")
    if fmt == "test_cases":
        cases = _json_field(row["test_cases"], where, "test_cases")
        if isinstance(cases, dict):
            return _pairs(cases.get("inputs"), cases.get("outputs"), where, "test_cases.inputs/outputs")
        if isinstance(cases, list) and all(isinstance(c, dict) and "input" in c and "output" in c for c in cases):
            return [{"input": str(c["input"]), "output": str(c["output"])} for c in cases]
        raise DatasetError(f"{where}: test_cases must be a list of {{input, output}} or {{inputs, outputs}}")
    tests: list[Row] = []
    for name in ("public_test_cases", "private_test_cases"):
        cases = _json_field(row.get(name) or "[]", where, name)
        if not isinstance(cases, list):
            raise DatasetError(f"{where}: {name} must be a JSON list of {{input, output}}")
        for i, c in enumerate(cases):
            if not isinstance(c, dict) or "input" not in c or "output" not in c:
                raise DatasetError(f"{where}: {name}[{i}]: missing field 'input' or 'output'")
            if c.get("testtype", "stdin") == "stdin":
                tests.append({"input": str(c["input"]), "output": str(c["output"])})
    return tests


def _code(row: Row, where: str, fmt: str) -> Row:
    question = _first(row, where, ("question", "problem", "prompt", "question_content"), "the problem statement")
    tests = row["tests"] if fmt == "auto" and isinstance(row.get("tests"), list) else _tests_from(row, where, fmt)
    if not tests:
        raise DatasetError(f"{where}: the row has no stdin/stdout tests")
    return _keep(row, {"question": str(question), "tests": tests})


def _swe(row: Row, where: str, fmt: str) -> Row:
    """One SWE row on its own (:func:`load_instances` maps a whole file and reports what it could not use)."""
    return SweRows(fmt).map(row, where)


def _search(row: Row, where: str, fmt: str) -> Row:
    question = _first(row, where, ("question", "query"), "the question")
    answers = _first(row, where, ("answers", "golden_answers", "answer"), "the gold answer(s)")
    answers = _json_field(answers, where, "answers") if isinstance(answers, str) and answers.startswith("[") else answers
    if isinstance(answers, str):
        answers = [answers]
    if isinstance(answers, dict) and isinstance(answers.get("text"), list):  # SQuAD-style {text: [...]}
        answers = answers["text"]
    if not isinstance(answers, list) or not answers:
        raise DatasetError(f"{where}: answers must be a string or a non-empty list of strings")
    return _keep(row, {"question": str(question), "answers": [str(a) for a in answers]})


LOADERS: dict[str, Callable[[Row, str, str], Row]] = {"math": _math, "code": _code, "swe": _swe, "search": _search}


def load_instances(task: str, path: str | Path, fmt: str | None = None,
                   warn: Callable[[str], None] | None = None) -> list[Any]:
    """The instances of ``path`` for ``task``; a :class:`DatasetError` names file, line/row and field.

    ``warn`` gets one line per field the rows carry and prorl cannot use (``swe``: once per dataset,
    naming the field and the source); by default it is logged as a warning.
    """
    file = Path(path)
    fmt = fmt or "auto"
    loader = LOADERS.get(task)
    if loader is not None and fmt not in FORMATS[task]:
        raise DatasetError(f"--format {fmt!r} does not apply to task {task!r}; choose from {list(FORMATS[task])}")
    if loader is None and fmt != "auto":
        raise DatasetError(f"--format applies to the domain tasks {sorted(LOADERS)}, not to {task!r}")
    swe = SweRows(fmt) if task == "swe" else None
    instances: list[Any] = []
    for where, row in read_rows(file):
        if loader is None:
            instances.append(row)
            continue
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
        instances.append(swe.map(row, where) if swe is not None else loader(row, where, fmt))
    for line in swe.report() if swe is not None else []:
        (warn or log.warning)(f"{file}: {line}")
    return instances


def shipped_dataset(task: str) -> Path:
    """The small dataset shipped for ``task`` (``handlers/data/<task>.jsonl``)."""
    from prorl_cli.resources import data_dir

    path = data_dir("handlers") / "data" / f"{task}.jsonl"
    if not path.is_file():
        raise DatasetError(f"no shipped dataset for task {task!r} ({path})")
    return path
