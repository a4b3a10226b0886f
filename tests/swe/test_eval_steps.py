"""No silent zero: EVAL's run script survives a step that is not shell, and a run that is no evidence is not graded.

The run script, its step files and the grader run here on this host's bash
and python3 against the ``spacey`` repository, as they run inside the EVAL
sandbox. swebench's own ``get_resolution_status`` is asked about every
report: it must agree with prorl's ``resolved``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.swe.evalrun import (
    Step,
    StepOutcome,
    plan_steps,
    read_steps,
    run_script,
    support_files,
)
from prorl_cli.swe.grading import SweReport, grade_run
from prorl_cli.swe.testplan import plan_tests
from tests.harness import need_module
from tests.swe.spacey import FAIL_TO_PASS, FILE, PAIRS_FIXED, PASS_TO_PASS, Spacey, make_spacey

#: The user's instance as shipped: prose in `install`, with parentheses bash cannot parse.
PROSE = "Install the package in editable mode (pip install -e .) and make sure numpy is available."


@pytest.fixture
def spacey(tmp_path: Path) -> Spacey:
    need_module("swebench", "swe")
    return make_spacey(tmp_path / "spacey")


def _run(repo: Spacey, work: Path, patch: str | None = None, **extra: Any) -> tuple[SweReport, str]:
    """Apply the patch and the test patch, run the plan's steps as EVAL does, grade the run; returns the log too."""
    work.mkdir(parents=True, exist_ok=True)
    instance = {**repo.instance, **extra}
    patch = repo.instance["patch"] if patch is None else patch
    plan = plan_tests(instance, {}, instance["FAIL_TO_PASS"], instance["PASS_TO_PASS"])
    for name, text in (("model.patch", patch), ("test.patch", "" if plan.applies_test_patch else instance["test_patch"])):
        if text:
            (work / name).write_text(text)
            subprocess.run(["git", "-C", str(repo.path), "apply", str(work / name)], check=True)
    for path, data in support_files(str(work)).items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    (work / "nodeids.jsonl").write_text("")
    (work / "steps.txt").write_text("")
    (work / "run.sh").write_text(run_script(plan, str(repo.path), str(work)))
    log = subprocess.run(["bash", str(work / "run.sh")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=120).stdout  # as in the sandbox: `bash run.sh > test.log 2>&1`
    steps = read_steps(plan_steps(plan), (work / "steps.txt").read_text(), log, timed_out=False)
    report = grade_run(plan, instance, instance["FAIL_TO_PASS"], instance["PASS_TO_PASS"], log,
                       (work / "nodeids.jsonl").read_text(), steps)
    return report, log


def _swebench_agrees(report: SweReport) -> None:
    """swebench's own verdict on prorl's tests_status is prorl's ``resolved``."""
    from swebench.harness.grading import get_resolution_status

    assert (get_resolution_status(report.tests_status) == "RESOLVED_FULL") == report.resolved, report.tests_status
    body = report.swebench()
    assert body["resolved"] == report.resolved and body["infra_failure"] == report.infra_failure


def test_prose_install_as_shipped_fails_its_step_alone_and_the_run_is_not_graded(spacey: Spacey, tmp_path: Path) -> None:
    report, log = _run(spacey, tmp_path / "w", install=[PROSE, "echo second"])
    assert report.infra_failure and not report.resolved
    assert report.infra_failure_reason == "step_syntax_error"
    step = report.infra_step
    assert step is not None and step["name"] == "install[0]" and step["source"] == "instance install"
    assert step["status"] == "syntax" and step["exit"] == 2
    assert "syntax error near unexpected token `('" in step["log_tail"]
    assert "install[0]" in report.grading_note and "not graded" in report.grading_note
    # The script did not die: it recorded the step and stopped before the tests, on purpose.
    assert [(s["name"], s["status"]) for s in report.steps] == [
        ("install[0]", "syntax"), ("install[1]", "not_run"), ("tests", "not_run")]
    assert "prorl step 0 exit 2" in log
    # Every listed test is missing, and a failure in swebench's own lists: swebench says not resolved too.
    assert sorted(report.missing) == sorted(FAIL_TO_PASS + PASS_TO_PASS)
    assert sorted(report.tests_status["FAIL_TO_PASS"]["failure"]) == sorted(FAIL_TO_PASS)
    _swebench_agrees(report)
    assert report.swebench()["infra_failure_reason"] == "step_syntax_error"


def test_an_install_step_that_exits_non_zero_stops_the_run_with_its_status(spacey: Spacey, tmp_path: Path) -> None:
    report, _ = _run(spacey, tmp_path / "w", install="echo 'cannot reach the index' >&2; exit 3")
    assert report.infra_failure and report.infra_failure_reason == "setup_failed"
    assert report.infra_step is not None and report.infra_step["exit"] == 3
    assert "cannot reach the index" in report.infra_step["log_tail"]
    assert report.steps[-1]["status"] == "not_run"
    _swebench_agrees(report)


def test_steps_share_exported_variables_start_in_the_repository_and_keep_text_verbatim(
        spacey: Spacey, tmp_path: Path) -> None:
    out = tmp_path / "written.txt"
    tricky = f"cat > {out} <<'EOF'\nit's $HOME, `kept` \\ verbatim\nPRORL_EOF_0\nEOF\n"
    command = f'test "$SPACEY_FLAG" = on && test "$PWD" = {spacey.path} && python3 -m pytest -rA -p no:cacheprovider'
    report, _ = _run(spacey, tmp_path / "w", install=["export SPACEY_FLAG=on; cd /", tricky], test_command=command)
    assert out.read_text() == "it's $HOME, `kept` \\ verbatim\nPRORL_EOF_0\n"
    assert report.resolved and not report.infra_failure, report
    assert [s["status"] for s in report.steps] == ["ok", "ok", "ok"]
    assert all(isinstance(s["seconds"], float) for s in report.steps)
    _swebench_agrees(report)


def test_resolved_and_unresolved_runs_agree_with_swebench(spacey: Spacey, tmp_path: Path) -> None:
    resolved, _ = _run(spacey, tmp_path / "gold")
    assert resolved.resolved and resolved.status == "RESOLVED_FULL" and not resolved.infra_failure
    _swebench_agrees(resolved)
    subprocess.run(["git", "-C", str(spacey.path), "checkout", "-q", "-f", spacey.instance["base_commit"]], check=True)
    subprocess.run(["git", "-C", str(spacey.path), "clean", "-fdq"], check=True)
    unresolved, _ = _run(spacey, tmp_path / "none", patch="")
    assert not unresolved.resolved and not unresolved.infra_failure
    _swebench_agrees(unresolved)
    subprocess.run(["git", "-C", str(spacey.path), "checkout", "-q", "-f", spacey.instance["base_commit"]], check=True)
    subprocess.run(["git", "-C", str(spacey.path), "clean", "-fdq"], check=True)
    ghost = f"{FILE}::test_parse_pair[a = c]"
    one_missing, _ = _run(spacey, tmp_path / "ghost", PASS_TO_PASS=[*PASS_TO_PASS, ghost])
    assert not one_missing.resolved and not one_missing.infra_failure  # the others ran: evidence, unresolved
    assert ghost in one_missing.tests_status["PASS_TO_PASS"]["failure"]
    _swebench_agrees(one_missing)


@pytest.mark.parametrize("eval_type", ["pass_and_fail", "fail_only"])
def test_a_run_that_collects_no_listed_test_is_not_graded(spacey: Spacey, tmp_path: Path, eval_type: str) -> None:
    report, _ = _run(spacey, tmp_path / "w", test_command="echo 'tests? what tests?'", eval_type=eval_type)
    assert report.infra_failure and report.infra_failure_reason == "no_tests_collected" and not report.resolved
    assert report.infra_step is not None and report.infra_step["name"] == "tests" and report.infra_step["exit"] == 0
    assert "what tests" in report.infra_step["log_tail"]
    # Under fail_only swebench would count the absent tests as passing; in a run that is no evidence they fail.
    assert sorted(report.tests_status["FAIL_TO_PASS"]["failure"]) == sorted(FAIL_TO_PASS)
    _swebench_agrees(report)


def test_a_broken_import_in_the_patch_is_graded_not_excused(spacey: Spacey, tmp_path: Path) -> None:
    # The patch breaks collection of the test files: pytest records the errors, so the run is evidence: 0, not None.
    pairs = spacey.path / "spacey" / "pairs.py"
    pairs.write_text(PAIRS_FIXED + "\nimport nonexistent_module\n")
    broken = subprocess.run(["git", "-C", str(spacey.path), "diff"], capture_output=True, text=True, check=True).stdout
    subprocess.run(["git", "-C", str(spacey.path), "checkout", "-q", "--", "."], check=True)
    report, _ = _run(spacey, tmp_path / "w", patch=broken)
    assert report.collect_errors and not report.infra_failure and not report.resolved, report
    _swebench_agrees(report)


def test_an_eval_script_that_is_not_shell_is_an_infra_failure(spacey: Spacey, tmp_path: Path) -> None:
    report, _ = _run(spacey, tmp_path / "w", eval_script="Run the tests (all of them) with pytest")
    assert report.infra_failure and report.infra_failure_reason == "step_syntax_error"
    assert report.infra_step is not None and report.infra_step["name"] == "tests"
    _swebench_agrees(report)


def _outcomes(*statuses: tuple[str, str, int | None]) -> list[StepOutcome]:
    return [StepOutcome(f"{kind}-{i}", "instance install", kind, status, code)
            for i, (kind, status, code) in enumerate(statuses)]


def test_a_setup_step_cut_at_the_time_limit_is_an_infra_failure_and_a_test_step_is_not(spacey: Spacey) -> None:
    instance = spacey.instance
    plan = plan_tests({**instance, "install": "sleep 1000"}, {}, FAIL_TO_PASS, PASS_TO_PASS)
    steps = plan_steps(plan)
    # The records of a run cut while its install step ran: a start, no end.
    outcomes = read_steps(steps, "0 start 10.5\n", ">>>>> prorl step 0 start\nworking...\n", timed_out=True)
    assert [o.status for o in outcomes] == ["timeout", "not_run"] and outcomes[0].log_tail == "working...\n"
    report = grade_run(plan, instance, FAIL_TO_PASS, PASS_TO_PASS, "", "", outcomes)
    assert report.infra_failure and report.infra_failure_reason == "setup_timeout"
    # Cut in the test step: graded as it stands (a patch that hangs the suite keeps its 0).
    hung = read_steps(steps, "0 start 1\n0 end 0 2\n1 start 2\n", "", timed_out=True)
    assert [o.status for o in hung] == ["ok", "timeout"]
    report = grade_run(plan, instance, FAIL_TO_PASS, PASS_TO_PASS, "", "", hung)
    assert not report.infra_failure and not report.resolved
    _swebench_agrees(report)


def test_step_records_fold_into_statuses() -> None:
    steps = [Step("install[0]", "settings install", "setup", "true"), Step("tests", "default", "tests", "pytest")]
    records = "0 start 1,25\n0 end 0 1,75\n1 start 2\n1 end 1 5\n"  # a locale with a decimal comma
    log = ">>>>> prorl step 1 start\nF\n>>>>> prorl step 1 exit 1\n"
    ok, tests = read_steps(steps, records, log, timed_out=False)
    assert (ok.status, ok.exit, ok.seconds) == ("ok", 0, 0.5)
    assert (tests.status, tests.exit, tests.log_tail) == ("failed", 1, "F\n")
    assert not ok.failed_setup and not tests.failed_setup  # a test command's failure is the patch's, not setup's
    assert _outcomes(("setup", "failed", 1))[0].failed_setup
