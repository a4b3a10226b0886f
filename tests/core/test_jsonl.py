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
