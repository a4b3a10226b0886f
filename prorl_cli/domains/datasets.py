"""Loading public dataset files (JSONL, Parquet or JSON) into the instances the domain handlers take.

``prorl submit --task NAME FILE [--format F] [--skip-bad-rows]`` calls :func:`load_instances`.
Shapes understood (``--format auto`` picks by the fields present, and asks
for ``--format`` when a row fits more than one):

- ``math``: DeepScaleR / MATH / AMC / AIME / GSM8K rows: ``problem`` (or
  ``question``, or capitalised) and ``answer`` (GSM8K's worked solution: the number after
  ``####``; an integral float as an integer), or a ``solution`` whose last ``\\boxed{}`` is the answer;
  verl-style rows (DAPO-Math-17k, verl's GSM8K): the last user message of
  ``prompt`` (their "Answer:" / "####" instructions removed: the math task
  asks for a ``\\boxed{}`` answer) and ``reward_model.ground_truth``.
- ``code``: ``question`` (or ``problem``/``prompt``/``question_content``/
  ``description``) with hidden tests as ``inputs``/``outputs`` lists
  (``--format io``), ``test_cases`` as a list of ``{input, output}`` or
  ``{inputs, outputs}`` (``test_cases``), APPS/TACO ``input_output`` JSON
  (``apps``; a test given as a list of lines is those lines joined; rows of
  function-call tests, ``fn_name``, are refused), LiveCodeBench
  ``public_test_cases``/``private_test_cases`` as JSON or as
  ``code_generation_lite`` compresses them (``livecodebench``; stdin tests),
  CodeContests ``public_tests``/``private_tests``/``generated_tests``
  (``codecontests``), open-r1/codeforces ``official_tests`` (else
  ``examples``; the question is ``description``, ``input_format``,
  ``output_format`` and ``note``; ``codeforces``), or verl-style rows
  (Eurus-2-RL-Data): a chat ``prompt`` and ``reward_model.ground_truth``
  holding ``{inputs, outputs}`` (``verl``), or PrimeIntellect's
  verifiable-coding-problems: ``verification_info.test_cases``
  (``verification_info``; the statement is ``prompt``, or
  ``problem_statement`` in open-r1's copy). ``tests`` may be a list or JSON
  text of one (DeepCoder). Function-call tests (LiveCodeBench
  ``testtype: "functional"``, DeepCoder ``type: "function_call"``) are left
  out; a row of nothing else is refused, and so is a row whose tests are
  assertions on a function (HumanEval, MBPP), naming the field.
- ``swe``: SWE-bench (full, Lite, Verified), SWE-Gym, SWE-smith, SWE-rebench,
  nebius SWE-bench-extra and swebench task rows, each with its own field
  names, mapped to the swe instance by :mod:`prorl_cli.swe.sources`
  (``--format`` names the source where ``auto`` should not guess). Fields
  prorl cannot use are kept and reported once per dataset (``warn``).
- ``search``: ``question`` (text; Bamboogle's ``Question``) with ``answers``, ``answer``, ``golden_answers``,
  PopQA's ``possible_answers`` or Bamboogle's ``Answer`` (a string, a number, a boolean as ``yes``/``no``, a
  list of them or of such lists (NQ), SQuAD's ``{text: [...]}`` or TriviaQA's
  ``{value, aliases}``), plus MuSiQue's ``answer_aliases``; verl/Search-R1 rows
  without those columns: the question from the chat ``prompt`` (what follows
  Search-R1's ``Question: ``) and ``reward_model.ground_truth.target``. A
  row's chat ``prompt`` (a list of ``{role, content}`` texts) is kept as the
  instance's ``prompt``, which the task prompts with under
  ``tool_format: search_r1``; a malformed one is refused, naming the message.

Any other task: each row is passed through unchanged. Errors name the file,
the line (JSONL) or row (Parquet) and the missing field; the first bad row
stops the load unless ``skip_bad_rows`` (``--skip-bad-rows``) leaves such
rows out and reports them.

The domain instances keep the row's ``id``, or where the source names its id
otherwise, that id as ``id`` (MATH-500 ``unique_id``, LiveCodeBench and
TriviaQA ``question_id``, ``task_id``, APPS ``problem_id``, HotpotQA
``_id``, AIME ``ID``, OpenR1-Math ``uuid``, MathArena ``problem_idx``, CodeContests ``name``, verl's ``extra_info.index``),
plus ``settings`` and ``tokenizer``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import pickle
import zlib
from collections.abc import Callable, Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

from prorl_cli.domains.answers import gsm8k_final, last_boxed
from prorl_cli.domains.prompts import SEARCH_R1_MARKS, chat_prompt
from prorl_cli.exceptions import DatasetError, DomainError
from prorl_cli.jsonl import is_parquet, jsonl_values
from prorl_cli.swe.sources import SOURCES, SweRows

log = logging.getLogger(__name__)
Row = dict[str, Any]
# CodeContests' test groups, in the order they are judged (max_tests keeps the first ones).
_CODECONTESTS_TESTS = ("public_tests", "private_tests", "generated_tests")
FORMATS: dict[str, tuple[str, ...]] = {
    "math": ("auto",),
    "code": ("auto", "io", "test_cases", "apps", "livecodebench", "codecontests", "codeforces", "verl",
             "verification_info"),
    "swe": ("auto", *SOURCES),
    "search": ("auto",),
}


def read_rows(path: Path, bad_line: Callable[[DatasetError], None] | None = None) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of a JSONL, Parquet or JSON file.

    ``where`` is ``FILE:LINE`` for JSONL, ``FILE row N`` for Parquet and
    ``FILE item N`` for JSON (1-based). Files are read as their publishers
    write them: Parquet by its magic bytes whatever the file's name; a
    ``.json`` file holds one array of rows, one row, a table as pandas'
    ``to_json`` writes it (any orient), or JSON Lines (as many Hub datasets
    name them); a file of another name that is not JSONL but one JSON
    document (a pretty-printed instance) is read the same way; a UTF-8 byte
    order mark is skipped.

    ``bad_line``: a JSON Lines line that is not JSON is passed to it and the
    reading goes on. A first line that is not JSON may be the start of one
    pretty-printed document, which is read as one; failing that, it is a bad
    line of a JSON Lines file when a later line is JSON, and a file with no
    JSON line at all (a CSV) stops the reading as without ``bad_line``.
    """
    if is_parquet(path):
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
        yield from _json_rows(path, bad_line)
        return
    read_one = False

    on_bad_line: Callable[[DatasetError], None] | None = None
    if bad_line is not None:
        report = bad_line

        def after_first(e: DatasetError) -> None:
            if not read_one:
                raise e
            report(e)

        on_bad_line = after_first
    try:
        for lineno, row in jsonl_values(path, DatasetError, on_bad_line=on_bad_line):
            read_one = True
            yield f"{path}:{lineno}", row
    except DatasetError as e:
        if read_one or not isinstance(e.__cause__, json.JSONDecodeError):
            raise
        # The first line is not JSON: the file may be one (pretty-printed) JSON document instead.
        document = _whole_document(path)
        if document is not None:
            yield from _items(path, document)
            return
        if bad_line is None:
            raise
        # Neither one document nor JSON Lines from its first line. A later line that is JSON makes it a JSON Lines
        # file whose first line is bad (a row cut or mangled by hand), so the bad lines are reported as any other;
        # no JSON line at all is a file of another kind, refused by its first line.
        if not any(True for _ in jsonl_values(path, DatasetError, on_bad_line=lambda _bad: None)):
            raise
        for lineno, row in jsonl_values(path, DatasetError, on_bad_line=bad_line):
            yield f"{path}:{lineno}", row


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


