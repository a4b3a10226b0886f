"""Shared test setup.

Under ``PRORL_REQUIRE_ALL=1`` (set by CI) a skipped test is a failure: a
green CI must mean every tier (Apptainer, bubblewrap, vLLM, ...) really ran.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_ALL = os.environ.get("PRORL_REQUIRE_ALL") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under PRORL_REQUIRE_ALL=1 (a component is missing): {reason}"
