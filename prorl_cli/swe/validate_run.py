"""``prorl swe validate``: the jobs of a validation, the ledger that makes it resumable, and running them.

Each instance gets ``K`` gold runs and one run with the test patch alone
(:mod:`prorl_cli.swe.validation`). A run's first job id is
``<run id>-<row digest>-<kind><k>``: the run id is made once and kept in the
output folder, the row digest changes with the instance (and its image), so
a second run of the same folder submits only what has no result yet, and
an edited row is validated again. On a deployment the broker answers an id it
already holds with that job, so a run cut short picks its jobs up again
where they run.

Every result is appended to ``results.jsonl`` in the output folder (the
JobResult records ``prorl submit --out`` writes, so ``prorl report`` and
``prorl inspect`` read it): that file is the ledger. A run whose last job was
cancelled (or, when asked, could not be evaluated) runs again as a new
attempt, ``<first id>-a2``, ``-a3``, ...: a new id, since a broker answers a
known id with the job it holds.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import DatasetError
from prorl_cli.protocol import JobResult
from prorl_cli.swe.images import repo_key
from prorl_cli.swe.validation import GOLD, NO_FIX, TASKS

STATE_FILE = "validate.json"
RESULTS_FILE = "results.jsonl"
#: Jobs per submit request: a large dataset goes to the broker in slices, every slice at once.
SUBMIT_SLICE = 500


@dataclass(frozen=True)
class PlannedJob:
    """One run of one instance."""

    job_id: str
    instance_id: str
    kind: str  # GOLD or NO_FIX
    k: int

    @property
    def task(self) -> str:
        return TASKS[self.kind]


def row_digest(instance: dict[str, Any]) -> str:
    """A short digest of the instance as submitted: an edited row (or a new image) gets new job ids."""
    text = json.dumps(instance, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def plan_jobs(instances: list[dict[str, Any]], runs: int, run_id: str) -> list[PlannedJob]:
    """``runs`` gold runs and one run with the test patch alone per instance."""
    jobs = []
    for inst in instances:
        stem = f"{run_id}-{row_digest(inst)}"
        iid = str(inst["instance_id"])
        jobs += [PlannedJob(f"{stem}-{GOLD}{k}", iid, GOLD, k) for k in range(runs)]
        jobs.append(PlannedJob(f"{stem}-{NO_FIX}", iid, NO_FIX, 0))
    return jobs


def run_id_for(out: Path, dataset: Path) -> str:
    """The run id kept in ``out`` (made on the first run): the same folder resumes the same jobs."""
    path = out / STATE_FILE
    if path.is_file():
        try:
            state = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not JSON ({e.msg}); remove it to start this validation afresh") from e
        if isinstance(state, dict) and isinstance(state.get("run_id"), str) and state["run_id"]:
            return state["run_id"]
        raise DatasetError(f"{path}: holds no run_id; remove it to start this validation afresh")
    run_id = f"val{secrets.token_hex(4)}"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run_id": run_id, "dataset": str(dataset)}, indent=2) + "\n")
    return run_id


class Ledger:
    """The finished results of a validation folder (``results.jsonl``), read at start and appended as they come."""

    def __init__(self, out: Path) -> None:
        self.path = out / RESULTS_FILE
        self.results: dict[str, JobResult] = {}
        self.unreadable = 0  # lines cut short by a kill, or not a result: their jobs run again
        text = self.path.read_text(encoding="utf-8", errors="replace") if self.path.is_file() else ""
        self._cut = bool(text) and not text.endswith("\n")  # the next line must not continue a half-written one
        if text:
            for line in text.splitlines():
                if not line.strip():
                    continue
                try:
                    result = JobResult.from_wire(json.loads(line))
                except (json.JSONDecodeError, ValueError):
                    self.unreadable += 1
                    continue
                self.results[result.job_id] = result

    def add(self, result: JobResult) -> None:
        """Record a result (a cancelled job's too: the next attempt of its run gets a new id)."""
        self.results[result.job_id] = result
        with self.path.open("a", encoding="utf-8") as f:
            f.write(("\n" if self._cut else "") + json.dumps(result.to_wire(), default=str) + "\n")
        self._cut = False

    def latest(self, job: PlannedJob) -> tuple[JobResult | None, str]:
        """The result of the run's last attempt (None: none yet), and the id of its next attempt."""
        last, attempt, job_id = None, 1, job.job_id
        while job_id in self.results:
            last = self.results[job_id]
            attempt += 1
            job_id = f"{job.job_id}-a{attempt}"
        return last, job_id


def to_run(jobs: list[PlannedJob], ledger: Ledger, retry_not_evaluated: bool) -> list[tuple[PlannedJob, str]]:
    """The runs to submit, each with the id of its next attempt: no result yet, a cancelled last attempt,
    or (``retry_not_evaluated``) a last attempt that could not be evaluated."""
    from prorl_cli.swe.validation import RunOutcome

    todo = []
    for job in jobs:
        last, next_id = ledger.latest(job)
        again = last is None or last.state == "cancelled"
        if not again and retry_not_evaluated and last is not None:
            again = not RunOutcome.from_result(job.kind, job.k, last).evaluated
        if again:
            todo.append((job, next_id if last is not None else job.job_id))
    return todo


def submit_and_collect(client: Any, todo: list[tuple[PlannedJob, str]], instances: dict[str, dict[str, Any]],
                       timeout_s: float | None, on_result: Callable[[JobResult], None]) -> None:
    """Submit every run of ``todo`` under its attempt's id (slices of :data:`SUBMIT_SLICE`); hand each
    result to ``on_result``."""
    for task in dict.fromkeys(j.task for j, _ in todo):
        mine = [(j, job_id) for j, job_id in todo if j.task == task]
        for start in range(0, len(mine), SUBMIT_SLICE):
            part = mine[start:start + SUBMIT_SLICE]
            client.submit(task, [instances[j.instance_id] for j, _ in part], job_ids=[job_id for _, job_id in part],
                          timeout_s=timeout_s)
    for result in client.as_completed([job_id for _, job_id in todo]):
        on_result(result)


def image_for(instance: dict[str, Any], repo_images: dict[str, str]) -> str | None:
    """The image ``repo_images`` gives ``instance``: by instance id, ``repo@version`` (:func:`repo_key`), then ``repo``."""
    found = (repo_images.get(str(instance["instance_id"])) or repo_images.get(repo_key(instance))
             or repo_images.get(str(instance["repo"])))
    return str(found) if found else None


def job_instance(instance: dict[str, Any], repo_images: dict[str, str]) -> tuple[dict[str, Any], str | None]:
    """The instance as its jobs get it, and its image from ``repo_images`` (None: the map has none for it).

    Its ``settings`` (its own entries win) carry ``repo_images`` when a map is given, and turn the
    history scrub off: no agent works in a validation's sandboxes, and on a large repository the
    scrub's repack is most of INIT. A ``settings`` that is not a map is a :class:`DatasetError` naming the instance.
    """
    own_settings = instance.get("settings")
    if own_settings is not None and not isinstance(own_settings, dict):
        raise DatasetError(f"instance {instance.get('instance_id')}: 'settings' must be a map of handler settings, "
                           f"got {type(own_settings).__name__} {own_settings!r:.80}")
    settings = dict(own_settings or {})
    settings.setdefault("scrub_history", False)
    image = None
    if repo_images:
        own = settings.get("repo_images")
        merged = {**repo_images, **(own if isinstance(own, dict) else {})}
        settings["repo_images"] = merged
        image = image_for(instance, merged)
    return {**instance, "settings": settings}, image


def read_repo_images(path: Path) -> dict[str, str]:
    """A ``repo_images`` JSON map (``prorl build-images --swe`` writes one): key -> image name or .sif path."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path}: cannot read a repo_images map: {e}") from e
    if isinstance(data, dict) and isinstance(data.get("repo_images"), dict):
        data = data["repo_images"]
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise DatasetError(f"{path}: a repo_images map is a JSON object of strings (key -> image)")
    return dict(data)


def embedded_config(config: Any, parallel: int) -> dict[str, Any]:
    """A one-machine deployment's configuration: the user's sandbox, images and swe settings; pools of ``parallel``."""
    data = config.to_dict()
    out: dict[str, Any] = {
        "sandbox": data["sandbox"], "images": data["images"], "jobs": data["jobs"],
        # One self-contained run; test runs share this machine's CPUs: a late heartbeat is a busy node, not a dead one.
        "broker": {"journal": False, "heartbeat_liveness": 20},
        "node": {"n_init": parallel, "n_run": parallel, "n_eval": parallel},
    }
    for key in ("handlers", "domains"):
        if data.get(key):
            out[key] = data[key]
    return out
