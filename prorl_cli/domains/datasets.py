"""Loading public dataset files (JSONL, Parquet or JSON) into the instances the domain handlers take.

``prorl submit --task NAME FILE [--format F]`` calls :func:`load_instances`.
Shapes understood (``--format auto`` picks by the fields present, and asks
for ``--format`` when a row fits more than one):

- ``math``: DeepScaleR / MATH / AMC / AIME / GSM8K rows: ``problem`` (or
  ``question``, or capitalised) and ``answer`` (GSM8K's worked solution: the number after
  ``####``), or a ``solution`` whose last ``\\boxed{}`` is the answer;
  verl-style rows (DAPO-Math-17k, verl's GSM8K): the last user message of
  ``prompt`` (their "Answer:" / "####" instructions removed: the math task
  reads a ``\\boxed{}`` answer) and ``reward_model.ground_truth``.
- ``code``: ``question`` (or ``problem``/``prompt``/``question_content``/
  ``description``) with hidden tests as ``inputs``/``outputs`` lists
  (``--format io``), ``test_cases`` as a list of ``{input, output}`` or
  ``{inputs, outputs}`` (``test_cases``), APPS/TACO ``input_output`` JSON
  (``apps``; a test given as a list of lines is those lines joined; rows of
  function-call tests, ``fn_name``, are refused), LiveCodeBench
  ``public_test_cases``/``private_test_cases`` as JSON or as
  ``code_generation_lite`` compresses them (``livecodebench``; stdin tests),
  CodeContests ``public_tests``/``private_tests``/``generated_tests``
  (``codecontests``), or verl-style rows (Eurus-2-RL-Data): a chat ``prompt``
  and ``reward_model.ground_truth`` holding ``{inputs, outputs}`` (``verl``).
  ``tests`` may be a list or JSON text of one (DeepCoder).
- ``swe``: SWE-bench (full, Lite, Verified), SWE-Gym, SWE-smith, SWE-rebench,
  nebius SWE-bench-extra and swebench task rows, each with its own field
  names, mapped to the swe instance by :mod:`prorl_cli.swe.sources`
  (``--format`` names the source where ``auto`` should not guess). Fields
  prorl cannot use are kept and reported once per dataset (``warn``).
- ``search``: ``question`` with ``answers``, ``answer`` or ``golden_answers``
  (a string, a list, SQuAD's ``{text: [...]}`` or TriviaQA's
  ``{value, aliases}``), plus MuSiQue's ``answer_aliases``.

Any other task: each row is passed through unchanged. Errors name the file,
the line (JSONL) or row (Parquet) and the missing field.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import pickle
import zlib
from collections.abc import Callable, Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

from prorl_cli.domains.answers import gsm8k_final, last_boxed
from prorl_cli.exceptions import DatasetError
from prorl_cli.jsonl import jsonl_values
from prorl_cli.swe.sources import SOURCES, SweRows

log = logging.getLogger(__name__)
Row = dict[str, Any]
# CodeContests' test groups, in the order they are judged (max_tests keeps the first ones).
_CODECONTESTS_TESTS = ("public_tests", "private_tests", "generated_tests")
FORMATS: dict[str, tuple[str, ...]] = {
    "math": ("auto",),
    "code": ("auto", "io", "test_cases", "apps", "livecodebench", "codecontests", "verl"),
    "swe": ("auto", *SOURCES),
    "search": ("auto",),
}


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of a JSONL, Parquet or JSON file.

    ``where`` is ``FILE:LINE`` for JSONL, ``FILE row N`` for Parquet and
    ``FILE item N`` for JSON (1-based). Files are read as their publishers
    write them: Parquet by its magic bytes whatever the file's name; a
    ``.json`` file holds one array of rows, one row, a table as pandas'
    ``to_json`` writes it (any orient), or JSON Lines (as many Hub datasets
    name them); a file of another name that is not JSONL but one JSON
    document (a pretty-printed instance) is read the same way; a UTF-8 byte
    order mark is skipped.
    """
    if _is_parquet(path):
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
    if path.suffix.lower() == ".json":
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


_PARQUET_MAGIC = b"PAR1"


def _is_parquet(path: Path) -> bool:
    """A Parquet file: by its name (any case), or by the magic bytes it starts with (``.pq``, no suffix)."""
    if path.suffix.lower() in (".parquet", ".pq"):
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == _PARQUET_MAGIC
    except OSError:
        return False  # the text reader names the problem


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not a UTF-8 text file: {e.reason} at byte {e.start}") from e


