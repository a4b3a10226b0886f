"""SWE rows from JSON (an array, one object, a pretty-printed instance under any name) and Parquet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorl_cli.domains.datasets import load_instances
from prorl_cli.exceptions import DatasetError

ROW = {"instance_id": "o__r-1", "repo": "o/r", "base_commit": "abc", "problem_statement": "p", "test_patch": "",
       "FAIL_TO_PASS": '["t.py::a b"]', "PASS_TO_PASS": [], "install_config": '{"test_cmd": "pytest -rA"}'}


def test_json_array_object_and_pretty_printed_instance(tmp_path: Path) -> None:
    array = tmp_path / "d.json"
    array.write_text(json.dumps([ROW, {**ROW, "instance_id": "o__r-2"}], indent=2))
    rows = load_instances("swe", array)
    assert [r["instance_id"] for r in rows] == ["o__r-1", "o__r-2"]
    assert rows[0]["FAIL_TO_PASS"] == ["t.py::a b"] and rows[0]["install_config"] == {"test_cmd": "pytest -rA"}
    one = tmp_path / "one.json"
    one.write_text(json.dumps(ROW))
    assert [r["instance_id"] for r in load_instances("swe", one)] == ["o__r-1"]
    pretty = tmp_path / "instance.jsonl"  # pretty-printed, whatever its name says
    pretty.write_text(json.dumps(ROW, indent=2))
    assert [r["instance_id"] for r in load_instances("swe", pretty)] == ["o__r-1"]


def test_bad_json_names_file_line_and_item(tmp_path: Path) -> None:
    broken = tmp_path / "b.json"
    broken.write_text('[\n  {"instance_id": 1,\n')
    with pytest.raises(DatasetError, match=r"b\.json:3: not valid JSON"):
        load_instances("swe", broken)
    lacking = tmp_path / "l.json"
    lacking.write_text(json.dumps([ROW, {"repo": "o/r"}]))
    with pytest.raises(DatasetError, match=r"l\.json item 2: missing field 'instance_id'"):
        load_instances("swe", lacking)
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text(json.dumps(ROW) + "\n{oops\n")
    with pytest.raises(DatasetError, match=r"x\.jsonl:2: not valid JSON"):
        load_instances("swe", jsonl)


def test_parquet_rows(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{**ROW, "PASS_TO_PASS": "[]"}]), path)
    (row,) = load_instances("swe", path)
    assert row["FAIL_TO_PASS"] == ["t.py::a b"] and row["PASS_TO_PASS"] == []
