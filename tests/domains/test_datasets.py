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
