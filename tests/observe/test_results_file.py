"""Reading a run's results file back: what cannot be read is named (file, line, field), never a bare traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorl_cli.observe.results import ResultsFileError, load_results


def test_a_field_that_is_not_json_names_the_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    good = {"job_id": "j1", "task": "t", "state": "done", "events": json.dumps([["received", 0.0, 0.0]])}
    bad = {"job_id": "j2", "task": "t", "state": "done", "events": "[['received', 0.0"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ResultsFileError, match=r"results\.jsonl:2: field 'events' is not JSON"):
        load_results(path)
    path.write_text(json.dumps(good) + "\n")
    (result,) = load_results(path)
    assert result.events == [["received", 0.0, 0.0]]
