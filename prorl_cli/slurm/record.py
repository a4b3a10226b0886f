"""A deployment's launch on disk: ``launch.json`` (the launch record), its lock, its history and its logs.

Each launch has its own id (``launch_id`` in launch.json); what belongs to
one launch (launch.json, the supervisor's supervision.json) is moved into
``history/<launch id>/`` when the deployment is taken down, abandoned or
launched again, so no launch reads another's state. The launcher, the
supervisor and the CLI read and write it through this module only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import SlurmError
from prorl_cli.slurm.deploy import DeployConfig, deploy_from_dict, load_deploy

LAUNCH_NAME = "launch.json"
#: Under the deployment's folder: one folder per earlier launch, named by its launch id.
HISTORY_NAME = "history"
ROLES = ("broker", "nodes", "inference")
SUPERVISION_NAME = "supervision.json"
LOCK_NAME = "launch.lock"


@dataclass
class Member:
    """One submitted role task: the broker job, or one array task."""

    role: str  # broker | nodes | inference
    index: int
    job_id: str  # "123" or "123_4" (what squeue and scancel call it)

    @property
    def peer_id(self) -> str:
        """The id it registers with at the broker."""
        return {"nodes": f"node-{self.index}", "inference": f"inference-{self.index}"}.get(self.role, "broker")


@dataclass
class LaunchRecord:
    """``launch.json``: what ``prorl launch`` submitted (and ``scale`` added)."""

    deployment: str
    #: The deployment file, absolute (``down``, ``scale`` and ``logs`` run from any folder); records written
    #: before it was made absolute hold the path as typed.
    deploy_file: str
    home: str
    created_at: float
    broker_where: str = "slurm"
    broker_pid: int | None = None  # broker ``here``: the local process
    #: Broker ``here``: the host it runs on ("" in records written before it was kept): only there can its pid
    #: be looked at, so ``status`` run on another login node says nothing of a pid that is not its own.
    broker_host: str = ""
    #: This launch's id: supervision state is keyed by it (empty in records written before launches had ids).
    launch_id: str = ""
    members: list[Member] = field(default_factory=list)
    #: Tasks scaled away and tasks replaced by the supervisor, in the order they left: their role names are never
    #: given to another Slurm job, and ``prorl logs ROLE[I] --all`` still finds their logs.
    retired: list[Member] = field(default_factory=list)
    #: Set by ``prorl down`` (and a failed launch's clean-up) before anything is stopped: the supervisor replaces
    #: nothing of a deployment being taken down.
    stopping: bool = False
    #: The deployment as launched (:func:`~prorl_cli.slurm.deploy.deploy_snapshot`): what ``down``, ``scale`` and
    #: ``logs`` use when the deployment file is gone, so a moved or deleted file cannot strand running jobs.
    deploy: dict[str, Any] | None = None

    @property
    def job_ids(self) -> list[str]:
        return [m.job_id for m in self.members]

    @property
    def all_job_ids(self) -> list[str]:
        """Every Slurm job of this launch, retired ones included (a task scaled away may still be draining)."""
        return [m.job_id for m in [*self.members, *self.retired]]

    def of(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    def jobs_of(self, role: str, index: int) -> list[Member]:
        """Every Slurm job task ``role[index]`` has had in this launch, oldest first (the live one, if any, last)."""
        return [m for m in [*self.retired, *self.members] if m.role == role and m.index == index]

    def next_index(self, role: str) -> int:
        """The first array index no task of ``role`` ever had (live or scaled away): names are never reused."""
        return max((m.index for m in [*self.members, *self.retired] if m.role == role), default=-1) + 1

    def save(self, deployment_dir: Path) -> Path:
        deployment_dir.mkdir(parents=True, exist_ok=True)
        path = deployment_dir / LAUNCH_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, deployment_dir: Path) -> LaunchRecord | None:
        path = deployment_dir / LAUNCH_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise SlurmError(f"{path}: unreadable launch record: {e}") from e
        if not isinstance(data, dict):
            raise SlurmError(f"{path}: malformed launch record: a JSON object is expected, got {type(data).__name__}")
        try:
            data["members"] = [Member(**m) for m in data.get("members", [])]
            data["retired"] = [Member(**m) for m in data.get("retired", [])]
            return cls(**data)
        except TypeError as e:
            raise SlurmError(f"{path}: malformed launch record: {e}") from e


def new_launch_id(now: float | None = None) -> str:
    """A launch id: the launch's UTC time (sorts in launch order) and a random suffix."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(3)}"


def archive_launch(deployment_dir: Path) -> Path | None:
    """Move a launch's state (launch.json, supervision.json) into ``history/<launch id>/``; return that folder.

    Called once the launch is over (``down`` with squeue empty, ``abandon``, the next ``launch``): a supervisor still
    running would write its state again. None when there is nothing to move.
    """
    with launch_lock(deployment_dir):
        present = [p for p in (deployment_dir / LAUNCH_NAME, deployment_dir / SUPERVISION_NAME) if p.exists()]
        if not present:
            return None
        launch_id = next((i for i in map(launch_id_of, present) if i), None)
        if launch_id is None:  # written before launches had ids
            launch_id = "unnamed-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(present[0].stat().st_mtime))
        dest = deployment_dir / HISTORY_NAME / launch_id
        dest.mkdir(parents=True, exist_ok=True)
        for path in present:
            os.replace(path, dest / path.name)
    return dest


