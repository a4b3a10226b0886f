"""The one JSONL reader: blank lines skipped, line numbers from 1, errors of the caller's class naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorl_cli.exceptions import DatasetError
from prorl_cli.jsonl import jsonl_objects, jsonl_values


def test_jsonl_reader_numbers_lines_and_names_the_bad_one(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"a": 1}\n\n  \n[2]\n"three"\n')
    assert list(jsonl_values(good, DatasetError)) == [(1, {"a": 1}), (4, [2]), (5, "three")]
    with pytest.raises(DatasetError, match=r"good\.jsonl:4: a line must be a JSON object with id, got list"):
        list(jsonl_objects(good, DatasetError, expected="id"))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: not valid JSON: Expecting value") as caught:
        list(jsonl_objects(bad, DatasetError))
    assert isinstance(caught.value.__cause__, json.JSONDecodeError)

    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b'{"a": 1}\n\xff\xfe\n')
    with pytest.raises(DatasetError, match=r"b\.jsonl: not a UTF-8 text file \(one row a line\): .* at byte"):
        list(jsonl_values(binary, DatasetError, hint="one row a line"))


def test_bad_lines_go_to_on_bad_line_and_the_reading_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": \n\n{"a": 3}\n{"a"')
    bad: list[Exception] = []
    assert list(jsonl_values(path, DatasetError, on_bad_line=bad.append)) == [(1, {"a": 1}), (4, {"a": 3})]
    assert [type(e) for e in bad] == [DatasetError, DatasetError]
    assert str(bad[0]).startswith(f"{path}:2: not valid JSON") and isinstance(bad[0].__cause__, json.JSONDecodeError)
    assert str(bad[1]).startswith(f"{path}:5: the last line is cut off")
    binary = tmp_path / "b.jsonl"  # not text at all: no line of it is read, whatever on_bad_line does
    binary.write_bytes(b'{"a": 1}\n\xff\xfe\n')
    with pytest.raises(DatasetError, match="not a UTF-8 text file"):
        list(jsonl_values(binary, DatasetError, on_bad_line=bad.append))


def test_a_failed_trajectory_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    from prorl_cli.agent.trajectory import read_jsonl, write_jsonl

    path = write_jsonl(tmp_path / "t.jsonl", [{"job_id": "j1", "reward": 1.0}])
    rows = ({"job_id": f"j{i}", "reward": 1.0 if i < 2 else {1, 2}} for i in range(3))  # the third is not JSON
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        write_jsonl(path, rows)
    assert [r["job_id"] for r in read_jsonl(path)] == ["j1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
