"""Exact-id grading on a real pytest run: the plugin, its start-up hook and the run script, on this host's python3.

The same files and script run inside the EVAL sandbox (tests/swe/test_swe_sandbox.py
runs them there); here they run in a temporary folder, so the grading rules
are checked in a second per case.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

from prorl_cli.swe.evalrun import run_script, support_files
from prorl_cli.swe.grading import SweReport, fold_nodeids, grade_run
from prorl_cli.swe.testplan import command_with_files, plan_tests
from tests.harness import need_module
from tests.swe.spacey import FAIL_TO_PASS, FILE, PASS_TO_PASS, Spacey, make_spacey


@pytest.fixture
def spacey(tmp_path: Path) -> Spacey:
    need_module("swebench", "swe")
    return make_spacey(tmp_path / "spacey")


def _run(repo: Spacey, patch: str, work: Path, instance_extra: dict[str, object] | None = None,
         settings: dict[str, object] | None = None, env: dict[str, str] | None = None) -> tuple[SweReport, str]:
    """Apply ``patch`` and the test patch to the repository, run the plan's tests as EVAL does, grade them."""
    work.mkdir(parents=True, exist_ok=True)
    instance = {**repo.instance, **(instance_extra or {})}
    for name, text in (("model.patch", patch), ("test.patch", instance["test_patch"])):
        if text:
            (work / name).write_text(text)
            subprocess.run(["git", "-C", str(repo.path), "apply", str(work / name)], check=True)
    plan = plan_tests(instance, settings or {}, instance["FAIL_TO_PASS"], instance["PASS_TO_PASS"])
    for path, data in support_files(str(work)).items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    (work / "nodeids.jsonl").write_text("")
    script = work / "run.sh"
    script.write_text(run_script(plan, str(repo.path), str(work)))
    log = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, env=env).stdout
    records = (work / "nodeids.jsonl").read_text()
    return grade_run(plan, instance, instance["FAIL_TO_PASS"], instance["PASS_TO_PASS"], log, records), plan.script


def test_gold_patch_resolves_with_spaced_bracketed_unicode_and_backslash_ids(spacey: Spacey, tmp_path: Path) -> None:
    report, _ = _run(spacey, spacey.instance["patch"], tmp_path)
    assert report.grading == "nodeids"
    assert report.resolved and report.status == "RESOLVED_FULL", report
    assert sorted(report.tests_status["FAIL_TO_PASS"]["success"]) == sorted(FAIL_TO_PASS)
    assert sorted(report.tests_status["PASS_TO_PASS"]["success"]) == sorted(PASS_TO_PASS)
    assert report.tests[f"{FILE}::test_parse_pair[[ k = v ]]"] == "PASSED"
    assert report.missing == {}
    # The swebench report body carries exactly swebench's keys.
    assert set(report.swebench()) == {"patch_is_None", "patch_exists", "patch_successfully_applied", "resolved",
                                      "infra_failure", "tests_status"}


def test_no_op_patch_is_unresolved_with_the_fail_to_pass_tests_failing(spacey: Spacey, tmp_path: Path) -> None:
    report, _ = _run(spacey, "", tmp_path)
    assert not report.resolved and report.status == "RESOLVED_NO"
    assert sorted(report.tests_status["FAIL_TO_PASS"]["failure"]) == sorted(FAIL_TO_PASS)
    assert report.tests_status["FAIL_TO_PASS"]["missing"] == []
    assert sorted(report.tests_status["PASS_TO_PASS"]["success"]) == sorted(PASS_TO_PASS)


def test_a_patch_breaking_one_spaced_id_test_files_that_test_as_failure(spacey: Spacey, tmp_path: Path) -> None:
    report, _ = _run(spacey, spacey.breaking_patch, tmp_path)
    assert not report.resolved
    assert report.tests_status["PASS_TO_PASS"]["failure"] == ["tests/test_basic.py::test_join[with space inside]"]
    assert sorted(report.tests_status["FAIL_TO_PASS"]["success"]) == sorted(FAIL_TO_PASS)


