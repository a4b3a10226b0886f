"""``spacey``: a fixture repository whose pytest node ids hold spaces, brackets, unicode and backslashes.

Made as a real git repository with fixed dates (the same commit ids on every
machine). The base commit has ``parse_pair`` that forgets to strip spaces;
the fix and the tests for it are commits after the base, left in the
repository on branch ``fix`` and tag ``v1.0`` (the future an agent must not
see). ``src_layout=True`` puts the package under ``src/``, so its tests
import only with ``PYTHONPATH=src``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_cli.domains.tinyrepo import commit_files, run_git

PAIRS_BUGGY = '''"""key = value pairs."""


def parse_pair(text):
    key, value = text.split("=", 1)
    return key, value


def join_words(words):
    return " ".join(words)
'''
PAIRS_FIXED = PAIRS_BUGGY.replace("return key, value", "return key.strip(), value.strip()")
PAIRS_BROKEN = PAIRS_FIXED.replace('return " ".join(words)', 'return " ".join(w for w in words if " " not in w)')
TEST_BASIC = '''import pytest

from spacey.pairs import join_words


@pytest.mark.parametrize("words,expected", [(["a", "b"], "a b"), (["x y", "z"], "x y z")],
                         ids=["two words", "with space inside"])
def test_join(words, expected):
    assert join_words(words) == expected
'''
TEST_PAIRS = '''import pytest

from spacey.pairs import parse_pair

CASES = {
    "a = b": ("a = b", ("a", "b")),
    "[ k = v ]": (" k  =  v ", ("k", "v")),
    "\\u00fcn\\u00efcode \\u2603": ("\\u00fc=\\u2603", ("\\u00fc", "\\u2603")),
    "back\\\\slash": ("C:\\\\dir=x", ("C:\\\\dir", "x")),
}


@pytest.mark.parametrize("text,expected", list(CASES.values()), ids=list(CASES))
def test_parse_pair(text, expected):
    assert parse_pair(text) == expected
'''
FILE = "tests/test_pairs.py"
#: The node ids pytest gives these tests (non-ascii and backslashes escaped, as pytest escapes ids).
FAIL_TO_PASS = [f"{FILE}::test_parse_pair[a = b]", f"{FILE}::test_parse_pair[[ k = v ]]"]
PASS_TO_PASS = [f"{FILE}::test_parse_pair[\\xfcn\\xefcode \\u2603]", f"{FILE}::test_parse_pair[back\\\\slash]",
                "tests/test_basic.py::test_join[two words]", "tests/test_basic.py::test_join[with space inside]"]
PROBLEM = "spacey.pairs.parse_pair keeps the spaces around keys and values: parse_pair('a = b') gives ('a ', ' b')."


@dataclass
class Spacey:
    """The repository, its SWE-bench-format instance, and patches the tests use."""

    path: Path
    instance: dict[str, Any]
    fix_commit: str  # the fix, on branch ``fix`` (never an ancestor of the base)
    breaking_patch: str  # the fix, plus a change that breaks ``test_join[with space inside]``


def make_spacey(dest: Path, src_layout: bool = False) -> Spacey:
    """Create the repository at ``dest`` (which must not exist), checked out on ``main`` at its base commit."""
    pkg = "src/spacey" if src_layout else "spacey"
    dest.mkdir(parents=True)
    run_git(dest, "init", "-q", "-b", "main")
    commit_files(dest, {f"{pkg}/__init__.py": "", "pyproject.toml": '[project]\nname = "spacey"\nversion = "0.1"\n'},
            "spacey: package")
    base = commit_files(dest, {f"{pkg}/pairs.py": PAIRS_BUGGY, "tests/__init__.py": "", "tests/test_basic.py": TEST_BASIC},
                   "pairs: parse_pair and join_words")
    run_git(dest, "checkout", "-q", "-b", "fix")
    fix = commit_files(dest, {f"{pkg}/pairs.py": PAIRS_FIXED}, "fix parse_pair: strip the spaces")
    gold = run_git(dest, "diff", base, fix)
    tests = commit_files(dest, {FILE: TEST_PAIRS}, "tests for parse_pair")
    test_patch = run_git(dest, "diff", fix, tests)
    run_git(dest, "tag", "v1.0")
    (dest / pkg / "pairs.py").write_text(PAIRS_BROKEN)
    breaking = run_git(dest, "diff", base, "--", pkg)
    run_git(dest, "checkout", "-q", "-f", "main")
    instance = {
        "instance_id": f"prorl__spacey-{'src' if src_layout else 'flat'}-1",
        "repo": "prorl/spacey-src" if src_layout else "prorl/spacey",
        "version": "0.1",
        "base_commit": base,
        "problem_statement": PROBLEM,
        "patch": gold,
        "test_patch": test_patch,
        "FAIL_TO_PASS": list(FAIL_TO_PASS),
        "PASS_TO_PASS": list(PASS_TO_PASS),
    }
    return Spacey(dest, instance, fix, breaking)
