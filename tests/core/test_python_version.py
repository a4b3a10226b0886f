"""What the README says about the Python version is what pyproject.toml declares, and what the code needs."""

from __future__ import annotations

import asyncio
import re
import sys
import tomllib

from tests.harness import REPO


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def test_readme_and_requires_python_agree() -> None:
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    declared = re.fullmatch(r">=\s*(\d+\.\d+)", requires)
    assert declared, f"requires-python {requires!r} is not a plain lower bound"
    said = re.findall(r"Python\s*(?:≥|>=)\s*(\d+\.\d+)", (REPO / "README.md").read_text())
    assert said, "the README states no Python version"
    assert {_version(v) for v in said} == {_version(declared.group(1))}


def test_the_declared_minimum_has_what_the_node_needs() -> None:
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = _version(requires.lstrip(">= "))
    # The pipeline tells a timeout from an outside cancel with Task.uncancel (3.11+); the node's loop
    # is built with asyncio.Runner(loop_factory=...) (3.11+).
    assert minimum >= (3, 11)
    assert sys.version_info[:2] >= minimum
    assert hasattr(asyncio.Task, "uncancel") and hasattr(asyncio, "Runner")