def _json_rows(path: Path, bad_line: Callable[[DatasetError], None] | None = None) -> Iterator[tuple[str, Any]]:
    try:
        document = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one JSON value per line: JSON Lines under a .json name
            for lineno, row in jsonl_values(path, DatasetError, on_bad_line=bad_line):
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


def _first_named(row: Row, where: str, names: tuple[str, ...], what: str) -> tuple[str, Any]:
    """``(name, value)`` of the first of ``names`` the row has a value for.

    Null, ``""`` and ``[]`` count as absent, so a row carrying several sources' columns (one of them an
    empty list, as HF datasets write a missing list) falls through to the next name.
    """
    for name in names:
        value = row.get(name)
        if value is not None and value != "" and value != []:
            return name, value
    raise DatasetError(f"{where}: missing field {names[0]!r} ({what}; also accepted: {list(names[1:]) or 'none'})")


def _first(row: Row, where: str, names: tuple[str, ...], what: str) -> Any:
    return _first_named(row, where, names, what)[1]


def _json_field(value: Any, where: str, name: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: field {name!r} is a string but not JSON: {e.msg}") from e
    return value


# Where public sets keep a row's own id when they do not call it 'id': MATH-500 'unique_id', LiveCodeBench
# and TriviaQA 'question_id', HumanEval/MBPP-style sets 'task_id', APPS 'problem_id', HotpotQA's own JSON
# '_id', the AIME sets 'ID', OpenR1-Math 'uuid', MathArena's competitions 'problem_idx'. The id goes to 'id',
# the field the shipped datasets and prorl's docs use, so rewards can be joined back to the source rows.
_SOURCE_ID_FIELDS = ("unique_id", "question_id", "task_id", "problem_id", "_id", "ID", "uuid", "problem_idx")


def _id_value(value: Any) -> str | int | None:
    """An id as its source wrote it: text or an integer (an integral float as the integer it was: pandas reads an
    integer column with nulls as floats); anything else (null, blank, a mapping) is no id."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.strip()):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_FLOAT_INTS:
        return int(value)
    return None


def _source_id(row: Row, extra: tuple[str, ...] = ()) -> str | int | None:
    """The id the row's source gives it under another name than ``id``: the first of :data:`_SOURCE_ID_FIELDS`
    and ``extra`` it has, else verl's ``extra_info.index`` (as verl's preprocessing and DAPO-Math-17k write
    it); ``None`` when it has none (GSM8K, DeepScaleR): no id is made up."""
    for name in (*_SOURCE_ID_FIELDS, *extra):
        found = _id_value(row.get(name))
        if found is not None:
            return found
    extra_info = row.get("extra_info")
    return _id_value(extra_info.get("index")) if isinstance(extra_info, dict) else None


def _keep(row: Row, out: Row, id_fields: tuple[str, ...] = ()) -> Row:
    """``out`` with the row's ``id``, ``settings`` and ``tokenizer``.

    The ``id`` is the row's own when it has one (null and ``""`` are none), else its source's
    (:func:`_source_id`; ``id_fields``: names that are an id in this row's shape only).
    """
    given = row.get("id")
    found = given if given not in (None, "") else _source_id(row, id_fields)
    if found is not None:
        out["id"] = found
    elif "id" in row:
        out["id"] = given  # a null id is kept as given, as it always was
    for key in ("settings", "tokenizer"):
        if key in row:
            out[key] = row[key]
    return out


# DAPO-Math-17k wraps each problem in an instruction to end with "Answer: ...", which contradicts the math
# task's system prompt (a \\boxed{} answer): the loader keeps the problem only (the task still reads an
# "Answer:" line a model trained on those rows writes, answers.math_answer).
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


def _blank(value: Any) -> bool:
    """Whether a field holds nothing: null, empty text or an empty list (how files spell a missing answer)."""
    return value is None or value == "" or value == []


def _verl_ground_truth(row: Row) -> Any:
    """A verl-preprocessed row's ``reward_model.ground_truth`` as it is (``None`` when it has none)."""
    reward_model = row.get("reward_model")
    return reward_model.get("ground_truth") if isinstance(reward_model, dict) else None


def _ground_truth(row: Row, where: str) -> str | None:
    """verl's ``reward_model.ground_truth``: a string, a number, or a list holding one (as a list or as JSON text
    of one, as some verl recipes write it); ``None`` when the row has none. A list of several answers is
    refused: the math task scores against one answer, and any one of them would score the others 0."""
    truth = _verl_ground_truth(row)
    if isinstance(truth, str) and truth.lstrip().startswith('["'):
        try:
            parsed = json.loads(truth)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list) and parsed and all(isinstance(a, str) for a in parsed):
            truth = parsed
    if isinstance(truth, list) and len(truth) == 1:
        truth = truth[0]
    if isinstance(truth, list) and len(truth) > 1:
        shown = ", ".join(map(repr, truth[:3])) + (", ..." if len(truth) > 3 else "")
        raise DatasetError(f"{where}: field 'reward_model.ground_truth' holds {len(truth)} answers ({shown}): the "
                           "math task scores against one; give the row an 'answer'")
    if _blank(truth) or isinstance(truth, dict | bool):
        return None
    return _number_answer(truth, where, "reward_model.ground_truth") if isinstance(truth, int | float) else str(truth)