def test_a_listed_test_that_never_ran_is_missing_with_the_closest_id(spacey: Spacey, tmp_path: Path) -> None:
    ghost = f"{FILE}::test_parse_pair[a = c]"
    report, _ = _run(spacey, spacey.instance["patch"], tmp_path, {"PASS_TO_PASS": [*PASS_TO_PASS, ghost]})
    assert not report.resolved  # a test that did not run is not a test that passed
    assert report.tests_status["PASS_TO_PASS"]["missing"] == [ghost]
    # swebench's own list counts it as a failure (as swebench does); prorl's "missing" names it besides.
    assert ghost in report.tests_status["PASS_TO_PASS"]["failure"]
    assert not report.infra_failure  # the other listed tests ran: the run is evidence, and unresolved
    assert report.missing == {ghost: f"{FILE}::test_parse_pair[a = b]"}


def test_instance_test_command_with_pythonpath_src_is_used_and_names_each_file_once(tmp_path: Path) -> None:
    need_module("swebench", "swe")
    repo = make_spacey(tmp_path / "spacey", src_layout=True)
    command = f"PYTHONPATH=src python3 -m pytest -rA -p no:cacheprovider {FILE} tests/test_basic.py"
    report, script = _run(repo, repo.instance["patch"], tmp_path / "w", {"test_command": command})
    assert report.resolved and report.grading == "nodeids", report  # the plugin reached a PYTHONPATH=src command
    assert report.test_source == "instance test_command"
    assert script == command  # used as given: it names its files, nothing appended
    # The default command (no PYTHONPATH=src) cannot import the package: not resolved.
    plain = make_spacey(tmp_path / "plain", src_layout=True)
    report, script = _run(plain, plain.instance["patch"], tmp_path / "w2")
    assert not report.resolved and script.count(FILE) == 1


def _venv_python(root: Path) -> Path:
    """``python -m venv``: a python that never reads the user site."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    return root / "bin"


def _uv_venv_python(root: Path) -> Path:
    """``uv venv`` (the layout of uv-built SWE images), on this interpreter, offline."""
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(uv).exists():
        pytest.skip("uv is not installed (pip install 'prorl[test]'; scripts/install.sh does it)")
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_OFFLINE": "1", "UV_NO_CACHE": "1"}
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(root)], check=True, timeout=120, env=env)
    return root / "bin"


def _conda_style_python(root: Path) -> Path:
    """A prefix of its own on PATH whose python runs with the user site off (``-s``), like an env of conda's."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -s "$@"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("make", [_venv_python, _uv_venv_python, _conda_style_python],
                         ids=["venv", "uv-venv", "conda-style"])