def _whole_document(path: Path) -> Any:
    """The file as one JSON document, or None when it is not one."""
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError:
        return None


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        document = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one JSON value per line: JSON Lines under a .json name
            for lineno, row in jsonl_values(path, DatasetError):
                yield f"{path}:{lineno}", row
            return
        raise DatasetError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (a .json dataset is one array of rows, "
                           "one row, a pandas to_json table, or one row per line)") from e
    yield from _items(path, document)


def _items(path: Path, document: Any) -> Iterator[tuple[str, Any]]:
    rows = _pandas_rows(document)
    if rows is None:
        rows = document if isinstance(document, list) else [document]
    for i, row in enumerate(rows, 1):
        yield f"{path} item {i}", row


def _index_labels(keys: Any) -> bool:
    return bool(keys) and all(isinstance(k, str) and k.lstrip("-").isdigit() for k in keys)


def _pandas_rows(document: Any) -> list[Any] | None:
    """The rows of a table as pandas' ``DataFrame.to_json`` writes it, or None for any other document.

    Orients: ``columns`` (pandas' default: ``{column: {index: value}}``), ``index`` (``{index: {column:
    value}}``), ``split`` (``{"columns": [...], "data": [[...]]}``), ``table`` (``{"schema": ..., "data":
    [{...}]}``); ``records`` is already a list of rows. A row is never mistaken for a table: ``columns`` and
    ``index`` need every value a mapping keyed by row numbers, or every key a row number.
    """
    if not isinstance(document, dict) or not document:
        return None
    keys = set(document)
    if keys in ({"columns", "data"}, {"columns", "index", "data"}) and isinstance(document["columns"], list) \
            and isinstance(document["data"], list) and all(isinstance(r, list) for r in document["data"]):
        names = document["columns"]
        return [dict(zip(names, values, strict=False)) for values in document["data"]]
    if keys == {"schema", "data"} and isinstance(document["schema"], dict) and isinstance(document["data"], list):
        index = document["schema"].get("primaryKey")  # pandas' index, not a column of the data
        drop = set(index) if isinstance(index, list) and all(isinstance(k, str) for k in index) else set()
        return [{k: v for k, v in r.items() if k not in drop} if isinstance(r, dict) else r for r in document["data"]]
    values = list(document.values())
    if not all(isinstance(v, dict) for v in values):
        return None
    if _index_labels(keys):  # orient "index": one row per key
        return values
    labels = list(values[0])
    if _index_labels(labels) and all(list(v) == labels for v in values):  # orient "columns"
        return [{column: document[column][label] for column in document} for label in labels]
    return None


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


# DAPO-Math-17k wraps each problem in an instruction to end with "Answer: ...", which the math task (it
# reads the last \\boxed{}) does not score: the loader keeps the problem only.
_DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
                "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
_DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
# verl's GSM8K preprocessing asks for the answer after "####" the same way.
_VERL_GSM8K_SUFFIX = 'Let\'s think step by step and output the final answer after "####".'


def _chat_problem(row: Row) -> str | None:
    """The last user message of a chat-style ``prompt`` (verl/DAPO rows), DAPO's answer-format wrapper removed."""
    messages = row.get("prompt")
    if not isinstance(messages, list):
        return None
    users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        return None
    text = users[-1]
    if text.startswith(_DAPO_PREFIX) and text.endswith(_DAPO_SUFFIX):
        text = text[len(_DAPO_PREFIX): -len(_DAPO_SUFFIX)]
    elif text.endswith(_VERL_GSM8K_SUFFIX):
        text = text[: -len(_VERL_GSM8K_SUFFIX)]
    return text.strip()


def _ground_truth(row: Row) -> str | None:
    """verl's ``reward_model.ground_truth`` (a string, or a list holding one)."""
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if isinstance(truth, list) and len(truth) == 1:
        truth = truth[0]
    return None if truth in (None, "") or isinstance(truth, list | dict) else str(truth)


def _present(row: Row, names: tuple[str, ...]) -> Any:
    """The first of ``names`` the row has a value for, else ``None``."""
    return next((row[name] for name in names if row.get(name) not in (None, "")), None)


