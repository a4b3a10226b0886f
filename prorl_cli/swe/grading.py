"""Grading one EVAL run: per-test statuses by exact node id (or swebench's log parser), then swebench's rules.

Statuses come from the node-id records of ``prorl_swe_nodeids`` when the
plan grades by node id, else from the swebench log parser the plan names.
The other source fills in names the first lacks: SWE-bench lists made by
``parse_log_pytest`` hold ids cut at the first space, and those still match
the log parse. Resolution is swebench's (``get_eval_tests_report``,
``get_resolution_status``). A listed test found in neither source is
``missing``: reported in its own list with the closest id the run did
produce, and never counted as passing; under ``pass_and_fail`` grading it
leaves the instance unresolved, as in swebench.
"""

from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.exceptions import DomainError
from prorl_cli.swe.testplan import FAIL_ONLY, PYTEST_PARSER, TestPlan

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"


@functools.lru_cache(maxsize=1)
def _swebench() -> Any:
    try:
        from swebench.harness import grading
    except ImportError as e:
        raise DomainError("swe: the 'swebench' package is missing (pip install 'prorl[swe]')") from e
    return grading


def fold_nodeids(records: str) -> tuple[dict[str, str], list[str]]:
    """Per-test status from the plugin's JSON lines, and the node ids whose collection failed.

    Phases fold as pytest's ``-rA`` summary does: a failed setup is ERROR, a
    failed call FAILED, a failed teardown turns the test into ERROR, an
    expected failure XFAIL (an unexpected pass PASSED); a later run of the
    same id replaces an earlier one.
    """
    status: dict[str, str] = {}
    collect_errors: list[str] = []
    for lineno, line in enumerate(records.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            nodeid, when, outcome, xfail = rec["nodeid"], rec["when"], rec["outcome"], bool(rec.get("xfail"))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DomainError(f"swe: node-id record {lineno} is malformed: {line[:200]!r}") from e
        new: str | None = None
        if when == "collect":
            collect_errors.append(nodeid)
        elif when == "setup":
            new = ERROR if outcome == "failed" else (XFAIL if xfail else SKIPPED) if outcome == "skipped" else None
        elif when == "call":
            new = {"passed": PASSED, "failed": FAILED, "skipped": XFAIL if xfail else SKIPPED}.get(outcome)
        elif when == "teardown" and outcome == "failed":
            new = ERROR
        if new is not None:
            status[nodeid] = new
    return status, collect_errors


def test_output(log: str) -> str:
    """The part of ``log`` between swebench's start and end markers, or all of it."""
    if START_TEST_OUTPUT in log and END_TEST_OUTPUT in log:
        return log.split(START_TEST_OUTPUT, 1)[1].split(END_TEST_OUTPUT, 1)[0]
    return log


def parse_log(parser: str, log: str, instance: dict[str, Any], fail_to_pass: list[str],
              pass_to_pass: list[str]) -> dict[str, str]:
    """swebench's ``parser`` (a ``PARSER_REGISTRY`` name) over ``log``."""
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.types import TestSpec

    spec = TestSpec(instance_id=str(instance.get("instance_id", "")), image="", eval_script_list=[],
                    repo=str(instance.get("repo", "")), version=str(instance.get("version", "")),
                    FAIL_TO_PASS=fail_to_pass, PASS_TO_PASS=pass_to_pass, log_parser=parser)
    result: dict[str, str] = PARSER_REGISTRY[parser](test_output(log), spec)
    return result


@dataclass
class SweReport:
    """One instance's graded outcome. The first five fields and ``tests_status`` are swebench's report keys."""

    patch_is_None: bool = False  # noqa: N815 (swebench's key)
    patch_exists: bool = False
    patch_successfully_applied: bool = False
    resolved: bool = False
    infra_failure: bool = False
    #: FAIL_TO_PASS / PASS_TO_PASS / FAIL_TO_FAIL / PASS_TO_FAIL -> {"success", "failure", "missing"}
    tests_status: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    status: str = "RESOLVED_NO"  # swebench's RESOLVED_FULL / RESOLVED_PARTIAL / RESOLVED_NO
    grading: str = ""  # "nodeids", or "log:<parser>"
    grading_note: str = ""  # why a pytest run was graded from its log, and what that cost
    missing: dict[str, str | None] = field(default_factory=dict)  # listed test -> closest id the run produced
    tests: dict[str, str] = field(default_factory=dict)  # every test the run produced -> status
    collect_errors: list[str] = field(default_factory=list)
    test_source: str = ""  # where the test command came from (TestPlan.source)

    def swebench(self) -> dict[str, Any]:
        """The per-instance body of swebench's ``report.json`` (``{instance_id: this}``)."""
        return {"patch_is_None": self.patch_is_None, "patch_exists": self.patch_exists,
                "patch_successfully_applied": self.patch_successfully_applied, "resolved": self.resolved,
                "infra_failure": self.infra_failure, "tests_status": self.tests_status}


def _closest(name: str, ids: list[str]) -> str | None:
    found = difflib.get_close_matches(name, ids, n=1, cutoff=0.0)
    return found[0] if found else None


def grade_run(plan: TestPlan, instance: dict[str, Any], fail_to_pass: list[str], pass_to_pass: list[str],
              log: str, nodeid_records: str) -> SweReport:
    """Grade one run of ``plan``: its output ``log`` and the node-id records the plugin wrote."""
    grading = _swebench()
    from swebench.harness.constants import EvalType

    by_id, collect_errors = fold_nodeids(nodeid_records)
    note = ""
    if plan.log_parser is None:
        by_log = parse_log(PYTEST_PARSER, log, instance, fail_to_pass, pass_to_pass)
        primary, secondary = (by_id, by_log) if by_id else (by_log, {})
        label = "nodeids" if by_id else f"log:{PYTEST_PARSER}"
        if not by_id:
            note = ("the node-id plugin recorded no test (no pytest ran, or the test command's python "
                    "did not load it): graded from the log, whose parser cuts test ids at whitespace")
    else:
        primary, secondary = parse_log(plan.log_parser, log, instance, fail_to_pass, pass_to_pass), by_id
        label = f"log:{plan.log_parser}"
    merged = {**secondary, **primary}
    gold = {grading.FAIL_TO_PASS: fail_to_pass, grading.PASS_TO_PASS: pass_to_pass}
    tests_status = grading.get_eval_tests_report(merged, gold, eval_type=EvalType(plan.eval_type))
    status = grading.get_resolution_status(tests_status)

    resolve = getattr(grading, "_resolve_case", None)  # swebench's tolerance of truncated parametrized ids

    def found(name: str) -> bool:
        return (resolve(name, merged) if resolve is not None else merged.get(name)) is not None

    ids = sorted(merged)
    missing: dict[str, str | None] = {}
    for key in (grading.FAIL_TO_PASS, grading.PASS_TO_PASS):
        lists = tests_status[key]
        absent = [name for name in gold[key] if not found(name)]
        for name in absent:
            missing[name] = _closest(name, ids)
        lists["missing"] = absent
        if plan.eval_type != FAIL_ONLY:  # swebench files them as failures; here they are their own list
            lists["failure"] = [name for name in lists["failure"] if name not in absent]
    for key in (grading.FAIL_TO_FAIL, grading.PASS_TO_FAIL):
        tests_status[key].setdefault("missing", [])
    resolved = status == grading.ResolvedStatus.FULL.value
    # A pytest log cannot name an id with whitespace in it: such a listed test is missing for the
    # parser's sake, not the patch's, so the run is not graded (no correct patch scores 0 for it).
    unreadable = [name for name in missing if note and any(c.isspace() for c in name)]
    infra_failure = bool(unreadable) and not resolved
    if infra_failure:
        note += (f"; {len(unreadable)} listed test id(s) with whitespace cannot be read from the log "
                 f"(e.g. {unreadable[0]!r}): missing, not failed, and the run is not graded")
    return SweReport(patch_exists=True, patch_successfully_applied=True, resolved=resolved,
                     infra_failure=infra_failure, tests_status=tests_status, status=status, grading=label,
                     grading_note=note, missing=missing, tests=dict(primary), collect_errors=collect_errors,
                     test_source=plan.source)
