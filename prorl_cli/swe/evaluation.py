"""``prorl eval`` for SWE datasets: SWE-bench-compatible predictions, per-instance reports, resolved rate and pass@k.

What lands in the output folder:

- ``predictions.jsonl``: one line per instance, swebench's prediction shape
  (``instance_id``, ``model_name_or_path``, ``model_patch``), from the first
  sample, so ``swebench``'s own harness can re-grade it;
- ``samples.jsonl``: every sample (``sample`` 0..n-1, job id, state, reward,
  resolved, patch);
- ``reports/<instance_id>.json``: swebench's per-instance ``report.json``
  (``{instance_id: {patch_is_None, patch_exists, patch_successfully_applied,
  resolved, infra_failure, tests_status}}``, plus ``infra_failure_reason``
  when set, as swebench writes it) of the first sample;
- ``details/<instance_id>.json``: what a person debugging the instance wants,
  every sample: the stage timings (``stage_s``: INIT, RUN, EVAL; ``eval``:
  patch apply and run seconds, and each EVAL step's status, exit status and
  seconds), ``missing`` (listed test -> the closest id the run produced), the
  log tail, and for an ``infra_failure`` its reason and step;
- ``summary.json``: swebench's run report keys (``total_instances``,
  ``resolved_ids``, ...) for the first samples, plus ``resolved_rate`` and
  ``pass_at_k`` over all samples (the unbiased estimator of Chen et al. 2021)
  and ``mean_reward`` over the graded samples (an infra failure has no reward).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2  # swebench's run report schema these keys follow


@dataclass
class Sample:
    """One rollout of one instance, as the eval report needs it."""

    instance_id: str
    sample: int
    job_id: str
    state: str
    reward: float | None
    model_patch: str | None
    report: dict[str, Any] | None  # the handler's output["report"]
    failure: dict[str, Any] | None = None  # output["failure"] when a stage failed
    stage_s: dict[str, float] = field(default_factory=dict)  # in-stage seconds of INIT, RUN, EVAL

    @property
    def resolved(self) -> bool:
        return bool(self.report and self.report.get("resolved"))

    @classmethod
    def from_result(cls, instance_id: str, sample: int, result: Any) -> Sample:
        """From a :class:`prorl_cli.protocol.JobResult` of the swe domain."""
        output = result.output if isinstance(result.output, dict) else {}
        patch = output.get("model_patch")
        report = output.get("report")
        stage_s = getattr(result, "stage_s", None)
        return cls(instance_id, sample, result.job_id, result.state, result.reward,
                   patch if isinstance(patch, str) else None, report if isinstance(report, dict) else None,
                   output.get("failure") if isinstance(output.get("failure"), dict) else None,
                   dict(stage_s) if isinstance(stage_s, dict) else {})

    def details(self) -> dict[str, Any]:
        """This sample's debugging record: state, reward, timings, missing tests, log tail, infra failure."""
        report = self.report or {}
        return {
            "sample": self.sample, "job_id": self.job_id, "state": self.state, "reward": self.reward,
            "resolved": self.resolved, "status": report.get("status"),
            "infra_failure": bool(report.get("infra_failure")),
            "infra_failure_reason": report.get("infra_failure_reason") or None,
            "infra_step": report.get("infra_step"),
            "stage_s": self.stage_s,
            "eval": {"timings": report.get("eval_timings") or {}, "steps": report.get("steps") or []},
            "missing": report.get("missing") or {},
            "grading": report.get("grading"), "grading_note": report.get("grading_note") or None,
            "test_source": report.get("test_source"), "test_command": report.get("test_command"),
            "tests_timed_out": report.get("tests_timed_out"),
            "log_tail": report.get("log_tail"),
            "failure": self.failure,
        }


def job_ids(run_id: str, instances: list[dict[str, Any]], n: int) -> list[str]:
    """The job ids of ``n`` samples of each instance under ``--run-id``: ``RUN-DIGEST-K``, instance-major.

    The digest is the row's (:func:`prorl_cli.swe.validate_run.row_digest`), not its position: a run resumed
    with ``--instance-id`` or over a dataset with rows added or removed names each instance's own jobs (a
    position would hand one instance another's result), and an edited row gets new jobs.
    """
    from prorl_cli.swe.validate_run import row_digest

    return [f"{run_id}-{row_digest(inst)}-{k}" for inst in instances for k in range(n)]