def _present(row: Row, names: tuple[str, ...]) -> Any:
    """The first of ``names`` the row has a value for, else ``None``."""
    return next((row[name] for name in names if row.get(name) not in (None, "")), None)


def _type_name(value: Any) -> str:
    """``value``'s type for an error message, with its article ("a list", "an int")."""
    if isinstance(value, dict):
        return "a mapping"
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


# NuminaMath-1.5 writes these in 'answer' for rows that have no answer to check (proofs, answers its
# extraction did not find): as gold they would score every rollout 0.
_PLACEHOLDER_ANSWERS = ("proof", "notfound")
# Above 2**53 a float64 no longer holds every integer: an integer column read back as floats (pandas turns
# an int column with nulls into float64) may have lost its last digits there.
_EXACT_FLOAT_INTS = 2**53


def _number_answer(given: int | float, where: str, field: str) -> str:
    """A numeric answer as the text a model would write: integral floats as integers (``142.0`` -> ``142``,
    ``1e15`` -> ``1000000000000000``), never in scientific notation, which the verifier does not equate."""
    if isinstance(given, int):
        return str(given)
    if not math.isfinite(given):
        raise DatasetError(f"{where}: field {field!r} is {given} (NaN or infinity, as JSON writers spell a missing "
                           "float): the row has no checkable answer; leave it out")
    if not given.is_integer():
        return str(given)
    if abs(given) > _EXACT_FLOAT_INTS:
        # Refused, not rounded: int(1.2345678901234568e16) is 12345678901234568 while the source column may
        # have held 12345678901234567, and a gold answer off by one scores every right rollout 0.
        raise DatasetError(f"{where}: field {field!r} is the float {given!r}, too large for a float to hold every "
                           "integer exactly (an integer column with nulls read as floats loses digits there): "
                           "write the answer as text or as an integer column")
    return str(int(given))


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
    given, solution = _present(row, ("answer", "Answer")), _present(row, ("solution", "Solution"))
    truth = _ground_truth(row, where) if given is None else None
    if given is not None:
        field = "answer"
        if isinstance(given, bool) or not isinstance(given, str | int | float):
            raise DatasetError(f"{where}: field 'answer' is {_type_name(given)}, expected the answer as text or a number")
        text = given if isinstance(given, str) else _number_answer(given, where, field)
        answer = gsm8k_final(text)  # GSM8K: a worked solution whose final line is "#### 72"
        if not answer.strip():
            what = "has nothing after its '####'" if "####" in text else "is blank"
            raise DatasetError(f"{where}: field 'answer' {what}: no answer to score against")
    elif truth is not None:
        field, answer = "reward_model.ground_truth", truth
    elif isinstance(solution, str):
        boxed = last_boxed(solution)
        if boxed is None:
            raise DatasetError(f"{where}: missing field 'answer', and 'solution' has no \\boxed{{}} answer")
        field, answer = "solution", boxed
    else:
        raise DatasetError(f"{where}: missing field 'answer' (or a 'solution' with a \\boxed{{}} answer)")
    if answer.strip().lower() in _PLACEHOLDER_ANSWERS:
        raise DatasetError(f"{where}: field {field!r} is {answer.strip()!r}, NuminaMath's placeholder for a row with "
                           "no checkable answer (a proof, or no answer found): every rollout would score 0; leave "
                           "such rows out (NuminaMath-1.5: keep rows whose answer is neither 'proof' nor 'notfound')")
    return _keep(row, {"problem": str(problem), "answer": answer})


