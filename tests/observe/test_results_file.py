"""Reading a run's results file back: what cannot be read is named (file, line, field), never a bare traceback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from prorl_cli.observe.results import ResultsFileError, load_results
from prorl_cli.protocol import JobResult


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
    # The command it gives works when pasted into a shell, for a file whose name has a space too.
    spaced = tmp_path / "my run.jsonl"
    spaced.write_text("".join(lines) + lines[0][:25])
    with pytest.raises(ResultsFileError) as cut:
        load_results(spaced)
    command = str(cut.value).rpartition("(")[2].removesuffix(")")
    assert command.startswith("sed -i"), cut.value
    subprocess.run(command, shell=True, check=True)
    assert [r.job_id for r in load_results(spaced)] == ["j0", "j1", "j2"]
    # Once the cut line is dropped, as the message says, the rest reads.
    path.write_text("".join(lines))
    assert [r.job_id for r in load_results(path)] == ["j0", "j1", "j2"]


def _traj_results() -> list[JobResult]:
    traj = {"sequence_ids": [1, 2, 3], "loss_mask": [0, 0, 1], "logprobs": [0.0, 0.0, -0.5], "stop_reason": "stop"}
    return [
        JobResult(job_id="sub-0-0", task="t", state="done", attempt=2, node_id="n1", reward=1.0,
                  stage_s={"init": 0.25, "run": 1.5, "eval": 0.125}, active_s=1.875, output={"trajectory": traj},
                  group_id="sub-0", meta={"line": 0, "tags": ["a"]}, events=[["received", 0.0, 0.0]]),
        JobResult(job_id="sub-1-0", task="t", state="failed", attempt=1, node_id="n2", critical_error="run",
                  error={"stage": "run", "type": "ValueError", "message": "no"}, stage_s={"init": 0.5, "run": 0.75},
                  active_s=1.25, output={"trajectory": traj}, group_id=None, log_path="/tmp/sub-1-0.log"),
    ]


def test_parquet_results_keep_stage_times_attempt_group_and_error(tmp_path: Path) -> None:
    # What `prorl submit/results --out X.parquet` writes (collect.write_trajectories_parquet: these rows, this
    # writer), read back as report/trace/inspect read it: every figure of the result but the output as written.
    pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    from prorl_cli.agent.trajectory import write_parquet
    from prorl_cli.cli.jobs.collect import parquet_rows
    from prorl_cli.observe.report import stage_split

    results = _traj_results()
    path = tmp_path / "results.parquet"
    write_parquet(path, parquet_rows(results))
    loaded = load_results(path)
    assert [r.job_id for r in loaded] == [r.job_id for r in results]
    for got, want in zip(loaded, results, strict=True):
        got_wire, want_wire = got.to_wire(), want.to_wire()
        assert got.output["trajectory"]["sequence_ids"] == want.output["trajectory"]["sequence_ids"]
        got_wire.pop("output"), want_wire.pop("output")
        assert got_wire == want_wire
    assert stage_split(loaded) == stage_split(results)
    # Named otherwise (a shell's upper case, no suffix at all): still Parquet, by its magic bytes.
    for name in ("RESULTS.PARQUET", "results"):
        renamed = path.rename(tmp_path / name)
        assert [r.job_id for r in load_results(renamed)] == [r.job_id for r in results]
        path = renamed


def test_parquet_without_the_result_columns_still_loads(tmp_path: Path) -> None:
    # A file written before the result columns existed (or by write_parquet of bare trajectory rows), and a
    # file mixing rows with and without them (null cells): the missing figures take JobResult's defaults.
    pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    from prorl_cli.agent.trajectory import write_parquet
    from prorl_cli.cli.jobs.collect import parquet_rows

    full = parquet_rows(_traj_results())
    old = [{k: row[k] for k in ("job_id", "state", "reward", "trajectory", "task", "node_id", "events")} for row in full]
    path = tmp_path / "old.parquet"
    write_parquet(path, old)
    first, second = load_results(path)
    assert (first.stage_s, first.active_s, first.attempt, first.group_id, first.error) == ({}, 0.0, 1, None, None)
    assert second.state == "failed" and second.node_id == "n2"
    write_parquet(path, [full[0], old[1]])
    first, second = load_results(path)
    assert (first.stage_s, first.attempt, first.group_id) == ({"init": 0.25, "run": 1.5, "eval": 0.125}, 2, "sub-0")
    assert (second.stage_s, second.active_s, second.attempt, second.group_id, second.meta) == ({}, 0.0, 1, None, None)
