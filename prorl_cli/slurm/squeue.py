"""Slurm's view of a deployment, read from ``squeue`` and ``scontrol`` directly.

submitit's ``job.state`` asks ``sacct`` only (``UNKNOWN`` without accounting)
and ``job.result()`` never returns for a cancelled job, so prorl asks Slurm
itself.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prorl_cli.exceptions import SlurmError

log = logging.getLogger(__name__)

# squeue fields: job id (123_4 for array tasks), state, reason, node list, elapsed, time left, name.
_FORMAT = "%i|%T|%r|%N|%M|%L|%j"
#: Slurm's final job states. A task is active (holds or waits for resources) unless squeue shows one of
#: these: squeue prints a state *flag* in place of the base state while one is set (SIGNALING while a
#: signal such as the time-limit warning is delivered, STAGE_OUT, STOPPED, REQUEUE_HOLD, SPECIAL_EXIT,
#: RESV_DEL_HOLD, ...), so a list of live states would take a task being signalled for a gone one, and a
#: state a later Slurm adds counts as still there.
ENDED_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                          "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "REVOKED"})
#: Final states of a task that ended without being asked to (not cancelled, not a clean exit). PREEMPTED is
#: a preemption that did not requeue it (PreemptMode=CANCEL): Slurm's doing, not the user's.
UNASKED_END_STATES = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL", "DEADLINE",
                                "PREEMPTED"})
#: squeue states of a task that holds its allocation (the flags a running task can show included).
RUNNING_STATES = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT",
                            "STOPPED"})


@dataclass(frozen=True)
class SlurmTask:
    """One squeue row: a job, or one task of an array."""

    job_id: str  # "123" or "123_4"
    state: str
    reason: str
    nodes: str
    elapsed: str
    time_left: str
    name: str

    @property
    def array_job_id(self) -> str:
        return self.job_id.split("_", 1)[0]

    @property
    def active(self) -> bool:
        """Holds or waits for resources: any state but a final one (see ``ENDED_STATES``)."""
        return self.state not in ENDED_STATES

    @property
    def pending_reason(self) -> str | None:
        return self.reason if self.state == "PENDING" and self.reason not in ("", "None") else None

    @property
    def pending_restart(self) -> bool:
        """Requeued and held until its begin time (Slurm's requeue delay), or being requeued now."""
        return self.state.startswith("REQUEUE") or (self.state == "PENDING" and self.reason == "BeginTime")


@dataclass(frozen=True)
class EndedTask:
    """How a task ended, as Slurm says: final state, reason and exit code (``code:signal``)."""

    job_id: str
    state: str
    reason: str
    exit_code: str

    def describe(self) -> str:
        parts = [f"exit code {self.exit_code}{_signal_named(self.exit_code)}"] if self.exit_code else []
        if self.reason and self.reason != "None":
            parts.append(f"reason {self.reason}")
        return f"{self.state}" + (f" ({', '.join(parts)})" if parts else "")


def _signal_named(exit_code: str) -> str:
    """``", killed by SIGUSR2"`` for Slurm's ``0:12`` (``code:signal``), else ``""``: the number alone says little."""
    import signal

    _, _, number = exit_code.partition(":")
    try:
        return f", killed by {signal.Signals(int(number)).name}" if int(number) else ""
    except ValueError:
        return ""


def ended(task: SlurmTask) -> EndedTask:
    """The final state of a task squeue lists as ended, with scontrol's exit code and reason when it still has them."""
    detail = job_detail(task.job_id)
    return EndedTask(task.job_id, detail.get("JobState", task.state), detail.get("Reason", task.reason),
                     detail.get("ExitCode", ""))


def slurm_available() -> bool:
    """Whether this machine can talk to a Slurm controller."""
    if shutil.which("squeue") is None:
        return False
    proc = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, check=False, timeout=30)
    return proc.returncode == 0


def _run(cmd: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout_s)
    except FileNotFoundError as e:
        raise SlurmError(f"{cmd[0]}: not found; is this a Slurm login node?") from e
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"{' '.join(cmd)}: no answer in {timeout_s:.0f} s") from e