def _stdio_text(value: Any, where: str, field: str) -> str:
    """One test's stdin or stdout as text.

    APPS/TACO give some as a list of lines, which their own judge joins; a number (JSON ``3`` for ``"3"``)
    is its decimal text. Anything else (null, a mapping, a list of values) would reach the program as a
    Python repr no solution prints: refused, naming ``field``.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DatasetError(f"{where}: {field} is {_type_name(value)}, expected the test's stdin/stdout as text "
                       "(or a list of its lines)")


def _pairs(inputs: Any, outputs: Any, where: str, in_name: str, out_name: str) -> list[Row]:
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise DatasetError(f"{where}: {in_name}/{out_name.rpartition('.')[2]} must be two lists of the same length")
    return [{"input": _stdio_text(i, where, f"{in_name}[{k}]"), "output": _stdio_text(o, where, f"{out_name}[{k}]")}
            for k, (i, o) in enumerate(zip(inputs, outputs, strict=True))]


def _tests_from(row: Row, where: str, fmt: str) -> tuple[str, list[Row]]:
    """``(shape, tests)``: the row's test shape (``fmt``, or the one ``auto`` found) and its stdin/stdout tests."""
    shapes = {
        "io": "inputs" in row and "outputs" in row,
        "test_cases": "test_cases" in row,
        "apps": "input_output" in row,
        "livecodebench": "public_test_cases" in row or "private_test_cases" in row,
        # open-r1/codeforces has an int 'generated_tests' (how many it ships elsewhere): not CodeContests' group.
        "codecontests": any(name in row and not isinstance(row[name], int) for name in _CODECONTESTS_TESTS),
        "codeforces": "official_tests" in row,
        "verl": isinstance(row.get("reward_model"), dict) and "ground_truth" in row["reward_model"],
        # PrimeIntellect's verifiable-coding-problems (JSON text) and open-r1's copy of it (a struct).
        "verification_info": row.get("verification_info") not in (None, ""),
    }
    if fmt == "auto":
        found = [k for k, ok in shapes.items() if ok]
        if not found:
            _refuse_assert_tests(row, where)
            count = (" ('generated_tests' here is a count, as open-r1/codeforces has it: that dataset's tests are "
                     "'official_tests')" if isinstance(row.get("generated_tests"), int) else "")
            raise DatasetError(f"{where}: missing field 'tests' (hidden tests as inputs/outputs, test_cases, "
                               "input_output, public_test_cases/private_test_cases, public_tests/private_tests, "
                               f"official_tests, verification_info.test_cases or reward_model.ground_truth){count}")
        if len(found) > 1:
            raise DatasetError(f"{where}: the row has tests in several shapes {found}; pick one with --format")
        fmt = found[0]
    elif not shapes[fmt]:
        raise DatasetError(f"{where}: --format {fmt}: missing its test field(s)")
    if fmt == "io":
        return fmt, _pairs(row["inputs"], row["outputs"], where, "inputs", "outputs")
    if fmt == "apps":
        if row["input_output"] in (None, ""):  # APPS ships some rows without tests
            raise DatasetError(f"{where}: input_output is empty: the row has no tests")
        return fmt, _io_pairs(_json_field(row["input_output"], where, "input_output"), where, "input_output")
    if fmt == "verl":
        truth = _json_field(row["reward_model"]["ground_truth"], where, "reward_model.ground_truth")
        return fmt, _io_pairs(truth, where, "reward_model.ground_truth")
    if fmt == "test_cases":
        cases = _json_field(row["test_cases"], where, "test_cases")
        if isinstance(cases, dict):
            return fmt, _pairs(cases.get("inputs"), cases.get("outputs"), where, "test_cases.inputs", "test_cases.outputs")
        if isinstance(cases, list):
            return fmt, _case_tests(cases, where, "test_cases")
        raise DatasetError(f"{where}: test_cases must be a list of {{input, output}} or {{inputs, outputs}}")
    if fmt == "codecontests":
        return fmt, _codecontests_tests(row, where)
    if fmt == "codeforces":
        return fmt, _codeforces_tests(row, where)
    if fmt == "verification_info":
        return fmt, _verification_info_tests(row, where)
    tests: list[Row] = []
    calls: list[str] = []
    for name in ("public_test_cases", "private_test_cases"):
        cases = _livecodebench_cases(row.get(name) or "[]", where, name)
        if not isinstance(cases, list):
            raise DatasetError(f"{where}: {name} must be a JSON list of {{input, output}}")
        tests += _case_tests(cases, where, name, calls)
    if not tests and calls:
        _refuse_call_tests(where, "public_test_cases/private_test_cases", calls)
    return fmt, tests


