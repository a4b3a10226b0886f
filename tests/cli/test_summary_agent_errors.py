"""The summary of ``prorl submit`` / ``prorl results`` tells a job whose agent ended in an error (an agent harness
that exited non-zero) from a clean run, though both ended done and were scored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prorl_cli.cli.application import App
from prorl_cli.cli.jobs.collect import print_summary
from prorl_cli.observe.failures import agent_error_key, group_failures
from prorl_cli.protocol import JobResult


def _result(job_id: str, state: str, stop_reason: str | None, error: dict[str, Any] | None = None) -> JobResult:
    trajectory = {"calls": [], "stop_reason": stop_reason, "error": error}
    return JobResult(job_id=job_id, task="harness", state=state, reward=0.0,
                     output={"trajectory": trajectory, "stop_reason": stop_reason})


def _exited(code: int) -> dict[str, Any]:
    return {"call": 2, "type": "HarnessExited", "message": f"the harness exited with code {code}"}


def test_done_jobs_whose_agent_ended_in_an_error_are_grouped_apart() -> None:
    results = [
        _result("clean", "done", "stop"),
        _result("crash-1", "done", "error", _exited(3)),
        _result("crash-2", "done", "error", _exited(3)),
        _result("crash-3", "done", "error", _exited(1)),
        _result("slow", "done", "timeout"),  # a harness killed at its timeout_s: scored, but cut off
        _result("long", "done", "length"),  # a rollout cut at the model's length: a normal end
        _result("killed", "cancelled", "cancelled"),
        _result("failed", "failed", "error", _exited(3)),  # a failure: told under "why jobs did not finish"
        JobResult(job_id="no-trajectory", task="math_agent", state="done", output={"answer": 1}),
    ]
    groups = group_failures(results, key=agent_error_key)
    assert [g.describe() for g in groups] == [
        "2 job(s) in run: HarnessExited: the harness exited with code 3 (e.g. crash-1)",
        "1 job(s) in run: HarnessExited: the harness exited with code 1 (e.g. crash-3)",
        "1 job(s) in run: timeout: the agent ran past its time limit and was stopped (its timeout_s) (e.g. slow)",
    ]


def test_the_summary_lists_them_under_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    app = App(None, {})
    results = [_result("clean", "done", "stop"), _result("crash", "done", "error", _exited(3))]
    print_summary(app, results, 1.0, Path("out.jsonl"))
    err = [line.strip() for line in capsys.readouterr().err.splitlines()]
    heading = err.index(next(line for line in err if line.startswith("done, but the agent ended in an error")))
    assert err[heading + 1] == "1 job(s) in run: HarnessExited: the harness exited with code 3 (e.g. crash)", err
    assert not any("why jobs did not finish" in line for line in err), err  # none failed
