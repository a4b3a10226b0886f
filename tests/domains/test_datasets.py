"""Public dataset shapes (JSONL and Parquet) into domain instances; bad rows name file, line and field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prorl_cli.domains.datasets import LOADERS, load_instances, shipped_dataset
from prorl_cli.exceptions import DatasetError


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_math_rows_deepscaler_and_math_shapes(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "m.jsonl", [{"problem": "1+1?", "answer": "2", "solution": "x"},
                                      {"question": "half?", "solution": "so \\boxed{\\frac{1}{2}}."}])
    assert load_instances("math", f) == [{"problem": "1+1?", "answer": "2"}, {"problem": "half?", "answer": "\\frac{1}{2}"}]
    bad = _jsonl(tmp_path / "bad.jsonl", [{"problem": "ok", "answer": "1"}, {"answer": "3"}])
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: missing field 'problem'"):
        load_instances("math", bad)


def test_code_rows_in_every_public_shape(tmp_path: Path) -> None:
    want = [{"input": "1\n", "output": "2\n"}]
    rows = [
        {"question": "q", "inputs": ["1\n"], "outputs": ["2\n"]},
        {"problem": "q", "test_cases": json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})},
        {"prompt": "q", "input_output": json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})},
        {"question_content": "q", "public_test_cases": json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin"}]),
         "private_test_cases": json.dumps([{"input": "f(1)", "output": "2", "testtype": "functional"}])},
    ]
    assert [i["tests"] for i in load_instances("code", _jsonl(tmp_path / "c.jsonl", rows))] == [want] * 4
    both = _jsonl(tmp_path / "both.jsonl", [{"question": "q", "inputs": ["1"], "outputs": ["2"], "test_cases": []}])
    with pytest.raises(DatasetError, match="several shapes"):
        load_instances("code", both)
    assert load_instances("code", both, "io")[0]["tests"] == [{"input": "1", "output": "2"}]
    with pytest.raises(DatasetError, match=r"c2\.jsonl:1: missing field 'tests'"):
        load_instances("code", _jsonl(tmp_path / "c2.jsonl", [{"question": "q"}]))


def test_parquet_rows_and_search_answers(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "s.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q1", "golden_answers": ["a", "b"]}, {"question": "q2", "golden_answers": None}]), path)
    with pytest.raises(DatasetError, match=r"s\.parquet row 2: missing field 'answers'"):
        load_instances("search", path)
    pq.write_table(pa.Table.from_pylist([{"question": "q1", "golden_answers": ["a", "b"]}]), path)
    assert load_instances("search", path) == [{"question": "q1", "answers": ["a", "b"]}]
    # A file named .parquet that is not one (a download cut short, JSONL renamed): named, not pyarrow's traceback.
    path.write_text('{"question": "q1"}\n')
    with pytest.raises(DatasetError, match=r"s\.parquet: not a readable Parquet file"):
        load_instances("search", path)


def test_swe_rows_with_json_string_test_lists(tmp_path: Path) -> None:
    row = {"instance_id": "x", "repo": "o/r", "base_commit": "abc", "problem_statement": "p", "patch": "",
           "test_patch": "", "FAIL_TO_PASS": '["t::a"]', "PASS_TO_PASS": "[]", "version": "1.0"}
    (inst,) = load_instances("swe", _jsonl(tmp_path / "w.jsonl", [row]))
    assert inst["FAIL_TO_PASS"] == ["t::a"] and inst["PASS_TO_PASS"] == []
    del row["base_commit"]
    with pytest.raises(DatasetError, match="w2.jsonl:1: missing field 'base_commit'"):
        load_instances("swe", _jsonl(tmp_path / "w2.jsonl", [row]))


def test_shipped_datasets_load() -> None:
    for task in ("math", "code", "search"):
        items = load_instances(task, shipped_dataset(task))
        assert len(items) >= 24, task
    assert set(LOADERS) == {"math", "code", "swe", "search"}


def test_submit_names_the_bad_row(tmp_path: Path) -> None:
    bad = _jsonl(tmp_path / "bad.jsonl", [{"problem": "p", "answer": "1"}, {"problem": "p"}])
    proc = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", str(tmp_path), "submit", "--task", "math", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "bad.jsonl:2: missing field 'answer'" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", str(tmp_path), "submit", "--task", "math",
                           "--format", "apps", str(bad)], capture_output=True, text=True, timeout=60)
    assert "--format 'apps' does not apply to task 'math'" in proc.stderr, proc.stderr


# What pandas 3.1 writes for a two-row frame with DataFrame.to_json(path, orient=...); "columns" is its default.
PANDAS_JSON = {
    "columns": '{"problem":{"0":"What is 1+1?","1":"What is 2+2?"},"answer":{"0":"2","1":"4"}}',
    "index": '{"0":{"problem":"What is 1+1?","answer":"2"},"1":{"problem":"What is 2+2?","answer":"4"}}',
    "split": '{"columns":["problem","answer"],"index":[0,1],"data":[["What is 1+1?","2"],["What is 2+2?","4"]]}',
    "table": '{"schema":{"fields":[{"name":"index","type":"integer"},{"name":"problem","type":"string","extDtype":"str"},'
             '{"name":"answer","type":"string","extDtype":"str"}],"primaryKey":["index"],"pandas_version":"1.4.0"},'
             '"data":[{"index":0,"problem":"What is 1+1?","answer":"2"},{"index":1,"problem":"What is 2+2?","answer":"4"}]}',
    "records": '[{"problem":"What is 1+1?","answer":"2"},{"problem":"What is 2+2?","answer":"4"}]',
    # to_json(orient="records", lines=True): JSON Lines, often saved under a .json name.
    "lines": '{"problem":"What is 1+1?","answer":"2"}\n{"problem":"What is 2+2?","answer":"4"}\n',
}


@pytest.mark.parametrize("orient", sorted(PANDAS_JSON))
def test_pandas_to_json_files_load_as_their_rows(tmp_path: Path, orient: str) -> None:
    f = tmp_path / "rows.json"
    f.write_text(PANDAS_JSON[orient])
    assert load_instances("math", f) == [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 2+2?", "answer": "4"}]


def test_one_row_with_mapping_fields_is_not_read_as_a_table(tmp_path: Path) -> None:
    # A verl row: its mappings are keyed by names, not row numbers.
    f = tmp_path / "one.json"
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"},
                             "extra_info": {"index": 0}}))
    assert load_instances("math", f) == [{"problem": "1+1?", "answer": "2", "id": 0}]


def test_files_as_tools_write_them_bom_and_parquet_by_content(tmp_path: Path) -> None:
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode() + b'{"problem": "1+1?", "answer": "2"}\r\n')
    assert load_instances("math", bom) == [{"problem": "1+1?", "answer": "2"}]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{"problem": "1+1?", "answer": "2"}])
    for name in ("upper.PARQUET", "short.pq", "no_suffix"):
        pq.write_table(table, tmp_path / name)
        assert load_instances("math", tmp_path / name) == [{"problem": "1+1?", "answer": "2"}], name


@pytest.mark.parametrize(("row", "problem"), [
    ({"problem": "1+1?", "answer": ["3", "4"]}, r"field 'answer' is a list"),
    ({"problem": ["line 1", "line 2"], "answer": "3"}, r"field 'problem' is a list"),
    ({"problem": {"text": "1+1?"}, "answer": "3"}, r"field 'problem' is a mapping"),
    ({"problem": "1+1?", "answer": True}, r"field 'answer' is a bool"),
    ({"question": "Eggs?", "answer": "She sells 3 eggs.\n#### "}, r"field 'answer' has nothing after its '####'"),
    ({"problem": "1+1?", "answer": "   "}, r"field 'answer' is blank"),
    ({"problem": "   ", "answer": "2"}, r"field 'problem' is blank"),
])
def test_math_rows_that_cannot_be_scored_are_refused_by_row_and_field(tmp_path: Path, row: dict[str, object],
                                                                        problem: str) -> None:
    f = _jsonl(tmp_path / "rows.jsonl", [{"problem": "ok", "answer": "1"}, row])
    with pytest.raises(DatasetError, match=r"rows\.jsonl:2: " + problem):
        load_instances("math", f)


def test_math_numbers_as_answers_still_load(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "aime.jsonl", [{"Problem": "p", "Answer": 204}, {"problem": "q", "answer": 0.5}])
    assert load_instances("math", f) == [{"problem": "p", "answer": "204"}, {"problem": "q", "answer": "0.5"}]
