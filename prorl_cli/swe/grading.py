"""Grading one EVAL run: per-test statuses by exact node id (or swebench's log parser), then swebench's rules.

Statuses come from the node-id records of ``prorl_swe_nodeids`` when the
plan grades by node id, else from the swebench log parser the plan names.
The other source fills in names the first lacks: SWE-bench lists made by
``parse_log_pytest`` hold ids cut at the first space, and those still match
the log parse. Resolution is swebench's (``get_eval_tests_report``,
``get_resolution_status``), and ``tests_status`` is swebench's own: a listed
test found in neither source counts as a failure there, as swebench counts
it (under ``fail_only`` swebench counts it as passing, its parsers logging
failures only), so swebench's ``get_resolution_status`` on the report agrees
with ``resolved``. prorl adds ``missing``: those tests again, each with the
closest id the run did produce.

A run that is no evidence about the patch is an ``infra_failure`` (no
reward, never a clean 0), with ``infra_failure_reason`` and the step, its
exit status and the tail of its output in ``infra_step``:

- a setup step (``eval_commands``, ``install``) that ``bash -n`` refuses,
  exits non-zero, or is still running when the run hits its time limit, or a
  test command or eval script that ``bash -n`` refuses;
- an instance that lists no test at all, or no FAIL_TO_PASS test (swebench
  would resolve it for any patch that keeps PASS_TO_PASS passing, the empty one too);
- a finished test step that produced none of the listed tests and no
  collection error, pytest's or unittest's ``_FailedTest`` for a test module
  that did not import, as Django's runner prints it (under ``fail_only``: no
  result at all and no sign in the log that the suite ran), unless the same run without the model patch
  produces them: then the patch stopped them (a broken conftest or import),
  and each listed test is a failure (``prorl_cli/swe/workspace.py`` makes that
  run). A test step cut at the time limit is graded as it stands: a patch that
  hangs the suite must not escape its 0;
- a pytest run graded from its log whose listed ids hold whitespace the log
  cannot carry, when they stand between the run and ``resolved``.
"""

from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.exceptions import DomainError
from prorl_cli.swe.evalrun import (
    END_TEST_OUTPUT,
    START_TEST_OUTPUT,
    SYNTAX,
    TESTS,
    TIMEOUT,
    StepOutcome,
)
from prorl_cli.swe.testplan import FAIL_ONLY, PYTEST_PARSER, TestPlan

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
#: ``infra_failure_reason`` values.
STEP_SYNTAX_ERROR, SETUP_FAILED, SETUP_TIMEOUT, SETUP_INTERRUPTED = (
    "step_syntax_error", "setup_failed", "setup_timeout", "setup_interrupted")
NO_LISTED_TESTS, NO_TESTS_COLLECTED, UNREADABLE_TEST_IDS = "no_listed_tests", "no_tests_collected", "unreadable_test_ids"
NO_FAIL_TO_PASS = "no_fail_to_pass"
#: How unittest names the test it puts in place of a test module it could not import.
FAILED_IMPORT = "unittest.loader._FailedTest"


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
    grading_note: str = ""  # why a pytest run was graded from its log, what that cost, why a run is not graded
    infra_failure_reason: str = ""  # swebench's key: why the run is no evidence (module doc)
    infra_step: dict[str, Any] | None = None  # the step behind it: name, source, status, exit, log_tail
    steps: list[dict[str, Any]] = field(default_factory=list)  # every step: name, source, kind, status, exit, seconds
    missing: dict[str, str | None] = field(default_factory=dict)  # listed test -> closest id the run produced
    tests: dict[str, str] = field(default_factory=dict)  # every test the run produced -> status
    collect_errors: list[str] = field(default_factory=list)
    test_source: str = ""  # where the test command came from (TestPlan.source)

    def swebench(self) -> dict[str, Any]:
        """The per-instance body of swebench's ``report.json`` (``{instance_id: this}``)."""
        body = {"patch_is_None": self.patch_is_None, "patch_exists": self.patch_exists,
                "patch_successfully_applied": self.patch_successfully_applied, "resolved": self.resolved,
                "infra_failure": self.infra_failure, "tests_status": self.tests_status}
        if self.infra_failure_reason:
            body["infra_failure_reason"] = self.infra_failure_reason
        return body


