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


def test_a_results_file_cut_off_mid_line_says_so_and_how_to_read_the_rest(tmp_path: Path) -> None:
    # What `prorl results --out` killed with SIGKILL in the middle of a write leaves: whole lines, then half of one.
    path = tmp_path / "results.jsonl"
    lines = [json.dumps({"job_id": f"j{i}", "task": "t", "state": "done", "reward": 1.0}) + "\n" for i in range(3)]
    path.write_text("".join(lines) + lines[0][:25])
    with pytest.raises(ResultsFileError, match=r"results\.jsonl:4: the last line is cut off .*the 3 line\(s\) before it "
                                               r"are whole: drop the last line"):
        load_results(path)
    path.write_text("".join(lines[:2]) + "\n" + lines[0][:25])  # a blank line between: still the last line
    with pytest.raises(ResultsFileError, match=r"the last line is cut off .*the 2 line\(s\) before it are whole"):
        load_results(path)
    # A whole line that is not JSON is not "cut off", wherever it is; nor is a field that is not JSON.
    path.write_text("".join(lines) + "{not json\n")
    with pytest.raises(ResultsFileError, match=r"results\.jsonl:4: not valid JSON"):
        load_results(path)
    path.write_text(json.dumps({"job_id": "j", "task": "t", "state": "done", "events": "[["}))
    with pytest.raises(ResultsFileError, match=r"results\.jsonl:1: field 'events' is not JSON"):
        load_results(path)
    # Once the cut line is dropped, as the message says, the rest reads.
    path.write_text("".join(lines))
    assert [r.job_id for r in load_results(path)] == ["j0", "j1", "j2"]