def _verification_info_tests(row: Row, where: str) -> list[Row]:
    """PrimeIntellect's verifiable-coding-problems: ``verification_info`` (JSON text, or a mapping as open-r1's copy
    has it) holding ``test_cases``, a list of ``{fn_name, input, output, type}``; the ``function_call`` items are
    left out as elsewhere."""
    info = _json_field(row["verification_info"], where, "verification_info")
    if not isinstance(info, dict) or not isinstance(info.get("test_cases"), list):
        raise DatasetError(f"{where}: verification_info is {_type_name(info)} without a 'test_cases' list, expected "
                           "{language, test_cases: [{input, output, type}]}")
    return _case_tests(info["test_cases"], where, "verification_info.test_cases")


# Rows whose tests are Python code run against a function, not a program's stdin/stdout: HumanEval ('test' with a
# check(candidate) and 'entry_point'), MBPP ('test_list' of asserts), KodCode and the like ('test', pytest code).
_ASSERT_TEST_FIELDS = (("test_list", "a list of asserts, as MBPP ships them"),
                       ("entry_point", "a check() of 'entry_point', as HumanEval ships them"),
                       ("test", "Python test code"))


def _refuse_assert_tests(row: Row, where: str) -> None:
    """Refuses a row whose tests are assertions on a function, naming the field: judged as stdin/stdout programs,
    no solution would pass (the row would score 0 for every rollout)."""
    def code(value: Any) -> bool:  # Python text, or a list of it (MBPP's asserts)
        if isinstance(value, list):
            return bool(value) and all(isinstance(v, str) for v in value)
        return isinstance(value, str) and bool(value.strip())

    for name, what in _ASSERT_TEST_FIELDS:
        field = "test" if name == "entry_point" else name  # HumanEval's tests are in 'test', run on 'entry_point'
        if code(row.get(name)) and code(row.get(field)):
            raise DatasetError(f"{where}: field {field!r} holds assertion tests on a function ({what}), not "
                               "stdin/stdout tests; the code task judges stdin/stdout programs only: leave such rows "
                               "out, or give their tests as {input, output}")


def _io_pairs(io: Any, where: str, name: str) -> list[Row]:
    """APPS/TACO-style ``{inputs, outputs}`` (also verl's code ``ground_truth``) as stdin/stdout tests."""
    if not isinstance(io, dict):
        raise DatasetError(f"{where}: {name} must hold {{inputs, outputs}}")
    if io.get("fn_name"):
        # Its inputs are argument lists and its outputs return values: fed to stdin, no program passes.
        raise DatasetError(f"{where}: {name} has function-call tests (fn_name {io['fn_name']!r}); the code "
                           "task judges stdin/stdout programs only: leave such rows out")
    return _pairs(io.get("inputs"), io.get("outputs"), where, f"{name}.inputs", f"{name}.outputs")


def _call_test(case: Row) -> str | None:
    """How a test item says it is not a stdin/stdout test, or ``None`` for a stdin one.

    LiveCodeBench marks tests ``testtype: "functional"`` (calls of a LeetCode method), DeepCoder's
    ``type: "function_call"`` with an ``fn_name``; its stdin tests are ``type: "stdin_stdout"``.
    """
    if case.get("fn_name"):
        return f"fn_name {case['fn_name']!r}"
    if case.get("testtype", "stdin") != "stdin":
        return f"testtype {case['testtype']!r}"
    if case.get("type", "stdin_stdout") not in ("stdin_stdout", "stdin"):
        return f"type {case['type']!r}"
    return None


def _refuse_call_tests(where: str, name: str, calls: list[str]) -> None:
    kinds = ", ".join(dict.fromkeys(calls))
    raise DatasetError(f"{where}: {name} has function-call tests only ({kinds}; LiveCodeBench's LeetCode rows and "
                       "DeepCoder's function_call rows are such); the code task judges stdin/stdout programs only: "
                       "leave such rows out")


def _case_tests(cases: list[Any], where: str, name: str, calls: list[str] | None = None) -> list[Row]:
    """A list of test items ``{input, output}`` (LiveCodeBench, DeepCoder: with ``testtype``/``type``) as stdin tests.

    Function-call items are left out, their kinds appended to ``calls``; a row of such items only is refused
    (by the caller when it gathers several lists in ``calls``, here otherwise): judged on stdin they would
    fail every solution. Each stdin item must be a mapping with ``input`` and ``output``.
    """
    own = calls is None
    found: list[str] = [] if calls is None else calls
    tests = []
    for i, c in enumerate(cases):
        field = f"{name}[{i}]"
        if not isinstance(c, dict):
            raise DatasetError(f"{where}: {field} is {_type_name(c)}, expected a test {{input, output}}")
        call = _call_test(c)
        if call is not None:
            found.append(call)
            continue
        for key in ("input", "output"):
            if key not in c:
                raise DatasetError(f"{where}: {field}: missing field {key!r} (a test is {{input, output}})")
        tests.append({"input": _stdio_text(c["input"], where, f"{field}.input"),
                      "output": _stdio_text(c["output"], where, f"{field}.output")})
    if own and not tests and found:
        _refuse_call_tests(where, name, found)
    return tests


