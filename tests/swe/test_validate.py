"""``prorl swe validate``: six real instances classified through real jobs, clean.jsonl written, a second run resumes.

The end-to-end test runs the command as a user does (a child ``prorl``
process starting its own broker and node, Apptainer sandboxes on the domain
test image, each instance's repository cloned in from this machine). The
flaky instance's test reads a folder every sandbox of the run shares (bound
in with ``sandbox.extra_args``): the runs take turns failing it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from prorl_cli.domains.datasets import load_instances
from prorl_cli.exceptions import DatasetError
from prorl_cli.swe.validate_run import Ledger, job_instance, plan_jobs, run_id_for, to_run
from prorl_cli.swe.validation import (
    DROP_ROW,
    ENV_BROKEN,
    F2P_PASSES,
    FLAKY,
    GOLD,
    GOLD_FAILS,
    NO_FIX,
    REMOVE_IDS,
    VALID,
    RunOutcome,
    classify,
    clean_row,
)
from tests.swe.validate_fixtures import EXPECTED, FLAKY_ID, SHARED_INSIDE, make_rows


def _result(job_id: str, state: str = "done", report: dict[str, Any] | None = None,
            failure: dict[str, str] | None = None) -> SimpleNamespace:
    output: dict[str, Any] = {"model_patch": "diff"}
    if report is not None:
        output["report"] = report
    if failure is not None:
        output["failure"] = failure
    return SimpleNamespace(job_id=job_id, state=state, output=output, stage_s={"init": 1.0}, error=None,
                           critical_error=None)


def _graded(passed: list[str], failed: list[str]) -> dict[str, Any]:
    status = {"FAIL_TO_PASS": {"success": passed, "failure": failed, "missing": []},
              "PASS_TO_PASS": {"success": [], "failure": [], "missing": []}}
    return {"patch_successfully_applied": True, "infra_failure": False, "tests_status": status}


def test_classes_follow_their_precedence_and_flaky_rows_lose_only_their_flaky_ids() -> None:
    inst = {"instance_id": "a-1", "FAIL_TO_PASS": ["t::f1", "t::f2"], "PASS_TO_PASS": []}
    ok = [RunOutcome.from_result(GOLD, k, _result(f"g{k}", report=_graded(["t::f1", "t::f2"], []))) for k in range(3)]
    base = RunOutcome.from_result(NO_FIX, 0, _result("n", report=_graded([], ["t::f1", "t::f2"])))
    assert classify(inst, ok, base).status == VALID

    wobbly = [*ok[:2], RunOutcome.from_result(GOLD, 2, _result("g2", report=_graded(["t::f1"], ["t::f2"])))]
    verdict = classify(inst, wobbly, base)
    assert verdict.status == FLAKY and verdict.flaky == ["t::f2"]
    kept = clean_row(inst, verdict, REMOVE_IDS)
    assert kept is not None and kept["FAIL_TO_PASS"] == ["t::f1"] and inst["FAIL_TO_PASS"] == ["t::f1", "t::f2"]
    assert clean_row(inst, classify(inst, wobbly, base), DROP_ROW) is None

    # A run that could not be evaluated makes the instance env-broken, whatever the other runs say.
    timed_out = RunOutcome.from_result(NO_FIX, 0, SimpleNamespace(
        job_id="n", state="timed_out", output={}, stage_s={}, error={"message": "job budget spent"}, critical_error="eval"))
    verdict = classify(inst, wobbly, timed_out)
    assert verdict.status == ENV_BROKEN and not verdict.evaluated and "job timed_out in eval" in verdict.reason
    # A gold patch that does not apply (RUN of swe_oracle failed) is the gold's fault, not the environment's.
    unapplied = RunOutcome.from_result(GOLD, 0, _result("g0", state="failed", failure={
        "stage": "run", "type": "DomainError", "message": "swe_oracle: the gold patch does not apply"}))
    verdict = classify(inst, [unapplied, *ok[1:]], base)
    assert verdict.status == GOLD_FAILS and "does not apply" in verdict.reason and clean_row(inst, verdict, REMOVE_IDS) is None
    # RUN out of time is the environment's doing, not the gold patch's.
    slow = RunOutcome.from_result(GOLD, 0, _result("g0", state="timed_out", failure={
        "stage": "run", "type": "StageTimeout", "message": "run took longer than 300 s"}))
    assert classify(inst, [slow, *ok[1:]], base).status == ENV_BROKEN


def test_a_listed_test_no_gold_run_produced_is_named_a_wrong_id_not_a_failing_fix() -> None:
    """A typo or a stale id in FAIL_TO_PASS: the gold fix is not what fails, the row's id is."""
    inst = {"instance_id": "a-3", "FAIL_TO_PASS": ["t::f1", "t::f_param"], "PASS_TO_PASS": []}
    missing = _graded(["t::f1"], ["t::f_param"])
    missing["missing"] = {"t::f_param": "t::f_param[a]"}
    gold = [RunOutcome.from_result(GOLD, k, _result(f"g{k}", report=missing)) for k in range(2)]
    base = RunOutcome.from_result(NO_FIX, 0, _result("n", report=_graded([], ["t::f1", "t::f_param"])))
    verdict = classify(inst, gold, base)
    assert verdict.status == GOLD_FAILS and verdict.never_ran == ["t::f_param"]
    assert "never ran in any gold run" in verdict.reason and "'t::f_param[a]'" in verdict.reason, verdict.reason
    # One that ran and failed is named first; the one that never ran is counted besides.
    really = _graded([], ["t::f1", "t::f_param"])
    really["missing"] = {"t::f_param": None}
    verdict = classify(inst, [RunOutcome.from_result(GOLD, k, _result(f"g{k}", report=really)) for k in range(2)], base)
    assert verdict.reason == "1 listed test(s) fail in every gold run, e.g. 't::f1'; 1 more never ran, e.g. 't::f_param'"