def _closest(name: str, ids: list[str]) -> str | None:
    """The id a listed test most likely meant: a parametrization of it, else one much like it (none: no guess)."""
    params = sorted(i for i in ids if i.startswith(name + "["))
    if params:
        return params[0]
    found = difflib.get_close_matches(name, ids, n=1, cutoff=0.6)
    return found[0] if found else None


def grade_run(plan: TestPlan, instance: dict[str, Any], fail_to_pass: list[str], pass_to_pass: list[str],
              log: str, nodeid_records: str, steps: list[StepOutcome] | None = None,
              patch_stopped_tests: bool = False) -> SweReport:
    """Grade one run of ``plan``: its output ``log``, the node-id records the plugin wrote, and each step's outcome.

    ``patch_stopped_tests``: the same run without the model patch produced the listed tests, so a run that
    produced none of them is the patch's doing (it broke a conftest, the package's import, pytest's start):
    graded, every listed test a failure, instead of ``no_tests_collected``.
    """
    grading = _swebench()
    from swebench.harness.constants import EvalType

    by_id, collect_errors = fold_nodeids(nodeid_records)
    note = ""
    if plan.log_parser is None:
        by_log = parse_log(PYTEST_PARSER, log, instance, fail_to_pass, pass_to_pass)
        plugin_ran = bool(by_id) or bool(collect_errors)  # it recorded tests, or the files it could not collect
        primary, secondary = (by_id, by_log) if plugin_ran else (by_log, {})
        label = "nodeids" if plugin_ran else f"log:{PYTEST_PARSER}"
        if not plugin_ran:
            note = ("the node-id plugin recorded no test (no pytest ran, or the test command's python "
                    "did not load it): graded from the log, whose parser cuts test ids at whitespace")
    else:
        primary, secondary = parse_log(plan.log_parser, log, instance, fail_to_pass, pass_to_pass), by_id
        label = f"log:{plan.log_parser}"
        # unittest's stand-in for a test module that did not import (Django's runner prints it as a test): the
        # collection error of such a run, so a patch that leaves the listed tests unimportable is graded, a 0.
        collect_errors += [name for name, outcome in primary.items()
                           if FAILED_IMPORT in name and outcome in (FAILED, ERROR) and name not in collect_errors]
    merged = {**secondary, **primary}
    gold = {grading.FAIL_TO_PASS: fail_to_pass, grading.PASS_TO_PASS: pass_to_pass}
    # swebench's own lists: under pass_and_fail a listed test the run never produced is a failure.
    tests_status = grading.get_eval_tests_report(merged, gold, eval_type=EvalType(plan.eval_type))

    resolve = getattr(grading, "_resolve_case", None)  # swebench's tolerance of truncated parametrized ids

    def found(name: str) -> bool:
        return (resolve(name, merged) if resolve is not None else merged.get(name)) is not None

    ids = sorted(merged)
    missing: dict[str, str | None] = {}
    for key in (grading.FAIL_TO_PASS, grading.PASS_TO_PASS):
        absent = [name for name in gold[key] if not found(name)]
        for name in absent:
            missing[name] = _closest(name, ids)
        tests_status[key]["missing"] = absent  # prorl's extra list; swebench's "failure" keeps them
    for key in (grading.FAIL_TO_FAIL, grading.PASS_TO_FAIL):
        tests_status[key].setdefault("missing", [])
    status = grading.get_resolution_status(tests_status)
    resolved = status == grading.ResolvedStatus.FULL.value

    outcomes = steps or []
    reason, culprit, why = _infra(plan, outcomes, merged, collect_errors, log, fail_to_pass, pass_to_pass,
                                  any(found(name) for name in [*fail_to_pass, *pass_to_pass]))
    # A test step cut at the time limit is graded as it stands: a patch that hangs the suite keeps its 0.
    cut = any(s.kind == TESTS and s.status == TIMEOUT for s in outcomes)
    # A pytest log cannot name an id with whitespace in it: such a listed test is missing for the
    # parser's sake, not the patch's, so the run is not graded (no correct patch scores 0 for it).
    unreadable = [name for name in missing if note and any(c.isspace() for c in name)]
    if not reason and not cut and unreadable and not resolved:
        reason, why = UNREADABLE_TEST_IDS, (
            f"{len(unreadable)} listed test id(s) with whitespace cannot be read from the log "
            f"(e.g. {unreadable[0]!r}): missing, and the run is not graded")
    blamed = patch_stopped_tests and reason == NO_TESTS_COLLECTED
    if blamed:
        why = ("the test run produced none of the listed tests, and without the model patch it does: the patch "
               "stopped them, and each counts as a failure")
    if reason:
        if plan.eval_type == FAIL_ONLY:
            # swebench counts an absent test as passing under fail_only; in a run that is no evidence it is not.
            for key in (grading.FAIL_TO_PASS, grading.PASS_TO_PASS):
                lists = tests_status[key]
                lists["success"] = [name for name in lists["success"] if name not in lists["missing"]]
                lists["failure"] = [*lists["failure"], *(n for n in lists["missing"] if n not in lists["failure"])]
            status = grading.get_resolution_status(tests_status)
        resolved = False
        # The plugin's note explains a run whose tests ran; a setup step that stopped them is the whole story.
        note = f"{note}; {why}" if note and reason in (NO_TESTS_COLLECTED, UNREADABLE_TEST_IDS) else why
    if blamed:
        reason, culprit = "", None
    return SweReport(patch_exists=True, patch_successfully_applied=True, resolved=resolved,
                     infra_failure=bool(reason), tests_status=tests_status, status=status, grading=label,
                     grading_note=note, infra_failure_reason=reason, infra_step=culprit,
                     steps=[_step_record(o) for o in outcomes], missing=missing, tests=dict(primary),
                     collect_errors=collect_errors, test_source=plan.source)


