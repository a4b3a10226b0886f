"""SWE-bench grading: which tests a test patch touches, the per-test log parse, FAIL_TO_PASS / PASS_TO_PASS.

The log parser and the grading rules are the ``swebench`` package's
(``swebench.harness.log_parsers`` and ``swebench.harness.grading``), so a
reward here means what it means on SWE-bench. Install with
``pip install 'prorl[swe]'``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.exceptions import DomainError


def test_files(test_patch: str) -> list[str]:
    """Files a (unified, git) test patch creates or changes, in order."""
    files = []
    for m in re.finditer(r"^\+\+\+ b/(\S+)", test_patch, re.MULTILINE):
        if m.group(1) not in files:
            files.append(m.group(1))
    return files


def test_targets(test_patch: str, *test_names: list[str]) -> list[str]:
    """Test files to run: those the test patch touches, plus the files of pytest node ids in ``test_names``."""
    files = test_files(test_patch)
    for names in test_names:
        for name in names:
            path = name.split("::", 1)[0]
            if "::" in name and path.endswith(".py") and path not in files:
                files.append(path)
    return files


def test_list(value: Any, field_name: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list (SWE-bench ships them as JSON strings)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DomainError(f"swe: {field_name} is neither a list nor a JSON list: {e.msg}") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DomainError(f"swe: {field_name} must be a list of test names, got {value!r}")
    return value


@functools.lru_cache(maxsize=1)
def _swebench() -> Any:
    try:
        from swebench.harness import grading
        from swebench.harness.log_parsers import python as parsers
    except ImportError as e:
        raise DomainError("swe: the 'swebench' package is missing (pip install 'prorl[swe]')") from e
    return grading, parsers


def parse_pytest_log(log: str) -> dict[str, str]:
    """Per-test status (PASSED, FAILED, ERROR, SKIPPED, XFAIL) from a ``pytest -rA`` log."""
    _, parsers = _swebench()
    status: dict[str, str] = parsers.parse_log_pytest(log, None)
    return status


@dataclass
class SweReport:
    """The graded outcome of one instance."""

    resolved: bool
    status: str  # swebench's RESOLVED_FULL / RESOLVED_PARTIAL / RESOLVED_NO
    tests: dict[str, str] = field(default_factory=dict)  # every parsed test -> status
    fail_to_pass: dict[str, list[str]] = field(default_factory=dict)  # {"success": [...], "failure": [...]}
    pass_to_pass: dict[str, list[str]] = field(default_factory=dict)


def grade(status_map: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> SweReport:
    """Resolved only when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes."""
    grading, _ = _swebench()
    report = grading.get_eval_tests_report(
        status_map, {grading.FAIL_TO_PASS: fail_to_pass, grading.PASS_TO_PASS: pass_to_pass}
    )
    status = grading.get_resolution_status(report)
    return SweReport(
        resolved=status == grading.ResolvedStatus.FULL.value,
        status=status,
        tests=dict(status_map),
        fail_to_pass=report[grading.FAIL_TO_PASS],
        pass_to_pass=report[grading.PASS_TO_PASS],
    )
