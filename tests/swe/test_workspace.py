"""EVAL's work in a real sandbox (Apptainer, the domain image): the repository at base_commit, patches, grading.

``run_tests`` is what the swe handler's EVAL runs: here it runs on its own, one
fresh sandbox per model patch, so each case is graded as a job's would be.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.domains.tinyrepo import (
    STATS_FIXED,
    TESTS,
    TESTS_STATS,
    commit_files,
    make_tinyrepo,
    run_git,
)
from prorl_cli.exceptions import DomainError
from prorl_cli.sandbox import SandboxConfig, SandboxManager
from prorl_cli.swe.grading import SweReport
from prorl_cli.swe.workspace import prepare, run_tests

IMAGES = Path("/var/cache/prorl-test")
REPO_DIR = "/testbed"
#: The instance's test patch adds a test to the existing tests/test_calc.py (at its end) and creates tests/test_stats.py.
TEST_ADD_ZERO = "\n\ndef test_add_zero():\n    assert add(0, 0) == 0\n"
#: Imported while pytest collects tests/test_calc.py, before tests/test_stats.py imports mean.
MONKEYPATCH_MEAN = "import tinycalc.stats\ntinycalc.stats.mean = lambda xs: sum(xs) / len(xs)\n"



def _branch_diff(repo: Path, base: str, name: str, files: dict[str, str], *paths: str) -> str:
    """The diff from ``base`` to a commit on branch ``name`` that writes ``files`` (limited to ``paths``)."""
    run_git(repo, "checkout", "-q", "-b", name, base)
    commit_files(repo, files, name)
    diff = run_git(repo, "diff", "--binary", base, "HEAD", "--", *paths)
    run_git(repo, "checkout", "-q", "main")
    return diff


async def _grade(image: str, root: Path, instance: dict[str, Any], patch: str,
                 settings: dict[str, Any] | None = None) -> SweReport:
    local_dir = tempfile.mkdtemp(prefix="prorl-ws-")  # short: the tool server's socket lives there
    manager = SandboxManager(SandboxConfig(runtime="apptainer", image=image, local_dir=local_dir),
                             root / "state", logging.getLogger("test"))
    try:
        sandbox = await manager.start("eval", env={"PYTHONDONTWRITEBYTECODE": "1"})
        await prepare(sandbox, instance, REPO_DIR, scrub=False)
        report, _ = await run_tests(sandbox, instance, settings or {}, patch, instance["FAIL_TO_PASS"],
                                    instance["PASS_TO_PASS"], REPO_DIR, 300.0)
        return report
    finally:
        await manager.stop_all()
        shutil.rmtree(local_dir, ignore_errors=True)


@pytest.mark.apptainer
def test_test_patch_files_are_reset_to_base_before_the_test_patch_as_swebench_does(
        domain_image: str, tmp_path: Path) -> None:
    """A model patch's changes to the files the test patch touches are dropped, as swebench's eval script does.

    An agent that fixes the bug and writes its own tests into those files is graded (not refused because the test
    patch no longer applies), and one that games a listed test by editing a test file is not rewarded.
    """
    repo = make_tinyrepo(tmp_path / "tinycalc")
    base = repo.instance["base_commit"]
    test_patch = _branch_diff(repo.path, base, "tests", {"tests/test_stats.py": TESTS_STATS,
                                                         "tests/test_calc.py": TESTS + TEST_ADD_ZERO}, "tests")
    own_tests = {"tests/test_stats.py": "from tinycalc.stats import mean\n\n\ndef test_my_mean():\n"
                                        "    assert mean([2, 4]) == 3\n",
                 "tests/test_calc.py": TESTS + "\n\ndef test_my_add():\n    assert add(1, 1) == 2\n"}
    patches = {
        "gold": repo.fix_patch,
        "empty": "",
        "fix and own tests": _branch_diff(repo.path, base, "own", {"tinycalc/stats.py": STATS_FIXED, **own_tests}),
        "gamed test file": _branch_diff(repo.path, base, "gamed", {"tests/test_calc.py": MONKEYPATCH_MEAN + TESTS}),
    }
    instance = {**repo.instance, "repo_path": str(repo.path), "test_patch": test_patch,
                "PASS_TO_PASS": [*repo.instance["PASS_TO_PASS"], "tests/test_calc.py::test_add_zero"]}

    async def grade_all() -> dict[str, SweReport | str]:
        graded: dict[str, SweReport | str] = {}
        for name, patch in patches.items():
            try:
                graded[name] = await _grade(domain_image, tmp_path / name.replace(" ", "-"), instance, patch)
            except DomainError as e:  # kept, so that every case's outcome shows in a failure
                graded[name] = str(e)
        return graded

    outcomes = asyncio.run(grade_all())
    resolved = {name: report.resolved if isinstance(report, SweReport) else report
                for name, report in outcomes.items()}
    assert resolved == {"gold": True, "empty": False, "fix and own tests": True, "gamed test file": False}
    reports = {name: report for name, report in outcomes.items() if isinstance(report, SweReport)}
    assert not any(report.infra_failure for report in reports.values()), reports
    gamed = reports["gamed test file"].tests_status["FAIL_TO_PASS"]
    assert sorted(gamed["failure"]) == sorted(repo.instance["FAIL_TO_PASS"]), reports["gamed test file"]


@pytest.mark.apptainer
def test_a_patch_that_stops_the_suite_scores_0_and_a_broken_test_command_is_not_graded(
        domain_image: str, tmp_path: Path) -> None:
    """No listed test ran: the patch's doing when they run without it (a 0), else the environment's (no grade)."""
    repo = make_tinyrepo(tmp_path / "tinycalc")
    base = repo.instance["base_commit"]
    broken_conftest = _branch_diff(repo.path, base, "conftest", {"tinycalc/stats.py": STATS_FIXED,
                                                                 "conftest.py": "import no_such_module_anywhere\n"})
    instance = {**repo.instance, "repo_path": str(repo.path)}
    bad_command = {"test_command": "python3 -m pytest --no-such-pytest-option {test_files}"}

    async def grade_both() -> tuple[SweReport, SweReport]:
        return (await _grade(domain_image, tmp_path / "conftest", instance, broken_conftest),
                await _grade(domain_image, tmp_path / "command", instance, repo.fix_patch, bad_command))

    stopped, environment = asyncio.run(grade_both())
    assert not stopped.infra_failure and not stopped.resolved, stopped
    assert stopped.status == "RESOLVED_NO" and "the patch stopped them" in stopped.grading_note, stopped
    assert sorted(stopped.tests_status["FAIL_TO_PASS"]["failure"]) == sorted(repo.instance["FAIL_TO_PASS"])
    assert environment.infra_failure and environment.infra_failure_reason == "no_tests_collected", environment


@pytest.mark.apptainer
def test_a_patch_neither_git_apply_nor_the_images_busybox_patch_applies_says_so(tmp_path: Path) -> None:
    """The domain image's `patch` is BusyBox's (no --batch, no --fuzz): the refusal gives git apply's reason and
    says what the fuzzy fallback needs, not BusyBox's usage text."""
    from prorl_cli.swe.workspace import apply_patch

    image = IMAGES / "domains.sif"
    if not image.is_file():
        pytest.skip(f"{image} missing (scripts/provision/46-domain-images.sh)")
    calc = make_tinyrepo(tmp_path / "tinycalc")
    instance = {**calc.instance, "repo_path": str(calc.path)}

    async def apply_stale() -> tuple[bool, str]:
        local_dir = tempfile.mkdtemp(prefix="prorl-ws-")
        manager = SandboxManager(SandboxConfig(runtime="apptainer", image=str(image), local_dir=local_dir),
                                 tmp_path / "state", logging.getLogger("test"))
        try:
            sandbox = await manager.start("eval")
            await prepare(sandbox, instance, REPO_DIR, scrub=False)
            stale = "--- a/nowhere.py\n+++ b/nowhere.py\n@@ -1,1 +1,1 @@\n-old\n+new\n"
            await sandbox.write_file("/tmp/stale.patch", stale.encode())
            return await apply_patch(sandbox, REPO_DIR, "/tmp/stale.patch")
        finally:
            await manager.stop_all()
            shutil.rmtree(local_dir, ignore_errors=True)

    ok, output = asyncio.run(apply_stale())
    assert not ok
    assert "nowhere.py" in output, output  # git apply's reason
    assert "BusyBox's, which has no --batch or --fuzz" in output and "Usage:" not in output, output
