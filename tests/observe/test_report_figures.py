"""The figures of `prorl report` and `prorl inspect` computed from a results file, each against a hand-worked value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.observe.inspect import call_views, trajectory_of
from prorl_cli.observe.report import stage_split
from prorl_cli.observe.results import load_results


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_queue_time_of_a_requeued_job_counts_each_wait_once(tmp_path: Path) -> None:
    # As the broker writes them: assigned at 1 s, its node lost at 10 s, assigned again at 12 s.
    requeued = {"job_id": "j1", "task": "t", "state": "done", "attempt": 2, "stage_s": {"run": 4.0}, "events": [
        ["submitted", 0.0, 0.0, {"at": 1.7e9}],
        ["assigned", 1.0, 0.0, {"node": "n1", "attempt": 1}],
        ["requeued", 10.0, 0.0, {"node": "n1", "why": "lost"}],
        ["assigned", 12.0, 0.0, {"node": "n2", "attempt": 2}],
        ["stage", 12.5, 4.0, {"stage": "run"}],
    ]}
    plain = {"job_id": "j2", "task": "t", "state": "done", "stage_s": {"run": 2.0}, "events": [
        ["submitted", 0.0, 0.0, {"at": 1.7e9}],
        ["assigned", 5.0, 0.0, {"node": "n1", "attempt": 1}],
        ["wait", 5.1, 0.5, {"stage": "run"}],
        ["stage", 5.6, 2.0, {"stage": "run"}],
    ]}
    split = stage_split(load_results(_write(tmp_path / "results.jsonl", [requeued, plain])))
    # Queue: (1 + 2) s for j1 and 5 s for j2, a mean of 4 s (not (1 + 12 + 5) / 2 = 9).
    assert split["t"]["queue"] == pytest.approx(4.0)
    assert split["t"]["wait run"] == pytest.approx(0.25)
    assert split["t"]["run"] == pytest.approx(3.0)


def test_the_least_likely_token_is_named_by_its_own_position(tmp_path: Path) -> None:
    # An engine's log-probs with a token it gave no chance (-inf) and one it did not report (NaN), as
    # `prorl submit --out` writes them (json.dumps: -Infinity, NaN).
    calls = [
        {"prompt_ids": [1, 2], "output_ids": [5, 6, 7], "logprobs": [-0.1, float("-inf"), -0.5], "text": "a"},
        {"prompt_ids": [1, 2, 5, 6, 7, 9], "output_ids": [8, 9, 10], "logprobs": [float("nan"), -0.1, -2.0], "text": "b"},
    ]
    row = {"job_id": "j", "task": "t", "state": "done", "output": {"trajectory": {"calls": calls}}}
    (result,) = load_results(_write(tmp_path / "results.jsonl", [row]))
    traj = trajectory_of(result)
    assert traj is not None
    first, second = call_views(traj)
    assert (first.logprob_min, first.min_at, first.logprob_mean) == (float("-inf"), 1, float("-inf"))
    # NaN is left out of the summary, and the positions stay those of the output tokens.
    assert (second.logprob_min, second.min_at) == (-2.0, 2)
    assert second.logprob_mean == pytest.approx(-1.05)


def test_the_job_table_links_the_shown_trajectories_without_comparing_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("matplotlib", reason="the report needs matplotlib (pip install 'prorl[observe]')")
    from prorl_cli.observe.report import render_html
    from prorl_cli.protocol import JobResult

    rows = [{"job_id": f"j{i}", "task": "t", "state": "done", "reward": 1.0} for i in range(5)]
    results = load_results(_write(tmp_path / "results.jsonl", rows))

    def no_comparison(self: JobResult, other: object) -> bool:
        # Comparing every job with every shown one is quadratic: minutes on a run of a million jobs.
        raise AssertionError("the report compared two results")

    monkeypatch.setattr(JobResult, "__eq__", no_comparison)
    page = render_html(results, "run", max_trajectories=2)
    assert [f"href='#job-j{i}'" in page for i in range(5)] == [True, True, False, False, False]
    assert "the first 2 of 5 (--max-trajectories)" in page


def test_report_of_results_without_task_or_timelines_says_so_without_warnings(tmp_path: Path) -> None:
    # A trajectories file names no task and a job that never ran has no timeline: each plot says what it lacks
    # (not an empty frame) and matplotlib prints nothing on stderr (it warned of legends with no labelled line).
    results = _write(tmp_path / "results.jsonl", [
        {"job_id": "x1", "state": "done", "reward": 1.0},
        {"job_id": "x2", "state": "failed", "error": {"stage": "init", "type": "E", "message": "m\nmore"}},
    ])
    page = tmp_path / "report.html"
    out = subprocess.run([sys.executable, "-m", "prorl_cli", "report", str(results), "--html", str(page)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONWARNINGS": "default"})
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr
    assert "2 job(s) -> " in out.stdout