def query(job_ids: Iterable[str], all_states: bool = False) -> list[SlurmTask]:
    """squeue rows of these jobs (array job ids expand to their tasks, pending ones included)."""
    refs = {str(j) for j in job_ids}
    ids = sorted({r.split("_", 1)[0] for r in refs})
    if not ids:
        return []
    cmd = ["squeue", "-h", "-r", "-o", _FORMAT, "-j", ",".join(ids)]
    if all_states:
        cmd += ["-t", "all"]
    proc = _run(cmd)
    if proc.returncode != 0:
        # squeue exits 1 with "Invalid job id specified" once every id has aged out.
        if "Invalid job id" in proc.stderr:
            return []
        raise SlurmError(f"squeue failed: {proc.stderr.strip()}")
    rows = []
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        # squeue answers for whole arrays: keep the tasks asked for (or every task of an array asked for).
        if len(parts) == 7 and (parts[0] in refs or parts[0].split("_", 1)[0] in refs):
            rows.append(SlurmTask(*parts))
    return rows


def active(job_ids: Iterable[str]) -> list[SlurmTask]:
    """The rows of these jobs that still hold or wait for resources."""
    return [t for t in query(job_ids) if t.active]


def cancel(refs: Iterable[str], signal_name: str | None = None) -> None:
    """``scancel`` these jobs or array tasks (optionally only signal them)."""
    refs = list(refs)
    if not refs:
        return
    cmd = ["scancel"]
    if signal_name:
        cmd += [f"--signal={signal_name}"]
    proc = _run([*cmd, *refs])
    if proc.returncode != 0:
        raise SlurmError(f"scancel {' '.join(refs)} failed: {proc.stderr.strip()}")


