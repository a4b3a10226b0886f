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