def test_a_run_not_graded_says_what_its_failing_step_printed_last() -> None:
    report = {"patch_successfully_applied": True, "infra_failure": True,
              "infra_failure_reason": "no_tests_collected", "grading_note": "the node-id plugin recorded no test",
              "infra_step": {"name": "tests", "exit": 127, "log_tail": "+ cd /repo\nenvironment: line 2: pytest: "
                                                                        "command not found\n\n"}}
    run = RunOutcome.from_result(GOLD, 0, _result("g0", report=report))
    assert not run.evaluated
    assert run.problem == ("infra_failure: no_tests_collected (step tests, exit 127), its log ends: "
                           "'environment: line 2: pytest: command not found'; the node-id plugin recorded no test")


def test_an_instance_without_fail_to_pass_tests_is_f2p_passes_though_its_runs_are_not_graded() -> None:
    """EVAL grades no run of an instance without FAIL_TO_PASS tests (``no_fail_to_pass``): its class says why."""
    inst = {"instance_id": "a-2", "FAIL_TO_PASS": [], "PASS_TO_PASS": ["t::p"]}
    ungraded = {"patch_successfully_applied": True, "infra_failure": True, "infra_failure_reason": "no_fail_to_pass",
                "tests_status": {}}
    gold = [RunOutcome.from_result(GOLD, k, _result(f"g{k}", report=ungraded)) for k in range(3)]
    verdict = classify(inst, gold, RunOutcome.from_result(NO_FIX, 0, _result("n", report=ungraded)))
    assert verdict.status == F2P_PASSES and "FAIL_TO_PASS is empty" in verdict.reason, verdict
    assert clean_row(inst, verdict, REMOVE_IDS) is None


def test_the_ledger_skips_a_line_cut_short_and_reruns_cancelled_and_on_request_unevaluated_runs(tmp_path: Path) -> None:
    from prorl_cli.protocol import JobResult

    out = tmp_path / "out"
    run_id = run_id_for(out, tmp_path / "d.jsonl")
    assert run_id_for(out, tmp_path / "d.jsonl") == run_id
    ok = JobResult(job_id="", task="swe_oracle", state="done", output={"report": _graded(["t::f"], [])})
    jobs = plan_jobs([{"instance_id": "a-1", "FAIL_TO_PASS": ["t::f"]}], 1, run_id)
    gold, no_fix = jobs
    ledger = Ledger(out)
    ledger.add(JobResult(**{**ok.to_wire(), "job_id": gold.job_id}))
    ledger.add(JobResult(job_id=no_fix.job_id, task="swe_no_fix", state="cancelled"))
    with ledger.path.open("a") as f:
        f.write('{"job_id": "j3", "task": "swe_o')  # a kill in mid-write
    again = Ledger(out)
    assert again.unreadable == 1
    # The cancelled run gets a new attempt's id (a broker answers a known id with the cancelled job).
    assert to_run(jobs, again, retry_not_evaluated=False) == [(no_fix, f"{no_fix.job_id}-a2")]
    again.add(JobResult(job_id=f"{no_fix.job_id}-a2", task="swe_no_fix", state="timed_out"))  # not glued to the cut
    third = Ledger(out)
    assert third.latest(no_fix)[0] is not None and third.latest(no_fix)[0].state == "timed_out"  # type: ignore[union-attr]
    assert to_run(jobs, third, retry_not_evaluated=False) == []
    assert to_run(jobs, third, retry_not_evaluated=True) == [(no_fix, f"{no_fix.job_id}-a3")]