def _type_name(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def _math(row: Row, where: str, fmt: str) -> Row:
    # AIME sets (AIME_2024 and the like) capitalise their fields.
    problem = _present(row, ("problem", "question", "Problem", "Question")) or _chat_problem(row)
    if problem is None:
        raise DatasetError(f"{where}: missing field 'problem' (the problem text; also accepted: 'question', "
                           "'Problem', 'Question', a chat 'prompt')")
    # A value that is not text would reach the model as its Python repr and be scored against one: refused.
    if not isinstance(problem, str):
        raise DatasetError(f"{where}: field 'problem' is {_type_name(problem)}, expected the problem text")
    if not problem.strip():
        raise DatasetError(f"{where}: field 'problem' is blank")
    given, solution, truth = _present(row, ("answer", "Answer")), _present(row, ("solution", "Solution")), _ground_truth(row)
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, str | int | float):
            raise DatasetError(f"{where}: field 'answer' is {_type_name(given)}, expected the answer as text or a number")
        answer = gsm8k_final(str(given))  # GSM8K: a worked solution whose final line is "#### 72"
        if not answer.strip():
            what = "has nothing after its '####'" if "####" in str(given) else "is blank"
            raise DatasetError(f"{where}: field 'answer' {what}: no answer to score against")
    elif truth is not None:
        answer = truth
    elif isinstance(solution, str):
        boxed = last_boxed(solution)
        if boxed is None:
            raise DatasetError(f"{where}: missing field 'answer', and 'solution' has no \\boxed{{}} answer")
        answer = boxed
    else:
        raise DatasetError(f"{where}: missing field 'answer' (or a 'solution' with a \\boxed{{}} answer)")
    return _keep(row, {"problem": str(problem), "answer": answer})


def _stdio_text(value: Any) -> str:
    """One test's stdin or stdout: APPS/TACO give some as a list of lines, which their own judge joins."""
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    return str(value)


def _pairs(inputs: Any, outputs: Any, where: str, names: str) -> list[Row]:
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise DatasetError(f"{where}: {names} must be two lists of the same length")
    return [{"input": _stdio_text(i), "output": _stdio_text(o)} for i, o in zip(inputs, outputs, strict=True)]


def _tests_from(row: Row, where: str, fmt: str) -> list[Row]:
    shapes = {
        "io": "inputs" in row and "outputs" in row,
        "test_cases": "test_cases" in row,
        "apps": "input_output" in row,
        "livecodebench": "public_test_cases" in row or "private_test_cases" in row,
        "codecontests": any(name in row for name in _CODECONTESTS_TESTS),
        "verl": isinstance(row.get("reward_model"), dict) and "ground_truth" in row["reward_model"],
    }
    if fmt == "auto":
        found = [k for k, ok in shapes.items() if ok]
        if not found:
            raise DatasetError(f"{where}: missing field 'tests' (hidden tests as inputs/outputs, test_cases, "
                               "input_output, public_test_cases/private_test_cases, public_tests/private_tests "
                               "or reward_model.ground_truth)")
        if len(found) > 1:
            raise DatasetError(f"{where}: the row has tests in several shapes {found}; pick one with --format")
        fmt = found[0]
    elif not shapes[fmt]:
        raise DatasetError(f"{where}: --format {fmt}: missing its test field(s)")
    if fmt == "io":
        return _pairs(row["inputs"], row["outputs"], where, "inputs/outputs")
    if fmt == "apps":
        if row["input_output"] in (None, ""):  # APPS ships some rows without tests
            raise DatasetError(f"{where}: input_output is empty: the row has no tests")
        return _io_pairs(_json_field(row["input_output"], where, "input_output"), where, "input_output")
    if fmt == "verl":
        truth = _json_field(row["reward_model"]["ground_truth"], where, "reward_model.ground_truth")
        return _io_pairs(truth, where, "reward_model.ground_truth")
    if fmt == "test_cases":
        cases = _json_field(row["test_cases"], where, "test_cases")
        if isinstance(cases, dict):
            return _pairs(cases.get("inputs"), cases.get("outputs"), where, "test_cases.inputs/outputs")
        if isinstance(cases, list) and all(isinstance(c, dict) and "input" in c and "output" in c for c in cases):
            return [{"input": _stdio_text(c["input"]), "output": _stdio_text(c["output"])} for c in cases]
        raise DatasetError(f"{where}: test_cases must be a list of {{input, output}} or {{inputs, outputs}}")
    if fmt == "codecontests":
        return _codecontests_tests(row, where)
    tests: list[Row] = []
    for name in ("public_test_cases", "private_test_cases"):
        cases = _livecodebench_cases(row.get(name) or "[]", where, name)
        if not isinstance(cases, list):
            raise DatasetError(f"{where}: {name} must be a JSON list of {{input, output}}")
        for i, c in enumerate(cases):
            if not isinstance(c, dict) or "input" not in c or "output" not in c:
                raise DatasetError(f"{where}: {name}[{i}]: missing field 'input' or 'output'")
            if c.get("testtype", "stdin") == "stdin":
                tests.append({"input": str(c["input"]), "output": str(c["output"])})
    return tests