def test_a_pythonpath_src_command_in_a_sandbox_python_without_user_site_is_graded_by_exact_ids(
    make: Callable[[Path], Path], tmp_path: Path
) -> None:
    need_module("swebench", "swe")
    bin_dir = make(tmp_path / "py")
    # The new python sees pytest (this environment's packages) through a path file, as an image's own would.
    here = sysconfig.get_paths()["purelib"]
    probe = subprocess.run([str(bin_dir / "python3"), "-c", "import site, sys; print(site.ENABLE_USER_SITE, sys.prefix)"],
                           capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert probe[0] != "True", probe  # the user site (usercustomize) cannot reach these pythons
    if make is not _conda_style_python:
        purelib = subprocess.run([str(bin_dir / "python3"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        Path(purelib, "outer.pth").write_text(here + "\n")
    repo = make_spacey(tmp_path / "spacey", src_layout=True)
    command = f"PYTHONPATH=src python -m pytest -rA -p no:cacheprovider {FILE} tests/test_basic.py"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    report, _ = _run(repo, repo.instance["patch"], tmp_path / "w", {"test_command": command}, env=env)
    assert report.grading == "nodeids" and report.grading_note == "", report
    assert report.resolved and not report.infra_failure, report


def test_a_run_graded_from_its_log_says_why_and_never_fails_a_test_it_cannot_read(
    spacey: Spacey, tmp_path: Path
) -> None:
    # The plugin's folder is gone (a command that cleared PYTHONPATH and ran a python of its own):
    # the log parser cuts ids at spaces, so the spaced ids are missing and the run is not graded.
    command = f"env -u PYTHONPATH -u PYTEST_ADDOPTS PYTHONNOUSERSITE=1 {sys.executable} -m pytest -rA -p no:cacheprovider {FILE} tests/test_basic.py"
    report, _ = _run(spacey, spacey.instance["patch"], tmp_path, {"test_command": command})
    assert report.grading == "log:parse_log_pytest", report
    assert "node-id plugin recorded no test" in report.grading_note
    spaced = [name for name in PASS_TO_PASS + FAIL_TO_PASS if " " in name]
    assert spaced and all(name in report.missing for name in spaced), report.missing
    # Never failed against the patch: swebench's lists count the unreadable ids as failures (as swebench
    # itself would), but the run is an infra_failure, not graded, so no reward is taken from it.
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        lists = report.tests_status[key]
        assert set(lists["missing"]) == {n for n in spaced if n in (FAIL_TO_PASS if key == "FAIL_TO_PASS"
                                                                    else PASS_TO_PASS)}, lists
    assert report.infra_failure and not report.resolved
    assert report.infra_failure_reason == "unreadable_test_ids"
    assert "not graded" in report.grading_note


def test_precedence_instance_over_settings_over_swebench_over_default() -> None:
    need_module("swebench", "swe")
    base = {"repo": "prorl/x", "test_patch": "+++ b/tests/test_a.py\n"}
    ids = ["tests/test_a.py::t", "tests/test_b.py::u"]
    assert plan_tests(base, {}, ids, []).source == "default"
    assert plan_tests(base, {}, ids, []).script.endswith("tests/test_a.py tests/test_b.py")
    assert plan_tests(base, {"test_command": "pytest -x"}, ids, []).source == "settings test_command"
    assert plan_tests({**base, "test_command": "tox"}, {"test_command": "pytest"}, ids, []).script == (
        "tox tests/test_a.py tests/test_b.py")
    script = plan_tests({**base, "eval_script": "echo hi"}, {"test_command": "x"}, ids, [])
    assert script.applies_test_patch and script.script == "echo hi" and script.source == "instance eval_script"
    rebench = plan_tests({**base, "install_config": {"test_cmd": "pytest -rA"}}, {}, ids, [])
    assert rebench.source == "instance install_config.test_cmd"
    # SWE-bench's own repositories get swebench's per-repo log parser when their tests are not plain pytest.
    assert plan_tests({**base, "repo": "django/django"}, {}, ids, []).log_parser == "parse_log_django"
    assert plan_tests({**base, "repo": "pytest-dev/pytest"}, {}, ids, []).log_parser is None
    assert plan_tests({**base, "log_parser": "parse_log_sympy"}, {}, ids, []).log_parser == "parse_log_sympy"
    assert command_with_files("run {test_files} -q", ["a b.py", "c.py"]) == "run 'a b.py' c.py -q"
    assert command_with_files("pytest c.py", ["c.py", "c.py"]) == "pytest c.py"
    assert command_with_files("pytest c.py", ["c.py", "d.py"]) == "pytest c.py d.py"  # named once, none left out


def test_phases_fold_like_pytest_summary() -> None:
    records = "\n".join([
        '{"nodeid": "t.py::a b", "when": "setup", "outcome": "passed", "xfail": false}',
        '{"nodeid": "t.py::a b", "when": "call", "outcome": "passed", "xfail": false}',
        '{"nodeid": "t.py::a b", "when": "teardown", "outcome": "failed", "xfail": false}',
        '{"nodeid": "t.py::x", "when": "call", "outcome": "skipped", "xfail": true}',
        '{"nodeid": "t.py::s", "when": "setup", "outcome": "skipped", "xfail": false}',
        '{"nodeid": "t.py::e", "when": "setup", "outcome": "failed", "xfail": false}',
        '{"nodeid": "u.py", "when": "collect", "outcome": "failed", "xfail": false}',
    ])
    status, collect_errors = fold_nodeids(records)
    assert status == {"t.py::a b": "ERROR", "t.py::x": "XFAIL", "t.py::s": "SKIPPED", "t.py::e": "ERROR"}
    assert collect_errors == ["u.py"]


def test_an_instance_without_fail_to_pass_tests_is_not_graded_for_any_patch(spacey: Spacey, tmp_path: Path) -> None:
    """With no FAIL_TO_PASS test every patch that keeps PASS_TO_PASS passing resolves it, the empty one too: no reward."""
    for name, patch in (("empty", ""), ("gold", spacey.instance["patch"])):
        repo = make_spacey(tmp_path / name / "spacey")
        report, _ = _run(repo, patch, tmp_path / name / "work", {"FAIL_TO_PASS": []})
        assert not report.resolved and report.infra_failure, (name, report)
        assert report.infra_failure_reason == "no_fail_to_pass" and "no FAIL_TO_PASS" in report.grading_note, report
