"""SWE-bench rows as published, on the runner their tests need: Django's runtests.py, sympy's bin/test, data files.

A SWE-bench row carries no test command: the plan picks it (prorl_cli/swe/testplan.py). These run the plan's
real run script on this host's python3, as tests/swe/test_grading.py does, and grade what it printed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.swe.evalrun import run_script, support_files
from prorl_cli.swe.grading import SweReport, grade_run
from prorl_cli.swe.testplan import plan_tests
from tests.harness import need_module

#: A stand-in for Django's tests/runtests.py: its options, module labels, and its verbose unittest lines.
RUNTESTS = '''import argparse
import sys
import unittest

parser = argparse.ArgumentParser()
parser.add_argument("labels", nargs="*")
parser.add_argument("--verbosity", type=int, default=1)
parser.add_argument("--settings")
parser.add_argument("--parallel", type=int)
args = parser.parse_args()


class Result(unittest.TextTestResult):
    def getDescription(self, test):
        return f"{test._testMethodName} ({type(test).__module__}.{type(test).__qualname__})"


suite = unittest.defaultTestLoader.loadTestsFromNames(args.labels)
result = unittest.TextTestRunner(verbosity=args.verbosity, resultclass=Result, stream=sys.stdout).run(suite)
sys.exit(not result.wasSuccessful())
'''
DJANGO_TESTS = '''import unittest


class FmtTests(unittest.TestCase):
    def test_fixed(self):
        self.assertEqual(" a ".strip(), "a")

    def test_kept(self):
        self.assertTrue(True)
'''


def _grade(repo: Path, work: Path, instance: dict[str, Any]) -> tuple[SweReport, str]:
    """Run the plan of ``instance`` in ``repo`` as EVAL does (test patch already in place) and grade it."""
    work.mkdir(parents=True, exist_ok=True)
    plan = plan_tests(instance, {}, instance["FAIL_TO_PASS"], instance["PASS_TO_PASS"])
    for path, data in support_files(str(work)).items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    (work / "nodeids.jsonl").write_text("")
    (work / "run.sh").write_text(run_script(plan, str(repo), str(work)))
    # As EVAL runs it (`bash run.sh > log 2>&1`): Django's runner writes its results to stderr.
    log = subprocess.run(["bash", str(work / "run.sh")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=120).stdout
    report = grade_run(plan, instance, instance["FAIL_TO_PASS"], instance["PASS_TO_PASS"], log,
                       (work / "nodeids.jsonl").read_text())
    return report, plan.script


def test_a_django_row_as_published_runs_django_runner_on_module_labels(tmp_path: Path) -> None:
    """SWE-bench's django rows name tests as Django's runner prints them: pytest's run of them scored the gold 0."""
    need_module("swebench", "swe")
    repo = tmp_path / "django"
    (repo / "tests" / "fmt").mkdir(parents=True)
    (repo / "tests" / "runtests.py").write_text(RUNTESTS)
    (repo / "tests" / "fmt" / "__init__.py").write_text("")
    (repo / "tests" / "fmt" / "tests.py").write_text(DJANGO_TESTS)
    (repo / "tests" / "fmt" / "expected.json").write_text("{}\n")
    instance = {
        "instance_id": "django__django-1", "repo": "django/django", "version": "3.0", "base_commit": "0" * 40,
        "test_patch": "--- a/tests/fmt/tests.py\n+++ b/tests/fmt/tests.py\n"
                      "--- /dev/null\n+++ b/tests/fmt/expected.json\n",
        "FAIL_TO_PASS": ["test_fixed (fmt.tests.FmtTests)"], "PASS_TO_PASS": ["test_kept (fmt.tests.FmtTests)"],
    }
    report, command = _grade(repo, tmp_path / "work", instance)
    assert "tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 fmt.tests" in command, command
    assert "expected" not in command, command
    assert report.grading == "log:parse_log_django", report
    assert report.resolved and not report.infra_failure, report
    assert report.tests_status["FAIL_TO_PASS"]["success"] == ["test_fixed (fmt.tests.FmtTests)"]