def wait_gone(job_ids: Iterable[str], timeout_s: float) -> list[SlurmTask]:
    """Poll squeue until none of these jobs is active; return what is left at the deadline."""
    ids = list(job_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        left = active(ids)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def cancel_until_gone(refs: Iterable[str], timeout_s: float) -> list[SlurmTask]:
    """``scancel`` these jobs and wait until squeue no longer lists them; return what is left at the deadline.

    A task that was being requeued when ``scancel`` reached it (a preempted node, a role that requeued itself
    on SIGUSR2) can come back afterwards as PENDING for Slurm's requeue delay and would start again later on
    its own: such a task is cancelled again.
    """
    ids = list(refs)
    if not ids:
        return []
    cancel(ids)
    deadline = time.monotonic() + timeout_s
    while True:
        left = active(ids)
        if not left or time.monotonic() >= deadline:
            return left
        back = [t.job_id for t in left if t.state == "PENDING"]
        if back:
            log.info("cancelling again what came back from a requeue: %s", " ".join(back))
            cancel(back)
        time.sleep(0.5)


def partitions() -> set[str]:
    """The partitions this cluster has (``sinfo -a``: hidden ones and those of other groups included)."""
    proc = _run(["sinfo", "-a", "-h", "-o", "%R"])
    if proc.returncode != 0:
        raise SlurmError(f"sinfo failed: {proc.stderr.strip()}")
    return {line.strip() for line in proc.stdout.splitlines() if line.strip()}


def job_detail(ref: str) -> dict[str, str]:
    """``scontrol show job`` as a key/value map (empty once the job has aged out)."""
    proc = _run(["scontrol", "-o", "show", "job", ref])
    return _key_values(proc.stdout) if proc.returncode == 0 else {}


def _key_values(text: str) -> dict[str, str]:
    """``scontrol -o``'s ``Key=Value`` words as a map (a key's first value: later ones are of nested records)."""
    out: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            out.setdefault(key, value)
    return out


def seconds_left(detail: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds until the job's ``EndTime`` (its time limit) from ``scontrol show job``; None when it has none."""
    import datetime

    end = detail.get("EndTime", "")
    try:
        # scontrol prints the controller's local time without a zone; this host shares it (one cluster's clock).
        end_s = datetime.datetime.strptime(end, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None  # Unknown, None: no limit
    return end_s - (time.time() if now is None else now)


def time_left_s(ref: str) -> float | None:
    """Seconds until job ``ref``'s ``EndTime`` as Slurm says now; None when it has no end (``Unknown``).

    Unlike :func:`job_detail`, a failure is no empty answer: raises :class:`SlurmError` when ``scontrol`` fails
    or shows no ``EndTime`` (a job this controller does not know), as a caller that bounds work by the job's
    end must tell "no limit" from "could not ask".
    """
    proc = _run(["scontrol", "-o", "show", "job", ref])
    if proc.returncode != 0:
        raise SlurmError(f"scontrol show job {ref} failed: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    detail = _key_values(proc.stdout)
    if "EndTime" not in detail:
        raise SlurmError(f"scontrol show job {ref} shows no EndTime: {proc.stdout.strip()[:200]!r}")
    return seconds_left(detail)


def requeue_delayed(detail: Mapping[str, str]) -> bool:
    """Whether ``scontrol show job`` describes a requeued job Slurm holds for its requeue delay.

    Slurm keeps a requeued job in PENDING with reason BeginTime for about two
    minutes (its launch credential's lifetime); ``Restarts`` > 0 tells it from
    a job submitted with a later ``--begin``.
    """
    try:
        restarts = int(detail.get("Restarts", "0"))
    except ValueError:
        restarts = 0
    return detail.get("JobState") == "PENDING" and detail.get("Reason") == "BeginTime" and restarts > 0


def release_requeued(ref: str) -> bool:
    """Make a requeued job that waits out Slurm's requeue delay eligible now (``scontrol update StartTime=now``).

    True when it did; False when the job is not held that way or Slurm refused
    (a user may only update jobs Slurm lets them: then it starts after the delay).
    """
    if not requeue_delayed(job_detail(ref)):
        return False
    proc = _run(["scontrol", "update", f"JobId={ref}", "StartTime=now"])
    if proc.returncode != 0:
        log.warning("scontrol update JobId=%s StartTime=now failed: %s", ref, proc.stderr.strip())
        return False
    return True


def set_requeue(ref: str, requeue: bool) -> None:
    """``scontrol update JobId=REF Requeue=0|1``: whether the job may be requeued (its role reads it before requeueing)."""
    proc = _run(["scontrol", "update", f"JobId={ref}", f"Requeue={int(requeue)}"])
    if proc.returncode != 0:
        raise SlurmError(f"scontrol update JobId={ref} Requeue={int(requeue)} failed: {proc.stderr.strip()}")


@dataclass(frozen=True)
class PartitionPreemption:
    """How a partition's jobs are preempted, from ``scontrol show partition``.

    On preemption with ``SlurmctldParameters=preempt_send_user_signal`` a job gets its ``--signal`` (USR2) at
    once and its end time is set to now + ``GraceTime``; it is then stopped (SIGTERM, and SIGKILL after
    ``KillWait``) at the first time-limit check after that. A node reads that end time when it drains and
    bounds its drain by it (:func:`prorl_cli.node.server.drain_grace_within`).
    """

    partition: str
    #: As scontrol prints it: ``OFF``, ``REQUEUE``, ``CANCEL``, ``SUSPEND``, ``GANG,SUSPEND``, ...
    mode: str
    #: None where scontrol printed none, or nothing this parser reads.
    grace_time_s: int | None

    @property
    def stops_jobs(self) -> bool:
        """Whether a preempted job is stopped (requeued or cancelled), not suspended: its GraceTime then counts."""
        return bool({"REQUEUE", "CANCEL"} & {m.strip().upper() for m in self.mode.split(",")})


def _slurm_seconds(text: str) -> int | None:
    """``20``, ``00:00:20``, ``1-00:00:00`` (``[D-][HH:]MM:SS``) as seconds; None for anything else."""
    days, dash, clock = text.rpartition("-")
    parts = clock.split(":")
    if not all(p.isdigit() for p in parts) or len(parts) > 3 or (dash and not days.isdigit()):
        return None
    if len(parts) == 1:
        return int(parts[0]) + int(days or 0) * 86400
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return seconds + int(days or 0) * 86400


def parse_partitions(text: str) -> dict[str, PartitionPreemption]:
    """``scontrol show partition -o`` (one partition a line, ``Key=Value`` fields) as partition -> preemption.

    A field without ``=`` continues the previous one's value (a value with a space); a line without
    ``PartitionName`` is skipped, as are fields this does not know. A missing ``PreemptMode`` is ``OFF``.
    """
    out: dict[str, PartitionPreemption] = {}
    for line in text.splitlines():
        fields: dict[str, str] = {}
        last: str | None = None
        for token in line.split():
            key, sep, value = token.partition("=")
            if sep and key:
                fields[key] = value
                last = key
            elif last is not None:
                fields[last] += f" {token}"
        name = fields.get("PartitionName")
        if not name:
            continue
        grace = fields.get("GraceTime")
        out[name] = PartitionPreemption(name, fields.get("PreemptMode", "OFF"),
                                        None if grace is None else _slurm_seconds(grace))
    return out


def partition_preemption() -> dict[str, PartitionPreemption]:
    """Every partition's preemption settings (``scontrol show partition -o``); raises :class:`SlurmError`."""
    proc = _run(["scontrol", "show", "partition", "-o"], timeout_s=10.0)  # a check before launch: not worth a long wait
    if proc.returncode != 0:
        raise SlurmError(f"scontrol show partition failed: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return parse_partitions(proc.stdout)