def _io_pairs(io: Any, where: str, name: str) -> list[Row]:
    """APPS/TACO-style ``{inputs, outputs}`` (also verl's code ``ground_truth``) as stdin/stdout tests."""
    if not isinstance(io, dict):
        raise DatasetError(f"{where}: {name} must hold {{inputs, outputs}}")
    if io.get("fn_name"):
        # Its inputs are argument lists and its outputs return values: fed to stdin, no program passes.
        raise DatasetError(f"{where}: {name} has function-call tests (fn_name {io['fn_name']!r}); the code "
                           "task judges stdin/stdout programs only: leave such rows out")
    return _pairs(io.get("inputs"), io.get("outputs"), where, f"{name}.inputs/outputs")


def _json_tests(value: Any, where: str) -> list[Row]:
    """``tests`` given as JSON text (DeepCoder): ``[{input, output, testtype?}]`` or ``{inputs, outputs}``."""
    if isinstance(value, dict):
        return _io_pairs(value, where, "tests")
    if not isinstance(value, list):
        raise DatasetError(f"{where}: tests must be a list of {{input, output}} or {{inputs, outputs}}")
    tests = []
    for i, c in enumerate(value):
        if not isinstance(c, dict) or "input" not in c or "output" not in c:
            raise DatasetError(f"{where}: tests[{i}]: missing field 'input' or 'output'")
        if c.get("testtype", "stdin") == "stdin":  # LiveCodeBench's "functional" tests are calls, not stdin
            tests.append({"input": _stdio_text(c["input"]), "output": _stdio_text(c["output"])})
    return tests


def _codecontests_tests(row: Row, where: str) -> list[Row]:
    """CodeContests: ``public_tests``, ``private_tests`` and ``generated_tests``, each ``{input: [...], output: [...]}``."""
    tests: list[Row] = []
    for name in _CODECONTESTS_TESTS:
        group = _json_field(row.get(name) or {"input": [], "output": []}, where, name)
        if not isinstance(group, dict):
            raise DatasetError(f"{where}: {name} must hold {{input, output}} lists")
        tests += _pairs(group.get("input"), group.get("output"), where, f"{name}.input/output")
    return tests


class _TextOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain data only: a pickle naming any class or function (code to run) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: only plain data is read")


def _livecodebench_cases(value: Any, where: str, name: str) -> Any:
    """A LiveCodeBench test list: JSON, or as ``code_generation_lite`` ships its private tests, the JSON text
    pickled, zlib-compressed and base64-encoded."""
    if isinstance(value, str) and not value.lstrip().startswith("["):
        try:
            text = _TextOnlyUnpickler(BytesIO(zlib.decompress(base64.b64decode(value, validate=True)))).load()
        except (binascii.Error, zlib.error, pickle.UnpicklingError, EOFError, ValueError) as e:
            raise DatasetError(f"{where}: field {name!r} is neither a JSON list nor LiveCodeBench's compressed "
                               f"test list: {e}") from e
        if not isinstance(text, str):
            raise DatasetError(f"{where}: field {name!r}: the compressed test list holds {type(text).__name__}, "
                               "not JSON text")
        value = text
    return _json_field(value, where, name)


def _code(row: Row, where: str, fmt: str) -> Row:
    question = _first(row, where, ("question", "problem", "prompt", "question_content", "description"),
                      "the problem statement")
    if isinstance(question, list):  # verl rows: a chat prompt, not a statement
        question = _chat_problem(row)
        if question is None:
            raise DatasetError(f"{where}: field 'prompt' is a list but holds no user message")
    if fmt == "auto" and isinstance(row.get("tests"), str) and row["tests"].lstrip()[:1] in ("[", "{"):
        tests = _json_tests(_json_field(row["tests"], where, "tests"), where)
    elif fmt == "auto" and isinstance(row.get("tests"), list):
        tests = row["tests"]
    else:
        tests = _tests_from(row, where, fmt)
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
    elif isinstance(answers, dict) and isinstance(answers.get("aliases"), list):  # TriviaQA {value, aliases}
        answers = list(dict.fromkeys(a for a in (answers.get("value"), *answers["aliases"]) if a not in (None, "")))
    if not isinstance(answers, list) or not answers:
        raise DatasetError(f"{where}: answers must be a string or a non-empty list of strings")
    aliases = row.get("answer_aliases")  # MuSiQue: other names of the answer, each as right as it
    if isinstance(aliases, list):
        answers = list(dict.fromkeys([*answers, *(a for a in aliases if a not in (None, ""))]))
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
