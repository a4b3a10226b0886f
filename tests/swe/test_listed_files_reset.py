"""A row with no test patch (SWE-smith's) in a real sandbox: the model patch's edits to listed tests never count."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prorl_cli.domains.tinyrepo import (
    STATS_FIXED,
    TESTS_STATS,
    commit_files,
    make_tinyrepo,
    run_git,
)
from prorl_cli.swe.grading import SweReport
from tests.swe.test_workspace import _branch_diff, _grade

GAMED_STATS = "def test_mean():\n    assert True\n\n\ndef test_mean_single():\n    assert True\n"


@pytest.mark.apptainer
def test_a_patch_that_rewrites_the_listed_tests_of_a_row_without_test_patch_scores_0(
        domain_image: str, tmp_path: Path) -> None:
    """SWE-smith rows carry no test patch: the listed tests ran as the model patch left them, so a patch that
    replaced them with `assert True` resolved the instance. The files the listed ids name are reset to
    base_commit first; the gold patch still resolves."""
    repo = make_tinyrepo(tmp_path / "tinycalc")
    # The bug commit holds its tests, as a SWE-smith branch does.
    run_git(repo.path, "checkout", "-q", "-b", "bug", repo.instance["base_commit"])
    base = commit_files(repo.path, {"tests/test_stats.py": TESTS_STATS}, "tests for mean")
    run_git(repo.path, "branch", "-q", "-f", "main", base)
    run_git(repo.path, "checkout", "-q", "main")
    instance = {**repo.instance, "base_commit": base, "test_patch": "", "repo_path": str(repo.path)}
    patches = {
        "gold": _branch_diff(repo.path, base, "fix", {"tinycalc/stats.py": STATS_FIXED}),
        "gamed tests": _branch_diff(repo.path, base, "gamed", {"tests/test_stats.py": GAMED_STATS}),
    }

    async def grade_all() -> dict[str, SweReport]:
        return {name: await _grade(domain_image, tmp_path / name.replace(" ", "-"), instance, patch)
                for name, patch in patches.items()}

    reports = asyncio.run(grade_all())
    assert {name: r.resolved for name, r in reports.items()} == {"gold": True, "gamed tests": False}, reports
    assert not any(r.infra_failure for r in reports.values()), reports
    gamed = reports["gamed tests"].tests_status["FAIL_TO_PASS"]
    assert sorted(gamed["failure"]) == sorted(instance["FAIL_TO_PASS"]), reports["gamed tests"]


def test_the_files_reset_are_test_files_never_a_doctest_s_source_module() -> None:
    from prorl_cli.swe.workspace import listed_test_files

    names = ["tests/test_a.py::test_x[1.5]", "tests/test_a.py::T::test_y", "src/pkg/mod.py::pkg.mod.func",
             "mypy/test/testcheck.py::TypeCheckSuite::check-functions.test::testX", "test_issue_1",
             "docs/usage.rst::usage.rst", "test_x (mod.tests.C)"]
    assert listed_test_files(names) == ["tests/test_a.py", "mypy/test/testcheck.py"]


@pytest.mark.apptainer
def test_an_image_without_the_repository_is_named_as_the_cause(domain_image: str, tmp_path: Path) -> None:
    """No repo_images entry for the row: the default image ran, and INIT said only that `cd /testbed` failed."""
    from prorl_cli.exceptions import DomainError

    repo = make_tinyrepo(tmp_path / "tinycalc")
    with pytest.raises(DomainError) as caught:
        asyncio.run(_grade(domain_image, tmp_path / "g", dict(repo.instance), repo.fix_patch))
    message = str(caught.value)
    assert "holds no git repository in /testbed" in message and "repo_images" in message, message
    assert "'prorl/tinycalc@0.1'" in message and "repo_path" in message, message
