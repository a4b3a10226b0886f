"""``prorl swe validate``: what each run of an instance showed, and the instance's class.

Every instance is run ``K`` times with its gold patch (task ``swe_oracle``)
and once with its test patch alone (task ``swe_no_fix``). Each run becomes a
:class:`RunOutcome`: evaluated (the tests ran and were graded) with every
listed test's pass or fail, or not evaluated with the reason. The instance's
class (:func:`classify`), the first rule that holds:

- ``gold-fails``: the gold patch is missing or does not apply (``swe_oracle``'s RUN refused it);
- ``f2p-passes-without-fix``: the instance lists no FAIL_TO_PASS test (EVAL
  grades none of its runs: ``no_fail_to_pass``);
- ``env-broken``: some run could not be evaluated (a stage failed, the job
  timed out, a setup step failed, no listed test ran: an ``infra_failure``).
  It is reported with each run's reason, never scored;
- ``gold-fails``: a listed test fails in every gold run;
- ``f2p-passes-without-fix``: a FAIL_TO_PASS test (not flaky) passes with the
  test patch alone;
- ``flaky``: a listed test passes in some gold runs and fails in others;
- ``valid``.

:func:`clean_row` makes the row ``clean.jsonl`` holds: valid rows as they
are, flaky rows with their flaky ids removed from the lists (or dropped,
by policy); a row left with no FAIL_TO_PASS test is dropped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GOLD, NO_FIX = "gold", "no_fix"
#: The task each kind of run is.
TASKS = {GOLD: "swe_oracle", NO_FIX: "swe_no_fix"}
VALID, ENV_BROKEN, GOLD_FAILS, F2P_PASSES, FLAKY = (
    "valid", "env-broken", "gold-fails", "f2p-passes-without-fix", "flaky")
CLASSES = (VALID, FLAKY, F2P_PASSES, GOLD_FAILS, ENV_BROKEN)
#: What a flaky row becomes in clean.jsonl.
REMOVE_IDS, DROP_ROW = "remove-ids", "drop-row"
FLAKY_POLICIES = (REMOVE_IDS, DROP_ROW)
LISTS = ("FAIL_TO_PASS", "PASS_TO_PASS")
PASS, FAIL = "pass", "fail"


@dataclass(frozen=True)
class RunOutcome:
    """One run of one instance: graded per listed test, or why it could not be."""

    job_id: str
    kind: str  # GOLD or NO_FIX
    k: int  # which gold run (0 for NO_FIX)
    state: str  # the job's final state
    evaluated: bool
    problem: str = ""  # why the run is no evidence ("" when evaluated)
    failed_stage: str = ""  # the stage that raised, for a job that failed
    failure_type: str = ""  # the exception's type name (DomainError: the handler refused the instance)
    tests: dict[str, str] = field(default_factory=dict)  # listed test -> PASS / FAIL (missing counts as FAIL)
    #: Listed tests the run never produced (not collected), each with the closest id it did produce.
    missing: dict[str, str | None] = field(default_factory=dict)
    stage_s: dict[str, float] = field(default_factory=dict)
    eval_timings: dict[str, float] = field(default_factory=dict)  # EVAL's apply_s, run_s

    @classmethod
    def from_result(cls, kind: str, k: int, result: Any) -> RunOutcome:
        """From a :class:`prorl_cli.protocol.JobResult` of ``swe_oracle`` or ``swe_no_fix``."""
        output = result.output if isinstance(result.output, dict) else {}
        stage_s = dict(result.stage_s) if isinstance(result.stage_s, dict) else {}
        common = {"job_id": result.job_id, "kind": kind, "k": k, "state": result.state, "stage_s": stage_s}
        failure = output.get("failure") if isinstance(output.get("failure"), dict) else None
        if result.state != "done" or failure:
            kind_of = ""
            if failure:
                stage, kind_of = str(failure.get("stage", "")), str(failure.get("type", ""))
                problem = f"{stage} failed: {kind_of}: {failure.get('message', '')}"
            else:
                error = result.error or {}
                stage = str(result.critical_error or "")
                detail = error.get("message") if isinstance(error, dict) else ""
                problem = f"job {result.state}" + (f" in {stage}" if stage else "") + (f": {detail}" if detail else "")
            return cls(**common, evaluated=False, problem=problem.strip()[:2000], failed_stage=stage,
                       failure_type=kind_of)
        report = output.get("report")
        if not isinstance(report, dict):
            return cls(**common, evaluated=False, problem="the job's output holds no test report")
        timings = report.get("eval_timings") if isinstance(report.get("eval_timings"), dict) else {}
        common["eval_timings"] = timings
        if report.get("infra_failure"):
            step = report.get("infra_step") or {}
            where = f" (step {step.get('name')}, exit {step.get('exit')})" if isinstance(step, dict) and step else ""
            note = str(report.get("grading_note") or "")
            problem = f"infra_failure: {report.get('infra_failure_reason') or '?'}{where}" + (f": {note}" if note else "")
            tail = step.get("log_tail") if isinstance(step, dict) else None
            last = [line for line in tail.splitlines() if line.strip()][-1:] if isinstance(tail, str) else []
            if last:  # what the step said last ("pytest: command not found") is often the whole story
                problem = f"infra_failure: {report.get('infra_failure_reason') or '?'}{where}, its log ends: " \
                          f"{last[0].strip()[:300]!r}" + (f"; {note}" if note else "")
            return cls(**common, evaluated=False, problem=problem[:2000])
        if not report.get("patch_successfully_applied"):
            return cls(**common, evaluated=False,
                       problem=f"the patch did not apply in EVAL ({report.get('status') or 'not applied'})")
        tests: dict[str, str] = {}
        status = report.get("tests_status") or {}
        for name in LISTS:
            lists = status.get(name) or {}
            for test in lists.get("success") or []:
                tests[test] = PASS
            for test in lists.get("failure") or []:  # swebench files a missing test as a failure
                tests[test] = FAIL
        raw_missing = report.get("missing")
        missing = ({str(k): (str(v) if v is not None else None) for k, v in raw_missing.items()}
                   if isinstance(raw_missing, dict) else {})
        return cls(**common, evaluated=True, tests=tests, missing=missing)

    def summary(self) -> dict[str, Any]:
        """What the report keeps of this run (the per-test statuses are summed up in the instance's lists)."""
        out = {k: v for k, v in asdict(self).items() if k != "tests"}
        out["failed_tests"] = sorted(t for t, s in self.tests.items() if s == FAIL)
        return out


@dataclass
class Verdict:
    """One instance's class, why, and the tests behind it."""

    instance_id: str
    status: str
    reason: str
    evaluated: bool  # every run was graded (False: env-broken, or a gold patch that does not apply)
    flaky: list[str] = field(default_factory=list)  # listed tests with both outcomes over the gold runs
    gold_failures: list[str] = field(default_factory=list)  # listed tests failing in every gold run
    passes_without_fix: list[str] = field(default_factory=list)  # FAIL_TO_PASS tests passing with the test patch alone
    runs: list[dict[str, Any]] = field(default_factory=list)
    clean: str = ""  # "kept", "kept without N flaky id(s)", or why the row is not in clean.jsonl
    #: Of gold_failures, the ones no gold run produced at all: a wrong or stale id in the row, not a broken fix.
    never_ran: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def classify(instance: dict[str, Any], gold: list[RunOutcome], no_fix: RunOutcome) -> Verdict:
    """The class of ``instance`` from its gold runs and its run with the test patch alone (module doc)."""
    iid = str(instance["instance_id"])
    f2p = [str(t) for t in instance.get("FAIL_TO_PASS") or []]
    p2p = [str(t) for t in instance.get("PASS_TO_PASS") or []]
    runs = [r.summary() for r in [*gold, no_fix]]
    # swe_oracle's RUN applies the gold patch and refuses (DomainError) one that is missing or does not apply.
    unapplied = [r for r in gold if not r.evaluated and r.failed_stage == "run" and r.failure_type == "DomainError"]
    if unapplied:
        return Verdict(iid, GOLD_FAILS, f"the gold patch could not be applied: {unapplied[0].problem}", False, runs=runs)
    broken = [r for r in [*gold, no_fix] if not r.evaluated]
    if not f2p:  # EVAL grades no run of it (no_fail_to_pass): the instance, not the environment, is at fault
        return Verdict(iid, F2P_PASSES, "FAIL_TO_PASS is empty: nothing fails without the fix", not broken, runs=runs)
    if broken:
        reasons = list(dict.fromkeys(f"{r.kind} run: {r.problem}" for r in broken))
        return Verdict(iid, ENV_BROKEN, f"{len(broken)} of {len(gold) + 1} run(s) not evaluated; " + "; ".join(reasons),
                       False, runs=runs)
    flaky, failing = [], []
    for test in dict.fromkeys([*f2p, *p2p]):
        seen = {r.tests.get(test, FAIL) for r in gold}
        if seen == {PASS, FAIL}:
            flaky.append(test)
        elif seen == {FAIL}:
            failing.append(test)
    passing = [t for t in f2p if t not in flaky and no_fix.tests.get(t, FAIL) == PASS]
    never_ran = [t for t in failing if all(t in r.missing for r in gold)]
    verdict = Verdict(iid, VALID, "", True, flaky, failing, passing, runs, never_ran=never_ran)
    ran_and_failed = [t for t in failing if t not in never_ran]
    if ran_and_failed:
        verdict.status = GOLD_FAILS
        verdict.reason = f"{len(ran_and_failed)} listed test(s) fail in every gold run, e.g. {ran_and_failed[0]!r}"
        if never_ran:
            verdict.reason += f"; {len(never_ran)} more never ran, e.g. {never_ran[0]!r}"
    elif never_ran:
        verdict.status = GOLD_FAILS
        closest = gold[0].missing.get(never_ran[0])
        verdict.reason = (f"{len(never_ran)} listed test(s) never ran in any gold run (no test of that id was "
                          f"collected: a wrong or stale id in the row), e.g. {never_ran[0]!r}"
                          + (f"; the closest id the run produced: {closest!r}" if closest else ""))
    elif passing:
        verdict.status = F2P_PASSES
        verdict.reason = f"{len(passing)} FAIL_TO_PASS test(s) pass with the test patch alone, e.g. {passing[0]!r}"
    elif flaky:
        verdict.status = FLAKY
        verdict.reason = f"{len(flaky)} listed test(s) both pass and fail over {len(gold)} gold runs, e.g. {flaky[0]!r}"
    return verdict


def clean_row(instance: dict[str, Any], verdict: Verdict, policy: str) -> dict[str, Any] | None:
    """The row clean.jsonl holds for ``instance`` (None: left out); sets ``verdict.clean`` to say which."""
    if verdict.status == VALID:
        verdict.clean = "kept"
        return instance
    if verdict.status != FLAKY:
        verdict.clean = f"dropped: {verdict.status}"
        return None
    if policy == DROP_ROW:
        verdict.clean = "dropped: flaky (--flaky drop-row)"
        return None
    row = dict(instance)
    for name in LISTS:
        row[name] = [t for t in instance.get(name) or [] if t not in verdict.flaky]
    if not row["FAIL_TO_PASS"]:
        verdict.clean = "dropped: every FAIL_TO_PASS test is flaky"
        return None
    verdict.clean = f"kept without {len(verdict.flaky)} flaky id(s)"
    return row
