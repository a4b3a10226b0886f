"""A pytest plugin, run inside the sandbox, that records every test outcome under its exact node id.

This file is copied into the EVAL sandbox as the module ``prorl_swe_nodeids``
and must stay self-contained: the standard library only, any Python 3 that
pytest supports, nothing imported from prorl. It appends one JSON object per
test phase (``{"nodeid", "when", "outcome", "xfail"}``) to the file named by
``PRORL_SWE_NODEIDS``; the grader folds phases into one status per test.
Node ids travel as data, so ids with spaces, brackets, backslashes or any
unicode arrive exactly as pytest wrote them (a ``-rA`` log line cannot carry
them: parsers split it on whitespace).

Only the outermost pytest process records: the plugin takes the output path
out of the environment and drops its own ``-p`` option from
``PYTEST_ADDOPTS``, so a pytest started by the tests themselves (pytest's
own suite does that) neither writes to the file nor fails to find the plugin.
Under pytest-xdist the controller receives every worker's reports.
"""

import json
import os

ENV_OUT = "PRORL_SWE_NODEIDS"
OPTION = "-p prorl_swe_nodeids"

_OUT = os.environ.pop(ENV_OUT, None)
_ADDOPTS = os.environ.get("PYTEST_ADDOPTS")
if _ADDOPTS is not None and OPTION in _ADDOPTS:
    os.environ["PYTEST_ADDOPTS"] = " ".join(_ADDOPTS.replace(OPTION, " ").split())


def _record(nodeid, when, outcome, xfail):
    if not _OUT:
        return
    line = json.dumps({"nodeid": nodeid, "when": when, "outcome": outcome, "xfail": xfail}, ensure_ascii=True)
    with open(_OUT, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def pytest_runtest_logreport(report):
    _record(report.nodeid, report.when, report.outcome, bool(getattr(report, "wasxfail", None) is not None))


def pytest_collectreport(report):
    if report.failed:
        _record(report.nodeid, "collect", "failed", False)