@pytest.mark.parametrize(("version", "expected"), [
    ("1.9", "tests/runtests.py --verbosity 2 admin_views.tests"),
    ("4.1", "tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 admin_views.tests"),
    (None, "tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 admin_views.tests"),
])
def test_django_runner_options_follow_the_row_version(version: str | None, expected: str) -> None:
    need_module("swebench", "swe")
    instance = {"repo": "django/django", "version": version,
                "test_patch": "+++ b/tests/admin_views/tests.py\n+++ b/tests/admin_views/templates/a.html\n"}
    plan = plan_tests(instance, {}, ["test_a (admin_views.tests.T)"], [])
    assert plan.script.endswith(expected) and plan.source == "default for parse_log_django", plan.script


def test_a_sympy_row_runs_bin_test_and_a_command_of_the_row_still_wins() -> None:
    need_module("swebench", "swe")
    instance = {"repo": "sympy/sympy", "version": "1.1", "test_patch": "+++ b/sympy/core/tests/test_basic.py\n"}
    plan = plan_tests(instance, {}, ["test_issue_1"], [])
    assert "python3 bin/test -C --verbose sympy/core/tests/test_basic.py" in plan.script, plan.script
    assert plan.log_parser == "parse_log_sympy"
    own = plan_tests({**instance, "test_command": "bin/test"}, {}, ["test_issue_1"], [])
    assert own.script == "bin/test sympy/core/tests/test_basic.py" and own.source == "instance test_command"


def test_a_test_patch_touching_data_files_still_runs_its_tests(tmp_path: Path) -> None:
    """pytest stops at a data file on its command line ("not found"): the gold patch's run then ran nothing."""
    need_module("swebench", "swe")
    repo = tmp_path / "repo"
    (repo / "tests" / "data").mkdir(parents=True)
    (repo / "tests" / "test_load.py").write_text(
        "import json, pathlib\n\n\ndef test_load():\n"
        "    assert json.loads((pathlib.Path(__file__).parent / 'data' / 'x.json').read_text()) == {}\n")
    # SWE-bench's data suffixes, mypy's data-driven cases (SWE-Gym), a pylint rc fixture.
    data = ("x.json", "notes.txt", "conf.yml", "check-functions.test", "fixture.rc")
    for name in data:
        (repo / "tests" / "data" / name).write_text("{}\n")
    instance = {
        "instance_id": "a__b-1", "repo": "a/b", "base_commit": "0" * 40,
        "test_patch": "".join(f"+++ b/tests/{name}\n" for name in ("test_load.py", *(f"data/{d}" for d in data))),
        "FAIL_TO_PASS": ["tests/test_load.py::test_load"], "PASS_TO_PASS": [],
    }
    report, command = _grade(repo, tmp_path / "work", instance)
    assert command.endswith("-p no:cacheprovider tests/test_load.py"), command
    assert report.resolved and not report.infra_failure, report
    # A row's own pytest command (SWE-rebench's test_cmd) gets the same files.
    own = plan_tests({**instance, "install_config": {"test_cmd": "pytest -rA"}}, {}, instance["FAIL_TO_PASS"], [])
    assert own.script == "pytest -rA tests/test_load.py", own.script


def test_a_non_py_file_a_listed_id_names_still_reaches_pytest_and_other_runners_keep_theirs() -> None:
    instance = {"repo": "a/b", "test_patch": "+++ b/docs/usage.rst\n+++ b/tests/cases.test\n+++ b/tests/t.py\n"}
    plan = plan_tests(instance, {}, ["docs/usage.rst::usage.rst"], ["tests/t.py::test_a"])
    assert plan.script.endswith("-p no:cacheprovider docs/usage.rst tests/t.py"), plan.script
    tox = plan_tests({**instance, "test_command": "tox -e py39 --"}, {}, ["docs/usage.rst::usage.rst"], [])
    assert tox.script == "tox -e py39 -- docs/usage.rst tests/cases.test tests/t.py", tox.script


