"""``prorl eval`` as a researcher runs it: a child ``prorl`` process against a real broker and node.

The node serves ``scripted_swe`` (tests/cli/eval_handlers.py, a subclass of swe with no sandbox and no
model), so the command's own path is what is tested: submit, collect, the interrupt, a resumed run under
the same ``--run-id``, the files and the words at the end.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.domains.datasets import load_instances
from prorl_cli.swe.evaluation import job_ids
from tests.harness import Deployment, kill_if_running, one_node_deployment

HANDLERS = str(Path(__file__).with_name("eval_handlers.py"))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from one_node_deployment(tmp_path_factory, "evalruns", node_args=("--handlers", HANDLERS))


def _row(iid: str, script: dict[str, Any]) -> dict[str, Any]:
    return {"instance_id": iid, "repo": "org/r", "version": "1", "base_commit": "a" * 40, "problem_statement": "fix it",
            "patch": "diff", "test_patch": "diff", "FAIL_TO_PASS": ["t.py::a"], "PASS_TO_PASS": [], "script": script}


def _dataset(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eval(deployment: Deployment, *args: str | Path) -> list[str]:
    return [sys.executable, "-m", "prorl_cli", "-d", deployment.name, "eval", "--task", "scripted_swe",
            *map(str, args)]


def test_an_interrupted_run_resumes_under_its_run_id_and_runs_only_the_cancelled_job_again(
        deployment: Deployment, tmp_path: Path) -> None:
    gate, journal = tmp_path / "gate", tmp_path / "journal"
    gate.touch()
    journal.mkdir()
    rows = [_row("org__a-1", {"resolved": [0, 1], "journal": str(journal)}),
            _row("org__b-2", {"resolved": [1], "hold": [1], "gate": str(gate), "journal": str(journal)})]
    dataset = _dataset(tmp_path / "ds.jsonl", rows)
    out = tmp_path / "out"
    ids = job_ids("exp1", load_instances("swe", dataset, "auto"), 2)
    cmd = _eval(deployment, dataset, "--n", "2", "--run-id", "exp1", "--out", out)
    proc = subprocess.Popen(cmd, env=deployment.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        # The first progress line comes once the jobs are in; three samples end, and the fourth waits at its
        # gate until the run is interrupted.
        assert proc.stderr is not None
        first = next((line for line in iter(proc.stderr.readline, "") if " ended" in line or line.startswith("error")),
                     "(stderr closed)")
        assert " ended" in first, first
        ended = deployment.client.wait(ids[:3], timeout_s=60)
        assert [r.state for r in ended] == ["done"] * 3
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 130, err
    # The message names the run id and the command that resumes it; nothing half-written is left.
    assert "--run-id exp1" in err and "resumes" in err, err
    assert not out.exists()

    gate.unlink()
    again = subprocess.run(cmd, env=deployment.env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "3 job(s) of an earlier run taken as they are" in again.stderr and "1 it cancelled run again" in again.stderr
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(s["instance_id"], s["sample"], s["state"], s["resolved"]) for s in samples] == [
        ("org__a-1", 0, "done", True), ("org__a-1", 1, "done", True),
        ("org__b-2", 0, "done", False), ("org__b-2", 1, "done", True)]
    assert samples[3]["job_id"] == ids[3] + "-a2"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resolved_ids"] == ["org__a-1"] and summary["error_ids"] == []
    assert summary["pass_at_k"] == {"1": pytest.approx(0.75), "2": pytest.approx(1.0)}
    # The three samples that had ended ran once: only the cancelled one ran again.
    runs = (journal / "runs.log").read_text().split()
    assert sorted(runs) == sorted([*ids, ids[3] + "-a2"])


def test_samples_that_did_not_finish_are_said_counted_and_exit_1(deployment: Deployment, tmp_path: Path) -> None:
    rows = [_row("org__a-1", {"resolved": [0, 1]}), _row("org__c-3", {"resolved": [0], "raise": [1]})]
    out = tmp_path / "out"
    got = subprocess.run(_eval(deployment, _dataset(tmp_path / "ds.jsonl", rows), "--n", "2", "--out", out),
                         env=deployment.env(), capture_output=True, text=True, timeout=120)
    assert got.returncode == 1, got.stderr
    assert "1 sample(s) did not finish (failed 1): counted as unresolved in the resolved rate and pass@k" in got.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pass_at_k"]["2"] == pytest.approx(1.0) and summary["pass_at_k"]["1"] == pytest.approx(0.75)
    assert f"pass@1 {summary['pass_at_k']['1']:.3f}" in got.stdout


def test_a_second_run_into_the_same_folder_leaves_no_report_of_the_first(deployment: Deployment, tmp_path: Path) -> None:
    rows = [_row("org__a-1", {"resolved": [0]}), _row("org__b-2", {"resolved": []})]
    dataset = _dataset(tmp_path / "ds.jsonl", rows)
    out = tmp_path / "out"
    first = subprocess.run(_eval(deployment, dataset, "--out", out), env=deployment.env(), capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (out / "reports").iterdir()) == ["org__a-1.json", "org__b-2.json"]
    second = subprocess.run(_eval(deployment, dataset, "--out", out, "--instance-id", "org__b-2"), env=deployment.env(),
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "removed 2 report/details file(s) of instances not in this run" in second.stderr
    for folder in ("reports", "details"):
        assert [p.name for p in (out / folder).iterdir()] == ["org__b-2.json"]
    assert json.loads((out / "summary.json").read_text())["total_instances"] == 1


def test_attempt_ids_take_the_latest_attempt_and_follow_a_cancelled_one() -> None:
    from prorl_cli.swe.evaluation import attempt_ids

    held = {"r-x-0": "done", "r-x-1": "cancelled", "r-x-2": "cancelled", "r-x-2-a2": "failed",
            "r-x-3": "cancelled", "r-x-3-a2": "cancelled"}
    ids, again = attempt_ids(["r-x-0", "r-x-1", "r-x-2", "r-x-3", "r-x-4"], held)
    assert ids == ["r-x-0", "r-x-1-a2", "r-x-2-a2", "r-x-3-a3", "r-x-4"] and again == 2