def _step_record(outcome: StepOutcome) -> dict[str, Any]:
    return {"name": outcome.name, "source": outcome.source, "kind": outcome.kind, "status": outcome.status,
            "exit": outcome.exit, "seconds": outcome.seconds}


def _infra(plan: TestPlan, steps: list[StepOutcome], merged: dict[str, str], collect_errors: list[str], log: str,
           fail_to_pass: list[str], pass_to_pass: list[str],
           listed_found: bool) -> tuple[str, dict[str, Any] | None, str]:
    """Why the run is no evidence about the patch: (reason, the step behind it, a sentence), or ("", None, "")."""
    for step in steps:
        if step.failed_setup:
            reason = {SYNTAX: STEP_SYNTAX_ERROR, TIMEOUT: SETUP_TIMEOUT}.get(step.status, SETUP_FAILED)
            if step.status not in (SYNTAX, TIMEOUT) and step.exit is None:
                reason = SETUP_INTERRUPTED
            what = {SYNTAX: "is not shell (bash -n refused it)", TIMEOUT: "ran past the run's time limit"}.get(
                step.status, f"exited with status {step.exit}" if step.exit is not None else "did not finish")
            return reason, _culprit(step), (f"{step.kind} step {step.name} ({step.source}) {what}: the tests "
                                            "did not run as the instance says, and the run is not graded")
    if not fail_to_pass and not pass_to_pass:
        return NO_LISTED_TESTS, None, "the instance lists no test (FAIL_TO_PASS and PASS_TO_PASS are empty)"
    if not fail_to_pass:
        # swebench resolves it whenever PASS_TO_PASS passes: the empty patch would score 1.
        return NO_FAIL_TO_PASS, None, ("the instance lists no FAIL_TO_PASS test: every patch that keeps PASS_TO_PASS "
                                       "passing (the empty one too) would resolve it, so the run is not graded")
    test_step = next((s for s in steps if s.kind == TESTS), None)
    if test_step is not None and test_step.status == TIMEOUT:
        return "", None, ""  # cut at the time limit: graded as it stands (a hanging patch keeps its 0)
    if plan.eval_type == FAIL_ONLY:
        suite_ran = getattr(_swebench(), "SUITE_RAN", None)
        ran = bool(merged) or bool(collect_errors) or (suite_ran is not None and bool(suite_ran.search(log)))
    else:
        ran = listed_found or bool(collect_errors)
    if ran:
        return "", None, ""
    return NO_TESTS_COLLECTED, _culprit(test_step) if test_step else None, (
        "the test run produced none of the listed tests and no collection error: it is no evidence about the "
        "patch, and the run is not graded")


def _culprit(step: StepOutcome) -> dict[str, Any]:
    return {"name": step.name, "source": step.source, "kind": step.kind, "status": step.status, "exit": step.exit,
            "log_tail": step.log_tail}