def _json_tests(value: Any, where: str) -> list[Row]:
    """``tests`` as a list or its JSON text (DeepCoder): ``[{input, output, testtype?/type?}]`` or ``{inputs, outputs}``."""
    if isinstance(value, dict):
        return _io_pairs(value, where, "tests")
    if not isinstance(value, list):
        raise DatasetError(f"{where}: tests must be a list of {{input, output}} or {{inputs, outputs}}")
    return _case_tests(value, where, "tests")


def _codecontests_tests(row: Row, where: str) -> list[Row]:
    """CodeContests: ``public_tests``, ``private_tests`` and ``generated_tests``, each ``{input: [...], output: [...]}``."""
    tests: list[Row] = []
    for name in _CODECONTESTS_TESTS:
        value = row.get(name)
        group = _json_field({"input": [], "output": []} if value in (None, "") else value, where, name)
        if not isinstance(group, dict):
            hint = (" (open-r1/codeforces counts its generated tests there: read such rows with --format codeforces)"
                    if isinstance(group, int) else "")
            raise DatasetError(f"{where}: {name} is {_type_name(group)}, expected CodeContests' {{input, output}} "
                               f"lists{hint}")
        tests += _pairs(group.get("input"), group.get("output"), where, f"{name}.input", f"{name}.output")
    return tests


def _codeforces_tests(row: Row, where: str) -> list[Row]:
    """open-r1/codeforces: ``official_tests`` (a list of ``{input, output}``), else the statement's ``examples``."""
    if row.get("interaction_format") not in (None, ""):
        raise DatasetError(f"{where}: the row is an interactive problem (interaction_format): its tests need "
                           "Codeforces' interactor, and the code task judges stdin/stdout programs only: leave "
                           "such rows out")
    for name in ("official_tests", "examples"):
        cases = _json_field(row.get(name), where, name)
        if cases in (None, []):
            continue
        if not isinstance(cases, list):
            raise DatasetError(f"{where}: {name} is {_type_name(cases)}, expected a list of {{input, output}}")
        return _case_tests(cases, where, name)
    raise DatasetError(f"{where}: official_tests and examples are both empty: the row has no stdin/stdout tests")


def _codeforces_statement(row: Row, where: str) -> str:
    """open-r1/codeforces keeps the statement in parts; the input and output specifications are part of the
    problem (limits, formats), so the question is all of them, as Codeforces shows them."""
    parts = []
    for name, heading in (("description", None), ("input_format", "Input"), ("output_format", "Output"),
                          ("note", "Note")):
        text = row.get(name)
        if text in (None, ""):
            if name == "description":
                raise DatasetError(f"{where}: missing field 'description' (the problem statement)")
            continue
        if not isinstance(text, str):
            raise DatasetError(f"{where}: field {name!r} is {_type_name(text)}, expected text")
        parts.append(text if heading is None else f"## {heading}\n\n{text}")
    return "\n\n".join(parts)


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
    if fmt == "auto" and isinstance(row.get("tests"), str) and row["tests"].lstrip()[:1] in ("[", "{"):
        shape, tests = "tests", _json_tests(_json_field(row["tests"], where, "tests"), where)
    elif fmt == "auto" and isinstance(row.get("tests"), list):
        shape, tests = "tests", _json_tests(row["tests"], where)
    else:
        shape, tests = _tests_from(row, where, fmt)
    if not tests:
        raise DatasetError(f"{where}: the row has no stdin/stdout tests")
    question = _codeforces_statement(row, where) if shape == "codeforces" else _code_question(row, where)
    # CodeContests names each problem by its contest and index ("1548_E. Gregor and the Two Painters") and has no
    # other id; elsewhere (TACO) 'name' is the problem's title, not an id, so it counts for this shape only.
    return _keep(row, {"question": question, "tests": tests}, ("name",) if shape == "codecontests" else ())


def _code_question(row: Row, where: str) -> str:
    field, question = _first_named(row, where, ("question", "problem", "prompt", "question_content", "description",
                                                "problem_statement"), "the problem statement")
    if field == "prompt" and isinstance(question, list):  # verl rows: a chat prompt, not a statement
        question = _chat_problem(row)
        if question is None:
            raise DatasetError(f"{where}: field 'prompt' is a list but holds no user message")
    # A value that is not text would reach the model as its Python repr: refused, as math refuses it.
    if not isinstance(question, str):
        raise DatasetError(f"{where}: field {field!r} is {_type_name(question)}, expected the problem statement text")
    if not question.strip():
        raise DatasetError(f"{where}: field {field!r} is blank")
    return question


def _swe(row: Row, where: str, fmt: str) -> Row:
    """One SWE row on its own (:func:`load_instances` maps a whole file and reports what it could not use)."""
    return SweRows(fmt).map(row, where)