def test_an_r2e_gym_row_is_refused_naming_r2e_gym_not_another_source(tmp_path: Path) -> None:
    """R2E-Gym's own rows carry `docker_image` too: auto read them as SWE-rebench rows with a missing field."""
    from prorl_cli.domains.datasets import load_instances
    from prorl_cli.exceptions import DatasetError

    row = {"repo_name": "aiohttp", "docker_image": "namanjain12/aiohttp_final:0a1b", "commit_hash": "0a1b",
           "problem_statement": "x", "expected_output_json": "{}", "execution_result_content": "",
           "parsed_commit_content": "{}", "modified_files": [], "relevant_files": [], "prompt": "p"}
    data = tmp_path / "r2e.jsonl"
    data.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError) as caught:
        load_instances("swe", data, None, warn=lambda line: None)
    message = str(caught.value)
    assert "R2E-Gym row" in message and "expected_output_json" in message and "SWE-rebench" not in message, message


def test_a_multi_swe_bench_row_is_refused_saying_what_grading_it_needs(tmp_path: Path) -> None:
    """Multi-SWE-bench's rows, as its dataset publishes them: without a word they failed on a missing base_commit."""
    from prorl_cli.domains.datasets import load_instances
    from prorl_cli.exceptions import DatasetError

    row = {"org": "alibaba", "repo": "fastjson2", "number": 2775, "state": "closed", "title": "t", "body": "b",
           "base": {"label": "alibaba:main", "ref": "main", "sha": "12ab"},
           "resolved_issues": [{"number": 2774, "title": "bug", "body": "it breaks"}],
           "fix_patch": "diff --git a/x b/x\n", "test_patch": "diff --git a/t b/t\n",
           "fixed_tests": {"T#a": {"run": "FAIL", "test": "FAIL", "fix": "PASS"}}, "p2p_tests": {}, "f2p_tests": {},
           "s2p_tests": {}, "n2p_tests": {}, "run_result": {}, "test_patch_result": {}, "fix_patch_result": {},
           "instance_id": "alibaba__fastjson2-2775"}
    data = tmp_path / "msb.jsonl"
    data.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError) as caught:
        load_instances("swe", data, None, warn=lambda line: None)
    message = str(caught.value)
    assert "Multi-SWE-bench row" in message and "test_command" in message and "base.sha" in message, message


def test_a_django_test_module_that_does_not_import_without_the_fix_is_graded_not_an_infra_failure(
    tmp_path: Path,
) -> None:
    """unittest reports the module as `tests (unittest.loader._FailedTest)`: a collection error, as pytest's is."""
    need_module("swebench", "swe")
    repo = tmp_path / "django"
    (repo / "tests" / "fmt").mkdir(parents=True)
    (repo / "tests" / "runtests.py").write_text(RUNTESTS)
    (repo / "tests" / "fmt" / "__init__.py").write_text("")
    (repo / "tests" / "fmt" / "tests.py").write_text("from fmt.helpers import strip_all  # the fix adds it\n"
                                                     + DJANGO_TESTS)
    instance = {
        "instance_id": "django__django-2", "repo": "django/django", "version": "4.2", "base_commit": "0" * 40,
        "test_patch": "+++ b/tests/fmt/tests.py\n",
        "FAIL_TO_PASS": ["test_fixed (fmt.tests.FmtTests)"], "PASS_TO_PASS": [],
    }
    report, _ = _grade(repo, tmp_path / "work", instance)
    assert not report.infra_failure and not report.resolved, report
    assert report.tests_status["FAIL_TO_PASS"]["failure"] == ["test_fixed (fmt.tests.FmtTests)"]
    assert any("_FailedTest" in name for name in report.collect_errors), report.collect_errors
    (repo / "tests" / "fmt" / "helpers.py").write_text("def strip_all(text):\n    return text.strip()\n")
    fixed, _ = _grade(repo, tmp_path / "work2", instance)
    assert fixed.resolved and not fixed.infra_failure and fixed.collect_errors == [], fixed


def test_a_missing_field_names_the_source_once(tmp_path: Path) -> None:
    from prorl_cli.domains.datasets import load_instances
    from prorl_cli.exceptions import DatasetError

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"instance_id": "a"}) + "\n")
    with pytest.raises(DatasetError) as caught:
        load_instances("swe", data, None, warn=lambda line: None)
    assert "missing field 'repo'" in str(caught.value) and "rows rows" not in str(caught.value), caught.value