def launch_id_of(path: Path) -> str | None:
    """The ``launch_id`` a launch.json or supervision.json names, or None when it names none or is unreadable."""
    try:
        value = json.loads(path.read_text()).get("launch_id")
    except (OSError, ValueError, AttributeError):
        return None
    return str(value) if value else None


@contextlib.contextmanager
def launch_lock(deployment_dir: Path) -> Iterator[None]:
    """Held while ``launch.json`` is read, changed and written (``scale`` on the login node, this supervisor)."""
    deployment_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(deployment_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def log_files(cfg: DeployConfig, member: Member) -> list[Path]:
    """A task's Slurm logs: submitit writes <log_dir>/<role>/<job>/<job>_<task>_log.out (array jobs: <job> is A_a)."""
    folder = cfg.log_path / member.role / member.job_id
    return sorted(folder.glob("*_log.out")) if folder.is_dir() else []


#: How much of the end of a task's log is read: a log appended to across requeues may be large.
LOG_END_BYTES = 1 << 20


def log_end(cfg: DeployConfig, member: Member, max_bytes: int = LOG_END_BYTES) -> str:
    """The last ``max_bytes`` of a task's newest Slurm log ("" when it has none)."""
    candidates = log_files(cfg, member)
    if not candidates:
        return ""
    with candidates[-1].open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
        return f.read().decode(errors="replace")


def log_tail(cfg: DeployConfig, member: Member, lines: int = 12) -> str:
    """The last ``lines`` lines of a task's Slurm log."""
    return "\n".join(log_end(cfg, member).splitlines()[-lines:])


def ended_launches(deployment_dir: Path) -> list[Path]:
    """The history folders of a deployment's ended launches (taken down, failed), oldest first."""
    history = deployment_dir / HISTORY_NAME
    return sorted(p for p in history.iterdir() if (p / LAUNCH_NAME).is_file()) if history.is_dir() else []


def not_launched_now(deployment_dir: Path) -> str | None:
    """Why a deployment that has no launch.json but had launches is not launched now: its last launch, when it
    ended (its state went to ``history/`` then: ``down``, a failed launch's clean-up) and how to go on; None when
    it never had a launch. ``scale``, ``down``, ``logs`` and ``status`` all say it in these words."""
    ended = ended_launches(deployment_dir)
    if not ended:
        return None
    name, last = deployment_dir.name, ended[-1]
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(last.stat().st_mtime))
    try:
        record = LaunchRecord.load(last)
    except SlurmError:
        record = None
    again = f", `prorl launch {record.deploy_file}` starts it again" if record is not None and record.deploy_file else ""
    return (f"deployment {name!r} is not launched now: its last launch ({last.name}) was taken down or failed "
            f"(ended {when}); `prorl logs -d {name} ROLE[INDEX]` still reads its logs{again}")


def load_launched(deployment_dir: Path, *, or_last: bool = False) -> tuple[LaunchRecord, DeployConfig]:
    """The launch record and the deploy file it came from (for scale).

    ``or_last``: when the deployment was taken down, its last launch from ``history/`` (its logs stay where
    they were written: what ``prorl logs`` reads after a crash and a ``down``).
    """
    record = LaunchRecord.load(deployment_dir)
    ended = ended_launches(deployment_dir)
    if record is None and or_last:
        record = LaunchRecord.load(ended[-1]) if ended else None
    if record is None:
        why = not_launched_now(deployment_dir)
        if why is not None:  # taken down (or its launch failed): not "never launched"
            raise SlurmError(why)
        raise SlurmError(f"deployment {deployment_dir.name!r} was not launched (no {deployment_dir / LAUNCH_NAME})")
    return record, deploy_of(record)


def deploy_of(record: LaunchRecord) -> DeployConfig:
    """The deploy file a launch came from, as launched when the file moved or was deleted since."""
    file = Path(record.deploy_file)
    if file.is_file():
        cfg = load_deploy(file, deployment=record.deployment)
    elif record.deploy is not None:
        # The file moved or was deleted since the launch: its settings as launched still name every job and log.
        cfg = deploy_from_dict(record.deploy, f"{file} (as launched; the file is gone)", record.deployment)
        cfg.source = str(file)
    elif not file.is_absolute():
        raise SlurmError(f"deployment {record.deployment!r} was launched from {record.deploy_file}, a path relative to the "
                         f"folder of that launch, and {Path.cwd()} has no such file: run this from the folder you "
                         "launched from")
    else:
        raise SlurmError(f"deployment {record.deployment!r}: its deployment file {file} is gone; put it back to manage "
                         f"the deployment, or cancel its Slurm jobs yourself: scancel {' '.join(record.all_job_ids)}")
    cfg.home = record.home
    if cfg.config is None and record.deploy is not None and record.deploy.get("config"):
        # The prorl.yaml launch settled on (--config, $PRORL_CONFIG or ./prorl.yaml where it ran): a scale-up
        # from another folder or shell starts its roles with the same one.
        cfg.config = str(record.deploy["config"])
    return cfg