def _validate(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PRORL_DEPLOYMENT", "PRORL_CONFIG")}
    env["PRORL_HOME"] = str(root / "home")
    return subprocess.run([sys.executable, "-m", "prorl_cli", "--config", str(root / "prorl.yaml"), "swe", "validate",
                           str(root / "dataset.jsonl"), "--out", str(root / "out"), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=root, start_new_session=True)


@pytest.mark.apptainer
@pytest.mark.slow
def test_validate_classifies_six_instances_writes_clean_rows_and_resumes(tmp_path: Path, domain_image: str) -> None:
    rows = make_rows(tmp_path / "repos")
    # As SWE-bench ships them: the test lists as JSON strings (the loader makes them lists).
    shipped = [{**r, "FAIL_TO_PASS": json.dumps(r["FAIL_TO_PASS"]), "PASS_TO_PASS": json.dumps(r["PASS_TO_PASS"])}
               for r in rows]
    (tmp_path / "dataset.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shipped))
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "prorl.yaml").write_text(yaml.safe_dump({
        "sandbox": {"runtime": "apptainer", "image": domain_image, "extra_args": ["--bind", f"{shared}:{SHARED_INSIDE}"]},
        "handlers": {"swe": {"image": domain_image}}}))

    first = _validate(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr[-5000:]
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    assert {r["instance_id"]: r["status"] for r in report["results"]} == EXPECTED, json.dumps(report, indent=1)[-6000:]
    by_id = {r["instance_id"]: r for r in report["results"]}
    assert by_id["prorl__tinycalc-gold-fails"]["gold_failures"] == ["tests/test_calc.py::test_add"]
    assert by_id["prorl__tinycalc-f2p-passes"]["passes_without_fix"] == ["tests/test_calc.py::test_add"]
    assert by_id["prorl__tinycalc-flaky"]["flaky"] == [FLAKY_ID]
    # Not evaluated is said, with the step, for every run; nothing is scored.
    broken = by_id["prorl__tinycalc-env-broken"]
    assert report["not_evaluated"] == ["prorl__tinycalc-env-broken"] and not broken["evaluated"]
    assert all("setup_failed" in r["problem"] and "install[0]" in r["problem"] for r in broken["runs"])
    assert all(r["evaluated"] for i, v in by_id.items() if i != "prorl__tinycalc-env-broken" for r in v["runs"])
    assert report["counts"] == {"valid": 2, "flaky": 1, "f2p-passes-without-fix": 1, "gold-fails": 1, "env-broken": 1,
                                "pending": 0}

    clean = [json.loads(line) for line in (out / "clean.jsonl").read_text().splitlines()]
    assert [c["instance_id"] for c in clean] == ["prorl__tinycalc-valid", "prorl__tinycalc-flaky", "prorl__spacey-flat-1"]
    assert FLAKY_ID not in clean[1]["PASS_TO_PASS"] and clean[1]["FAIL_TO_PASS"] == rows[4]["FAIL_TO_PASS"]
    assert clean[2]["FAIL_TO_PASS"] == rows[5]["FAIL_TO_PASS"]  # ids with spaces and brackets, as listed
    assert all("settings" not in c for c in clean)  # the rows as read, not as the jobs got them
    page = (out / "report.html").read_text()
    assert all(f"<td>{iid}</td>" in page for iid in EXPECTED) and "f2p-passes-without-fix" in page

    # Cut short: two results of the valid instance lost, and a line half written. The second run runs those two only.
    run_id = json.loads((out / "validate.json").read_text())["run_id"]
    valid_row = load_instances("swe", tmp_path / "dataset.jsonl")[0]
    lost = {j.job_id for j in plan_jobs([job_instance(valid_row, {})[0]], 3, run_id) if j.kind == NO_FIX or j.k == 0}
    ledger = out / "results.jsonl"
    kept = [line for line in ledger.read_text().splitlines() if json.loads(line)["job_id"] not in lost]
    assert len(kept) == 22
    ledger.write_text("".join(line + "\n" for line in kept) + '{"job_id": "cut')
    runs_of_flaky_test = len(list(shared.iterdir()))
    second = _validate(tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr[-5000:]
    assert "22 already have a result" in second.stderr and "1 unreadable line(s)" in second.stderr
    rerun = [json.loads(line)["job_id"] for line in ledger.read_text().splitlines()[23:]]
    assert sorted(rerun) == sorted(lost)
    assert len(list(shared.iterdir())) == runs_of_flaky_test == 4  # the flaky instance's jobs were not run again
    again = json.loads((out / "report.json").read_text())
    assert {r["instance_id"]: r["status"] for r in again["results"]} == EXPECTED


def test_bad_flags_are_refused_and_an_instance_without_image_is_env_broken_unrun(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from prorl_cli.cli import cli

    row = {"instance_id": "org__a-1", "repo": "org/a", "version": "1", "base_commit": "abc", "problem_statement": "p",
           "patch": "diff", "test_patch": "", "FAIL_TO_PASS": ["t.py::a"], "PASS_TO_PASS": []}
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps(row) + "\n")
    images = tmp_path / "repo_images.json"
    images.write_text(json.dumps({"other/repo": "/images/other.sif"}))
    runner = CliRunner()
    both = runner.invoke(cli, ["swe", "validate", str(dataset), "--base", "docker://x", "--images-from", "docker://y"])
    assert both.exit_code == 1 and "not both" in both.output
    out = tmp_path / "out"
    # No job is submitted (no deployment is started): the map has no image for the only instance.
    done = runner.invoke(cli, ["swe", "validate", str(dataset), "--repo-images", str(images), "--out", str(out)])
    assert done.exit_code == 0, done.output
    report = json.loads((out / "report.json").read_text())
    (result,) = report["results"]
    assert result["status"] == ENV_BROKEN and result["reason"].startswith("no image") and not result["evaluated"]
    assert report["not_evaluated"] == ["org__a-1"] and (out / "clean.jsonl").read_text() == ""
    assert not (out / "deployment").exists()


def test_an_instance_whose_settings_are_not_a_map_is_refused_by_name_before_any_job(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from prorl_cli.cli import cli

    row = {"instance_id": "org__a-1", "repo": "org/a", "version": "1", "base_commit": "abc", "problem_statement": "p",
           "patch": "diff", "test_patch": "", "FAIL_TO_PASS": ["t.py::a"], "PASS_TO_PASS": [], "settings": ["ab"]}
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps(row) + "\n")
    out = tmp_path / "out"
    done = CliRunner().invoke(cli, ["swe", "validate", str(dataset), "--out", str(out)])
    # Not read as the map {"a": "b"} (nor a bare ValueError for a string): the row and the field are named.
    assert done.exit_code == 1 and "org__a-1" in done.output and "'settings' must be a map" in done.output, done.output
    assert not (out / "deployment").exists() and not (out / "results.jsonl").exists()
    with pytest.raises(DatasetError, match="'settings' must be a map"):
        job_instance({**row, "settings": "fast"}, {"org/a": "/images/a.sif"})


class _RepoGone:
    """A sandbox whose gold patch applies but whose repository then cannot be diffed (a broken work tree)."""

    async def write_file(self, path: str, data: bytes) -> None:
        pass

    async def bash(self, command: str) -> SimpleNamespace:
        if "git diff" in command:
            return SimpleNamespace(exit_code=128, output="fatal: not a git repository")
        return SimpleNamespace(exit_code=0, output="")


def test_a_gold_run_whose_repository_cannot_be_diffed_is_env_broken_not_gold_fails() -> None:
    import asyncio

    from prorl_cli.handlers.swe_domain import SweOracleHandler

    inst = {"instance_id": "a-1", "base_commit": "abc", "patch": "diff --git a/x b/x", "FAIL_TO_PASS": ["t::f"],
            "PASS_TO_PASS": []}
    ctx = SimpleNamespace(settings=SweOracleHandler.defaults, instance=inst, sandbox=_RepoGone(), output={})
    with pytest.raises(Exception) as raised:  # whichever type: what validate makes of it is the point
        asyncio.run(SweOracleHandler().run(ctx))  # type: ignore[arg-type]
    failure = {"stage": "run", "type": type(raised.value).__name__, "message": str(raised.value)}
    broken = RunOutcome.from_result(GOLD, 0, _result("g0", state="failed", failure=failure))
    ok = [RunOutcome.from_result(GOLD, k, _result(f"g{k}", report=_graded(["t::f"], []))) for k in (1, 2)]
    base = RunOutcome.from_result(NO_FIX, 0, _result("n", report=_graded([], ["t::f"])))
    verdict = classify(inst, [broken, *ok], base)
    assert verdict.status == ENV_BROKEN and "git diff" in verdict.reason, verdict
