"""``tinycalc``: the tiny SWE fixture repository shipped with prorl, made as a real git repository.

Three commits (package, tests, a ``mean`` with an off-by-one bug); the base
commit is the third. The gold fix and the test patch are real diffs made
from commits on top of it, so the SWE-bench instance returned is exactly what
the public format carries. Dates and authors are fixed, so the commit ids are
the same on every machine (and image caches keyed on the source are reused).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CALC = '''"""Arithmetic helpers."""


def add(a, b):
    return a + b


def sub(a, b):
    return a - b
'''
STATS_BUGGY = '''"""Statistics helpers."""


def mean(xs):
    """The arithmetic mean of a non-empty sequence."""
    return sum(xs) / (len(xs) - 1)
'''
STATS_FIXED = STATS_BUGGY.replace("(len(xs) - 1)", "len(xs)")
TESTS = '''from tinycalc.calc import add, sub


def test_add():
    assert add(2, 3) == 5


def test_sub():
    assert sub(5, 3) == 2
'''
TESTS_STATS = '''from tinycalc.stats import mean


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_single():
    assert mean([7]) == 7
'''
PROBLEM = (
    "tinycalc.stats.mean returns the wrong value: mean([1, 2, 3, 4]) gives 3.333... instead of 2.5, "
    "and mean([7]) raises ZeroDivisionError. The package lives in /testbed/tinycalc."
)
INSTANCE_ID = "prorl__tinycalc-1"


@dataclass
class TinyRepo:
    """The repository, its SWE-bench instance, and patches tests use."""

    path: Path
    instance: dict[str, Any]
    fix_patch: str  # the gold patch
    breaking_patch: str  # fixes the bug but breaks a PASS_TO_PASS test


def run_git(repo: Path, *args: str) -> str:
    """``git -C repo ARGS`` with a fixed author, committer and date (the same commit ids every time); stdout."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "prorl", "GIT_AUTHOR_EMAIL": "prorl@example.invalid",
           "GIT_COMMITTER_NAME": "prorl", "GIT_COMMITTER_EMAIL": "prorl@example.invalid",
           "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00",
           "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repo)}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def commit_files(repo: Path, files: dict[str, str], message: str) -> str:
    """Write ``files`` (relative path -> UTF-8 text) into ``repo``, commit everything, return the commit id."""
    for rel, text in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", message)
    return run_git(repo, "rev-parse", "HEAD").strip()


def make_tinyrepo(dest: Path) -> TinyRepo:
    """Create the repository at ``dest`` (which must not exist) checked out at its base commit."""
    dest.mkdir(parents=True)
    run_git(dest, "init", "-q", "-b", "main")
    commit_files(dest, {"tinycalc/__init__.py": "", "tinycalc/calc.py": CALC, "pyproject.toml":
                   '[project]\nname = "tinycalc"\nversion = "0.1"\n'}, "tinycalc: add and sub")
    commit_files(dest, {"tests/__init__.py": "", "tests/test_calc.py": TESTS}, "tests for add and sub")
    base = commit_files(dest, {"tinycalc/stats.py": STATS_BUGGY}, "stats: mean")
    commit_files(dest, {"tinycalc/stats.py": STATS_FIXED}, "fix mean")
    fix_patch = run_git(dest, "diff", base, "HEAD")
    commit_files(dest, {"tests/test_stats.py": TESTS_STATS}, "tests for mean")
    test_patch = run_git(dest, "diff", base, "HEAD", "--", "tests")
    commit_files(dest, {"tinycalc/calc.py": CALC.replace("return a + b", "return a + b + 1")}, "break add")
    breaking_patch = run_git(dest, "diff", base, "HEAD", "--", "tinycalc")
    run_git(dest, "checkout", "-q", base)
    run_git(dest, "branch", "-q", "-f", "main", base)
    run_git(dest, "checkout", "-q", "main")
    instance = {
        "instance_id": INSTANCE_ID,
        "repo": "prorl/tinycalc",
        "version": "0.1",
        "base_commit": base,
        "problem_statement": PROBLEM,
        "patch": fix_patch,
        "test_patch": test_patch,
        "FAIL_TO_PASS": ["tests/test_stats.py::test_mean", "tests/test_stats.py::test_mean_single"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_add", "tests/test_calc.py::test_sub"],
    }
    return TinyRepo(dest, instance, fix_patch, breaking_patch)