def attempt_ids(base_ids: list[str], held: Mapping[str, str]) -> tuple[list[str], int]:
    """The id to submit for each of ``base_ids`` (:func:`job_ids`) given the ids and states the broker holds.

    Submitting an id the broker holds returns that job as it ended, so a job cancelled by an interrupted run
    would come back cancelled for ever. Each sample's attempts are ``BASE``, ``BASE-a2``, ``BASE-a3``, ...: its
    latest attempt the broker holds is taken again (its result, or the job still running), unless it was
    cancelled; then the next attempt is submitted. Failed and timed-out jobs are outcomes, kept as they ended.
    Returns the ids and how many are new attempts of cancelled jobs.
    """
    ids: list[str] = []
    again = 0
    for base in base_ids:
        attempt, job_id = 1, base
        while f"{base}-a{attempt + 1}" in held:
            attempt += 1
            job_id = f"{base}-a{attempt}"
        if held.get(job_id) == "cancelled":
            job_id = f"{base}-a{attempt + 1}"
            again += 1
        ids.append(job_id)
    return ids, again


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of ``k`` samples out of ``n`` (``c`` correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def swebench_report(sample: Sample) -> dict[str, Any]:
    """swebench's per-instance report body for ``sample`` (what its ``report.json`` holds under the id)."""
    keys = ("patch_is_None", "patch_exists", "patch_successfully_applied", "resolved", "infra_failure")
    body: dict[str, Any] = {key: False for key in keys}
    if sample.model_patch is None:
        body["patch_is_None"] = True
        return body
    body["patch_exists"] = True
    if sample.report:
        for key in keys:
            body[key] = bool(sample.report.get(key, body[key]))
        if sample.report.get("infra_failure_reason"):
            body["infra_failure_reason"] = sample.report["infra_failure_reason"]  # swebench's key
        if "tests_status" in sample.report:
            body["tests_status"] = sample.report["tests_status"]
    return body


def summarize(instance_ids: list[str], samples: list[Sample], model_name: str, n: int) -> dict[str, Any]:
    """swebench's run report over the first sample of each instance, plus resolved rate and pass@k over all."""
    first = {s.instance_id: s for s in samples if s.sample == 0}
    # A job that failed (a stage raised, it timed out) saved no patch: an error, not an empty model patch.
    failed = {i for i, s in first.items() if s.state != "done" or s.failure}
    empty = sorted(i for i, s in first.items() if i not in failed and not s.model_patch)
    errors = sorted(i for i, s in first.items() if i in failed or (s.model_patch and s.report is None))
    completed = sorted(i for i, s in first.items() if i not in failed and s.model_patch and s.report is not None)
    resolved = sorted(i for i in completed if first[i].resolved)
    infra = sorted(i for i in completed if (first[i].report or {}).get("infra_failure"))
    by_instance: dict[str, list[Sample]] = {}
    for s in samples:
        by_instance.setdefault(s.instance_id, []).append(s)
    graded = [s.reward for s in samples if s.reward is not None]  # an infra failure has no reward, not a 0
    ks = sorted({1, n} | {k for k in (5, 10) if k < n})
    at_k = {str(k): sum(pass_at_k(len(ss), sum(x.resolved for x in ss), k) for ss in by_instance.values())
            / max(len(by_instance), 1) for k in ks}
    return {
        "model_name_or_path": model_name,
        "total_instances": len(instance_ids),
        "submitted_instances": len(first),
        "completed_instances": len(completed),
        "resolved_instances": len(resolved),
        "unresolved_instances": len(completed) - len(resolved),
        "infra_failure_instances": len(infra),
        "ambiguous_failure_instances": 0,
        "empty_patch_instances": len(empty),
        "error_instances": len(errors),
        "completed_ids": completed,
        "incomplete_ids": sorted(set(instance_ids) - set(first)),
        "empty_patch_ids": empty,
        "submitted_ids": sorted(first),
        "resolved_ids": resolved,
        "unresolved_ids": sorted(set(completed) - set(resolved)),
        "infra_failure_ids": infra,
        "ambiguous_failure_ids": [],
        "failure_reasons": {},
        "error_ids": errors,
        "schema_version": SCHEMA_VERSION,
        "samples_per_instance": n,
        "resolved_rate": len(resolved) / len(instance_ids) if instance_ids else 0.0,
        "mean_reward": (sum(graded) / len(graded)) if graded else 0.0,
        "graded_samples": len(graded),
        "ungraded_samples": len(samples) - len(graded),
        "pass_at_k": at_k,
    }


def report_name(instance_id: str) -> str:
    """The file name of an instance's report and details (a ``/`` in an id would name a folder)."""
    return f"{instance_id.replace('/', '__')}.json"


def remove_stale(out_dir: Path, instance_ids: list[str]) -> list[Path]:
    """Remove the ``reports/`` and ``details/`` files of instances not in this run (an earlier run into the same
    folder, over other instances): the folder then describes one run, as its ``summary.json`` and
    ``predictions.jsonl`` do, and a tool reading every report in it counts no instance of another run."""
    ours = {report_name(i) for i in instance_ids}
    removed = []
    for folder in (out_dir / "reports", out_dir / "details"):
        if folder.is_dir():
            for path in sorted(folder.glob("*.json")):
                if path.name not in ours and path.is_file():
                    path.unlink()
                    removed.append(path)
    return removed


def write_outputs(out_dir: Path, instance_ids: list[str], samples: list[Sample], model_name: str,
                  n: int) -> dict[str, Any]:
    """Write predictions, samples, per-instance reports and the summary under ``out_dir``; return the summary.
    (An earlier run's reports of other instances stay: :func:`remove_stale` removes them.)"""
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = out_dir / "reports"
    reports.mkdir(exist_ok=True)
    ordered = sorted(samples, key=lambda s: (instance_ids.index(s.instance_id), s.sample))
    with (out_dir / "predictions.jsonl").open("w", encoding="utf-8") as f:
        for s in ordered:
            if s.sample == 0:
                f.write(json.dumps({"instance_id": s.instance_id, "model_name_or_path": model_name,
                                    "model_patch": s.model_patch}) + "\n")
    with (out_dir / "samples.jsonl").open("w", encoding="utf-8") as f:
        for s in ordered:
            row = asdict(s)
            row.pop("report")
            f.write(json.dumps({**row, "resolved": s.resolved}) + "\n")
    for s in ordered:
        if s.sample == 0:
            path = reports / report_name(s.instance_id)
            path.write_text(json.dumps({s.instance_id: swebench_report(s)}, indent=2) + "\n")
    details = out_dir / "details"
    details.mkdir(exist_ok=True)
    for iid in instance_ids:
        mine = [s.details() for s in ordered if s.instance_id == iid]
        if mine:
            path = details / report_name(iid)
            path.write_text(json.dumps({"instance_id": iid, "samples": mine}, indent=2, default=str) + "\n")
    summary = summarize(instance_ids, samples, model_name, n)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