def _gold_text(value: Any, where: str, field: str) -> str:
    """One gold answer as text: a string as it is, a number as its decimal text (``1997``), a boolean as
    ``yes``/``no`` (StrategyQA's ``answer: true``: its evaluations compare the yes/no the model writes)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _number_answer(value, where, field)
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: field {field!r} is blank, expected a gold answer")
        return value
    raise DatasetError(f"{where}: field {field!r} is {_type_name(value)}, expected a gold answer as text")


def _gold_list(answers: list[Any], where: str, field: str) -> list[str]:
    """Gold answers from a list: strings, numbers and booleans (:func:`_gold_text`); a nested list of them (NQ's
    per-annotator lists) is flattened one level. Duplicates are dropped, the first kept in order; a null item
    is refused (as text, ``None`` would be a gold answer)."""
    out: list[str] = []
    for i, item in enumerate(answers):
        if isinstance(item, list):
            out += [_gold_text(a, where, f"{field}[{i}][{j}]") for j, a in enumerate(item)]
        else:
            out.append(_gold_text(item, where, f"{field}[{i}]"))
    return list(dict.fromkeys(out))


# Search-R1's data scripts wrap each question in their instructions (search in <search> tags, answer in <answer>
# tags) ending "Question: {question}"; prorl's search task gives its own tools, so the question is what follows.
_SEARCH_R1_QUESTION = "Question: "


def _search_question(row: Row, where: str) -> tuple[str, Any]:
    """``(field, question)``: ``question``, ``query`` or Bamboogle's ``Question``; else, in verl/Search-R1 rows that
    kept no question column, the question part of the chat ``prompt``."""
    names = ("question", "query", "Question")
    if _present(row, names) is None and isinstance(row.get("prompt"), list):
        text = _chat_problem(row)
        if text is not None and all(mark in text for mark in SEARCH_R1_MARKS) and _SEARCH_R1_QUESTION in text:
            text = text.rpartition(_SEARCH_R1_QUESTION)[2].strip()
        if text:
            return "prompt", text
    return _first_named(row, where, names, "the question; or a chat 'prompt'")


def _search_truth(row: Row) -> tuple[str, Any] | None:
    """verl's ``reward_model.ground_truth`` for QA: Search-R1's ``{target: [...]}``, or the answer(s) themselves."""
    truth = _verl_ground_truth(row)
    if isinstance(truth, dict) and "target" in truth:
        return "reward_model.ground_truth.target", truth["target"]
    if _blank(truth) or isinstance(truth, dict):
        return None
    return "reward_model.ground_truth", truth


def _row_prompt(row: Row, where: str) -> list[dict[str, str]] | None:
    """The row's chat ``prompt`` (verl's column), checked (:func:`~prorl_cli.domains.prompts.chat_prompt`);
    ``None`` when it has none, or a text one (a statement, not a conversation)."""
    prompt = row.get("prompt")
    if prompt is None or isinstance(prompt, str):
        return None
    try:
        return chat_prompt(prompt)
    except DomainError as e:
        raise DatasetError(f"{where}: {e}") from e


def _search(row: Row, where: str, fmt: str) -> Row:
    # Kept as the row wrote it: the search task prompts with it under Search-R1's protocol (tool_format
    # search_r1), so a row of another template (another paper's, a translation) is asked as it was written.
    prompt = _row_prompt(row, where)
    question_field, question = _search_question(row, where)
    # A question that is not text (NQ's full release has {text, tokens}) would reach the model as its Python repr.
    if not isinstance(question, str):
        raise DatasetError(f"{where}: field {question_field!r} is {_type_name(question)}, expected the question text")
    if not question.strip():
        raise DatasetError(f"{where}: field {question_field!r} is blank")
    # PopQA keeps its gold answers in 'possible_answers', a JSON list as text.
    # Bamboogle capitalises its 'Answer'; verl/Search-R1 Parquet keeps the golden answers in reward_model too.
    names = ("answers", "golden_answers", "answer", "possible_answers", "Answer")
    given = any(not _blank(row.get(name)) for name in names)
    truth = None if given else _search_truth(row)
    field, answers = truth if truth is not None else _first_named(
        row, where, names, "the gold answer(s); or verl's reward_model.ground_truth.target")
    if isinstance(answers, str) and answers.lstrip().startswith("["):
        if field == "answer":
            # One answer may itself start with "[" ("[citation needed]", "[1, 2]"): it is a list of answers only
            # when it parses as a JSON list of strings.
            try:
                parsed = json.loads(answers)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, list) and parsed and all(isinstance(a, str) for a in parsed):
                answers = parsed
        else:  # 'answers', 'golden_answers' and 'possible_answers' hold lists: JSON text of one (a CSV round trip)
            answers = _json_field(answers, where, field)
    if isinstance(answers, dict) and isinstance(answers.get("text"), list):  # SQuAD-style {text: [...]}
        if not answers["text"]:
            raise DatasetError(f"{where}: field {field!r} has no answer text (an unanswerable row, as SQuAD v2 "
                               "marks them): there is nothing to score against; leave such rows out")
        field, answers = f"{field}.text", answers["text"]
    elif isinstance(answers, dict) and isinstance(answers.get("aliases"), list):  # TriviaQA {value, aliases}
        answers = [a for a in (answers.get("value"), *answers["aliases"]) if a not in (None, "")]
    if isinstance(answers, list):
        if not answers:
            raise DatasetError(f"{where}: field {field!r} is an empty list: no gold answer to score against")
        gold = _gold_list(answers, where, field)
    elif isinstance(answers, str | int | float):
        gold = [_gold_text(answers, where, field)]
    else:
        raise DatasetError(f"{where}: field {field!r} is {_type_name(answers)}, expected a gold answer: text, a "
                           "number, a list of them, SQuAD's {text: [...]} or TriviaQA's {value, aliases}")
    aliases = row.get("answer_aliases")  # MuSiQue: other names of the answer, each as right as it
    if isinstance(aliases, list):
        gold = list(dict.fromkeys([*gold, *(_gold_text(a, where, f"answer_aliases[{i}]")
                                            for i, a in enumerate(aliases) if a not in (None, ""))]))
    out: Row = {"question": question, "answers": gold}
    if prompt is not None:
        out["prompt"] = prompt
    return _keep(row, out)


LOADERS: dict[str, Callable[[Row, str, str], Row]] = {"math": _math, "code": _code, "swe": _swe, "search": _search}


#: How many of the skipped rows' reasons ``--skip-bad-rows`` names.
SKIPPED_SHOWN = 5


def load_instances(task: str, path: str | Path, fmt: str | None = None,
                   warn: Callable[[str], None] | None = None, *, skip_bad_rows: bool = False) -> list[Any]:
    """The instances of ``path`` for ``task`` (:func:`load_rows` without the row numbers)."""
    return [instance for _, instance in load_rows(task, path, fmt, warn, skip_bad_rows=skip_bad_rows)]


def load_rows(task: str, path: str | Path, fmt: str | None = None,
              warn: Callable[[str], None] | None = None, *, skip_bad_rows: bool = False) -> list[tuple[int, Any]]:
    """``(row, instance)`` for each instance of ``path`` for ``task``; a :class:`DatasetError` names file,
    line/row and field. ``row`` counts the file's rows from 0, the ones ``skip_bad_rows`` left out included,
    so an id made from it names the same row once a bad row before it is mended.

    ``warn`` gets one line per field the rows carry and prorl cannot use (``swe``: once per dataset,
    naming the field and the source); by default it is logged as a warning.

    ``skip_bad_rows`` (the domain tasks only): a row that would raise :class:`DatasetError` (a field missing
    or unusable, a JSON Lines line that is not JSON) is left out instead, and ``warn`` gets one line saying
    how many were and the first :data:`SKIPPED_SHOWN` reasons; a file of bad rows only still raises. What is
    wrong with the whole file (not readable, not UTF-8, not JSON at all, a ``--format`` that does not apply)
    raises either way.
    """
    file = Path(path)
    fmt = fmt or "auto"
    loader = LOADERS.get(task)
    if loader is not None and fmt not in FORMATS[task]:
        raise DatasetError(f"--format {fmt!r} does not apply to task {task!r}; choose from {list(FORMATS[task])}")
    if loader is None and fmt != "auto":
        raise DatasetError(f"--format applies to the domain tasks {sorted(LOADERS)}, not to {task!r}")
    if loader is None and skip_bad_rows:
        # Other tasks' rows go to their handlers unchanged: nothing here can tell a bad one.
        raise DatasetError(f"--skip-bad-rows applies to the domain tasks {sorted(LOADERS)}, not to {task!r}")
    swe = SweRows(fmt) if task == "swe" else None
    instances: list[tuple[int, Any]] = []
    skipped: list[DatasetError] = []
    unreadable = 0  # lines that were not JSON: rows too, though none was yielded for them

    def bad_line(e: DatasetError) -> None:
        nonlocal unreadable
        unreadable += 1
        skipped.append(e)

    for read, (where, row) in enumerate(read_rows(file, bad_line if skip_bad_rows else None)):
        index = read + unreadable
        if loader is None:
            instances.append((index, row))
            continue
        try:
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
            instances.append((index, swe.map(row, where) if swe is not None else loader(row, where, fmt)))
        except DatasetError as e:
            if not skip_bad_rows:
                raise
            skipped.append(e)
    if skipped and not instances:
        raise DatasetError(f"{file}: every row is bad ({len(skipped)} skipped by --skip-bad-rows), e.g. "
                           f"{_reasons(skipped)}")
    for line in swe.report() if swe is not None else []:
        (warn or log.warning)(f"{file}: {line}")
    if skipped:
        (warn or log.warning)(f"{file}: skipped {len(skipped)} bad row(s) of {len(skipped) + len(instances)} "
                              f"(--skip-bad-rows): {_reasons(skipped)}")
    return instances


def _reasons(skipped: list[DatasetError]) -> str:
    """The first :data:`SKIPPED_SHOWN` skip reasons (each names its file:line or row and field), then how many more."""
    shown = "; ".join(str(e) for e in skipped[:SKIPPED_SHOWN])
    more = len(skipped) - SKIPPED_SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def shipped_dataset(task: str) -> Path:
    """The small dataset shipped for ``task`` (``handlers/data/<task>.jsonl``)."""
    from prorl_cli.resources import data_dir

    path = data_dir("handlers") / "data" / f"{task}.jsonl"
    if not path.is_file():
        raise DatasetError(f"no shipped dataset for task {task!r} ({path})")
    return path
