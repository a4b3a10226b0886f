"""``prorl eval``'s files line up with swebench's: the installed package reads and re-reports them.

The per-instance report is compared with what ``swebench.harness.grading.get_eval_report``
writes for the same run, and swebench's own ``make_run_report`` is run over
the reports prorl wrote: the same resolved ids come out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from prorl_cli.swe.evaluation import Sample, pass_at_k, write_outputs
from tests.harness import need_module


def _report(resolved: bool) -> dict[str, object]:
    tests = {"FAIL_TO_PASS": {"success": ["t.py::a b"] if resolved else [], "failure": [] if resolved else ["t.py::a b"],
                              "missing": []},
             "PASS_TO_PASS": {"success": [], "failure": [], "missing": []},
             "FAIL_TO_FAIL": {"success": [], "failure": [], "missing": []},
             "PASS_TO_FAIL": {"success": [], "failure": [], "missing": []}}
    return {"patch_is_None": False, "patch_exists": True, "patch_successfully_applied": True, "resolved": resolved,
            "infra_failure": False, "tests_status": tests, "status": "RESOLVED_FULL" if resolved else "RESOLVED_NO"}


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_outputs_match_swebench_report_and_run_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need_module("swebench", "swe")
    from swebench.harness.grading import get_eval_report
    from swebench.harness.reporting import make_run_report
    from swebench.types import TestSpec

    ids = ["org__a-1", "org__b-2", "org__c-3"]
    samples = [
        Sample("org__a-1", 0, "j0", "done", 1.0, "diff a", _report(True)),
        Sample("org__a-1", 1, "j1", "done", 0.0, "diff a2", _report(False)),
        Sample("org__b-2", 0, "j2", "done", 0.0, "diff b", _report(False)),
        Sample("org__b-2", 1, "j3", "done", 1.0, "diff b2", _report(True)),
        Sample("org__c-3", 0, "j4", "done", 0.0, "", _report(False)),
        Sample("org__c-3", 1, "j5", "done", 0.0, "", _report(False)),
    ]
    out = tmp_path / "out"
    summary = write_outputs(out, ids, samples, "my/model", 2)
    assert summary["resolved_ids"] == ["org__a-1"] and summary["resolved_rate"] == pytest.approx(1 / 3)
    assert summary["pass_at_k"] == {"1": pytest.approx(1 / 3), "2": pytest.approx(2 / 3)}
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [set(p) for p in predictions] == [{"instance_id", "model_name_or_path", "model_patch"}] * 3
    assert [p["model_patch"] for p in predictions] == ["diff a", "diff b", ""]

    # swebench's own report of a resolved run, for the key names.
    log = tmp_path / "test_output.txt"
    log.write_text(">>>>> Start Test Output\nPASSED t.py::a\n>>>>> End Test Output\n")
    spec = TestSpec(instance_id="org__a-1", image="", eval_script_list=[], repo="org/a", version="1",
                    FAIL_TO_PASS=["t.py::a"], PASS_TO_PASS=[], log_parser="parse_log_pytest", eval_type="pass_and_fail")
    theirs = get_eval_report(spec, {"instance_id": "org__a-1", "model_patch": "x", "model_name_or_path": "m"},
                             str(log), include_tests_status=True)["org__a-1"]
    ours = json.loads((out / "reports" / "org__a-1.json").read_text())["org__a-1"]
    assert set(ours) == set(theirs)
    assert set(ours["tests_status"]) == set(theirs["tests_status"])
    for key, lists in ours["tests_status"].items():
        assert set(lists) == set(theirs["tests_status"][key]) | {"missing"}

    # swebench's run report over prorl's per-instance reports.
    run_dir = tmp_path / "swebench"
    for iid in ids[:2]:
        folder = run_dir / "logs" / "run_evaluation" / "r1" / "my__model" / iid
        folder.mkdir(parents=True)
        (folder / "report.json").write_text((out / "reports" / f"{iid}.json").read_text())
    monkeypatch.chdir(run_dir)
    dataset = [{"instance_id": i} for i in ids]
    path = make_run_report({p["instance_id"]: p for p in predictions}, dataset, "r1", report_dir=str(run_dir))
    run = json.loads(Path(os.fspath(path)).read_text())
    for key in ("resolved_ids", "unresolved_ids", "empty_patch_ids", "completed_ids", "total_instances"):
        assert run[key] == summary[key], key
    assert set(run) <= set(summary)


def test_details_hold_stage_timings_missing_ids_log_tail_and_the_infra_step(tmp_path: Path) -> None:
    from types import SimpleNamespace

    infra = {**_report(False), "infra_failure": True, "infra_failure_reason": "step_syntax_error",
             "infra_step": {"name": "install[0]", "source": "instance install", "kind": "setup", "status": "syntax",
                            "exit": 2, "log_tail": "syntax error near unexpected token `('"},
             "steps": [{"name": "install[0]", "source": "instance install", "kind": "setup", "status": "syntax",
                        "exit": 2, "seconds": 0.01}, {"name": "tests", "source": "default", "kind": "tests",
                                                       "status": "not_run", "exit": None, "seconds": None}],
             "eval_timings": {"apply_s": 0.2, "run_s": 0.1}, "missing": {"t.py::a b": None},
             "log_tail": ">>>>> prorl step 0 start\n...", "grading_note": "setup step install[0] ... not graded"}
    result = SimpleNamespace(job_id="j0", state="done", reward=None, stage_s={"init": 1.5, "run": 2.0, "eval": 3.0},
                             output={"model_patch": "diff a", "report": infra})
    samples = [Sample.from_result("org__a-1", 0, result),
               Sample("org__a-1", 1, "j3", "done", 0.0, "diff a2", _report(False)),
               Sample("org__b-2", 0, "j1", "done", 1.0, "diff b", _report(True)),
               Sample("org__b-2", 1, "j2", "done", 0.0, "diff b2", _report(False))]
    out = tmp_path / "out"
    summary = write_outputs(out, ["org__a-1", "org__b-2"], samples, "m", 2)
    # The infra failure has no reward: the mean is over the graded samples, not a 0 for it.
    assert summary["mean_reward"] == pytest.approx(1 / 3) and summary["ungraded_samples"] == 1
    assert summary["infra_failure_ids"] == ["org__a-1"]
    details = json.loads((out / "details" / "org__a-1.json").read_text())
    sample, _ = details["samples"]
    assert sample["stage_s"] == {"init": 1.5, "run": 2.0, "eval": 3.0} and sample["reward"] is None
    assert sample["eval"]["timings"] == {"apply_s": 0.2, "run_s": 0.1}
    assert [s["status"] for s in sample["eval"]["steps"]] == ["syntax", "not_run"]
    assert sample["missing"] == {"t.py::a b": None} and sample["log_tail"].startswith(">>>>> prorl step 0")
    assert sample["infra_failure_reason"] == "step_syntax_error" and sample["infra_step"]["exit"] == 2
    report = json.loads((out / "reports" / "org__a-1.json").read_text())["org__a-1"]
    assert report["infra_failure"] and report["infra_failure_reason"] == "step_syntax_error"  # swebench's key
    assert [s["sample"] for s in json.loads((out / "details" / "org__b-2.json").read_text())["samples"]] == [0, 1]


def test_a_job_that_failed_is_an_error_not_an_empty_patch(tmp_path: Path) -> None:
    """An INIT that could not start the image saved no patch: the summary called it an empty model patch."""
    failure = {"stage": "init", "type": "SandboxError", "message": "image swe-o-r-1 not found"}
    samples = [Sample("o__r-1", 0, "j0", "failed", None, None, None, failure),
               Sample("o__r-2", 0, "j1", "done", 0.0, "", _report(False)),
               Sample("o__r-3", 0, "j2", "done", 1.0, "diff", _report(True))]
    summary = write_outputs(tmp_path / "out", ["o__r-1", "o__r-2", "o__r-3"], samples, "m", 1)
    assert summary["error_ids"] == ["o__r-1"] and summary["error_instances"] == 1, summary
    assert summary["empty_patch_ids"] == ["o__r-2"] and summary["resolved_ids"] == ["o__r-3"], summary


def test_run_id_job_ids_follow_the_row_not_its_position() -> None:
    """`--run-id` resumes by job id: ids by position gave a run resumed with --instance-id (or over a dataset with
    a row removed) the jobs, and so the results, of other instances."""
    from prorl_cli.swe.evaluation import job_ids

    rows = [{"instance_id": f"o__r-{i}", "FAIL_TO_PASS": ["t.py::a"]} for i in range(3)]
    everything = job_ids("ev1", rows, 2)
    assert len(everything) == len(set(everything)) == 6
    assert job_ids("ev1", rows[2:], 2) == everything[4:]  # the third instance alone: its own jobs again
    assert job_ids("ev1", [rows[0], rows[2]], 2) == everything[:2] + everything[4:]
    edited = {**rows[1], "FAIL_TO_PASS": ["t.py::b"]}
    assert not set(job_ids("ev1", [edited], 2)) & set(everything)  # an edited row is run again
