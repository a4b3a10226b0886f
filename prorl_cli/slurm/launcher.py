"""Submitting, scaling and taking down a deployment on Slurm, with submitit.

One submitit executor per role; node and inference servers are job arrays
(``map_array``, ``array_parallelism``). Every Slurm job id goes into
``$PRORL_HOME/<deployment>/launch.json``; Slurm's view is read from squeue
(:mod:`prorl_cli.slurm.squeue`), never from submitit's job objects.

The launch record, its lock and history are in :mod:`prorl_cli.slurm.record`;
each role's sbatch options and its submission in :mod:`prorl_cli.slurm.options`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prorl_cli.broker.journal import JOURNAL_NAME
from prorl_cli.exceptions import (
    BrokerUnavailable,
    ProrlError,
    RendezvousError,
    SlurmError,
)
from prorl_cli.processes import is_local_broker
from prorl_cli.protocol.framing import TERMINAL_STATES
from prorl_cli.rendezvous import rendezvous_path
from prorl_cli.slurm import squeue
from prorl_cli.slurm.deploy import DeployConfig, deploy_snapshot
from prorl_cli.slurm.options import (
    broker_bind_host,
    executor,
    node_drain_grace_s,
    prorl_config,
    sbatch_options,
    submit_role,
)
from prorl_cli.slurm.record import (
    LAUNCH_NAME,
    ROLES,
    LaunchRecord,
    Member,
    archive_launch,
    launch_lock,
    new_launch_id,
)

if TYPE_CHECKING:
    from prorl_cli.client import RolloutClient
    from prorl_cli.protocol import StatusReport

log = logging.getLogger(__name__)

#: ``scale`` down: how long after a node's drain grace it waits for the drained task to leave squeue
#: (stopping what still runs, unregistering, Slurm ending the job) before it sends SIGTERM.
DRAIN_EXIT_MARGIN_S = 60.0
#: ``scale`` down: how long a task sent SIGTERM (pending, starting, a bridge) may take to leave squeue.
TERM_WAIT_S = 90.0


@dataclass
class PlannedRole:
    """What ``launch`` would submit for one role (``prorl launch --dry-run`` prints it)."""

    role: str
    count: int  # array tasks (1 for the broker job)
    sbatch: dict[str, Any]  # the Slurm request: sbatch options, long names without dashes
    script: str  # the batch script submitit hands to sbatch


def plan(cfg: DeployConfig) -> list[PlannedRole]:
    """Every role ``launch`` would submit, with its request and script; submits and writes nothing."""
    planned = []
    for role in ROLES:
        if role == "broker" and cfg.broker.where == "here":
            continue
        count = 1 if role == "broker" else cfg.role(role).count  # type: ignore[attr-defined]
        if not count:
            continue
        ex = executor(cfg, role, count)
        if role != "broker":
            ex.parameters["map_count"] = count  # as map_array does: one --array job
        # submitit's own rendering of the script it would submit (the same call its submit makes).
        script = ex._make_submission_file_text(ex._submitit_command_str, "dry-run")
        planned.append(PlannedRole(role, count, sbatch_options(cfg, role), script))
    return planned


def local_broker_command(cfg: DeployConfig) -> list[str]:
    """``broker.where: here``: the command line of the broker started on this machine."""
    cmd = [cfg.python_path, "-m", "prorl_cli"]
    if cfg.config:
        cmd += ["--config", cfg.config]
    cmd += ["-d", cfg.deployment, "serve", "broker", "--bind-host", broker_bind_host(cfg)]
    if cfg.broker.port:
        cmd += ["--port", str(cfg.broker.port)]
    return cmd


def _start_local_broker(cfg: DeployConfig) -> int:
    """``broker.where: here``: a broker process on this machine, in its own session."""
    log_file = cfg.log_path / "broker-here.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = local_broker_command(cfg)
    env = {**os.environ, "PRORL_HOME": str(cfg.home_path)}
    with log_file.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    return proc.pid


#: ``broker.where: here``: how long ``down`` lets the local broker's process group stop on SIGTERM before SIGKILL.
LOCAL_BROKER_STOP_S = 30.0


def _stop_local_broker(pid: int, grace_s: float | None = None) -> None:
    """SIGTERM the local broker's process group (its own session), SIGKILL what is left after ``grace_s``."""
    grace_s = LOCAL_BROKER_STOP_S if grace_s is None else grace_s
    if not is_local_broker(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while is_local_broker(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if is_local_broker(pid):
        log.warning("the local broker (pid %d) did not stop %.0f s after SIGTERM: killing its process group", pid, grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def existing_launch(cfg: DeployConfig) -> tuple[LaunchRecord | None, list[squeue.SlurmTask]]:
    """The deployment's launch record and its jobs still in squeue."""
    record = LaunchRecord.load(cfg.deployment_dir)
    if record is None:
        return None, []
    return record, squeue.active(record.all_job_ids)


def check_partitions(cfg: DeployConfig) -> None:
    """Refuse, before anything is submitted, a role whose partition this cluster does not have (naming the key)."""
    wanted: dict[str, str] = {}
    for role in ROLES:
        if role == "broker" and cfg.broker.where == "here":
            continue
        if role != "broker" and not cfg.role(role).count:  # type: ignore[attr-defined]
            continue
        opts = cfg.role(role)
        key = "sbatch_options.partition" if "partition" in opts.sbatch_options else "partition"
        partition = sbatch_options(cfg, role).get("partition")
        if partition:
            wanted[f"{role}.{key}"] = str(partition)
    if not wanted:
        return
    known = squeue.partitions()
    for where, value in wanted.items():
        # sbatch takes a comma-separated list: the job runs in whichever of them can take it first.
        missing = [p for p in value.split(",") if p not in known]
        if missing:
            raise SlurmError(f"{cfg.source}: {where}: no Slurm partition {', '.join(map(repr, missing))} "
                             f"(this cluster has: {', '.join(sorted(known)) or 'none'}); nothing submitted")


def path_warnings(cfg: DeployConfig) -> list[str]:
    """Paths of the deployment file that this machine cannot see: the jobs would fail on them once Slurm starts
    them. Warnings, not refusals: a path may exist on the compute nodes alone (node-local storage)."""
    warnings = []
    if cfg.inference.count and cfg.inference.model and cfg.inference.engine != "sim" and not (Path(cfg.inference.model) / "config.json").is_file():
        warnings.append(f"{cfg.source}: inference.model: {cfg.inference.model} is not a model directory here (no "
                        "config.json): the inference tasks will fail on it unless it exists on their nodes")
    if cfg.python and os.path.isabs(cfg.python) and not os.access(cfg.python, os.X_OK):
        warnings.append(f"{cfg.source}: python: {cfg.python} is not an executable here: every task will fail to "
                        "start unless it exists on the compute nodes")
    return warnings


def launch(cfg: DeployConfig) -> LaunchRecord:
    """Submit every role; raises :class:`SlurmError` (with nothing left queued) when Slurm refuses one."""
    check_partitions(cfg)
    record, left = existing_launch(cfg)
    if record is not None and (left or (record.broker_where == "here" and is_local_broker(record.broker_pid))):
        raise SlurmError(
            f"deployment {cfg.deployment!r} is already launched ({len(left)} Slurm job(s) in squeue: "
            f"{', '.join(t.job_id for t in left[:6])}); use `prorl status {cfg.deployment}`, "
            f"`prorl scale` or `prorl down {cfg.deployment}`"
        )
    if _broker_answers(cfg):
        raise SlurmError(
            f"a broker of deployment {cfg.deployment!r} is already running (its rendezvous file "
            f"{rendezvous_path(cfg.deployment_dir)} answers); stop it (`prorl -d {cfg.deployment} stop`) or pick another name"
        )
    # The broker that wrote it is gone: a stale file would send peers to a dead address.
    with contextlib.suppress(FileNotFoundError):
        rendezvous_path(cfg.deployment_dir).unlink()
    # An earlier launch of this name that ended without `down`: its state is history, not this launch's.
    archive_launch(cfg.deployment_dir)
    cfg.log_path.mkdir(parents=True, exist_ok=True)
    now = time.time()
    source = Path(cfg.source)
    record = LaunchRecord(
        deployment=cfg.deployment, deploy_file=str(source.absolute()) if source.is_file() else cfg.source,
        home=str(cfg.home_path), created_at=now, broker_where=cfg.broker.where, launch_id=new_launch_id(now),
        deploy=deploy_snapshot(cfg),
    )
    try:
        if cfg.broker.where == "here":
            record.broker_pid = _start_local_broker(cfg)
            record.broker_host = socket.gethostname()
        else:
            record.members += submit_role(cfg, "broker", [0])
        record.save(cfg.deployment_dir)
        for role in ("nodes", "inference"):
            count = cfg.role(role).count  # type: ignore[attr-defined]
            if count:
                record.members += submit_role(cfg, role, list(range(count)))
                record.save(cfg.deployment_dir)
    except SlurmError as e:
        # Roles submitted before the refused one go too: nothing of a half deployment stays queued.
        submitted = ", ".join(f"{m.role}[{m.index}]={m.job_id}" for m in record.members)
        left = abandon(cfg, record)
        after = f"cancelled what was submitted before it ({submitted})" if submitted else "nothing had been submitted"
        if left:
            raise SlurmError(f"{e}; {after}, but still in squeue: {', '.join(t.job_id for t in left)}") from e
        raise SlurmError(f"{e}; {after}; nothing left queued") from e
    return record


def _broker_answers(cfg: DeployConfig, timeout_s: float = 3.0) -> bool:
    client = broker_client(cfg, timeout_s)
    if client is None:
        return False
    try:
        client.ping(timeout_s=timeout_s)
        return True
    except (BrokerUnavailable, RendezvousError, TimeoutError):
        return False
    finally:
        client.close()


def mark_stopping(deployment_dir: Path, record: LaunchRecord) -> LaunchRecord:
    """Say in launch.json that the deployment is being taken down (the supervisor then replaces nothing of it)."""
    with launch_lock(deployment_dir):
        current = LaunchRecord.load(deployment_dir) or record  # the supervisor may have replaced a task meanwhile
        current.stopping = True
        current.save(deployment_dir)
    return current


def abandon(cfg: DeployConfig, record: LaunchRecord, wait_s: float = 60.0) -> list[squeue.SlurmTask]:
    """Cancel everything of a launch that did not come up; return what squeue still shows."""
    if (cfg.deployment_dir / LAUNCH_NAME).exists():
        record = mark_stopping(cfg.deployment_dir, record)
    if record.broker_pid:
        _stop_local_broker(record.broker_pid)
    left = squeue.cancel_until_gone(record.all_job_ids, wait_s)
    archive_launch(cfg.deployment_dir)
    with contextlib.suppress(FileNotFoundError):
        rendezvous_path(cfg.deployment_dir).unlink()
    return left


def broker_client(cfg: DeployConfig, timeout_s: float = 5.0) -> RolloutClient | None:
    """A client of the deployment's broker, or None while it has no rendezvous file."""
    from prorl_cli.client import RolloutClient

    if not rendezvous_path(cfg.deployment_dir).exists():
        return None
    return RolloutClient(cfg.deployment, config=prorl_config(cfg), request_timeout_s=timeout_s)


def broker_status(client: RolloutClient | None) -> StatusReport | None:
    if client is None:
        return None
    try:
        return client.status()
    except (BrokerUnavailable, RendezvousError, TimeoutError) as e:
        log.debug("broker not answering: %s", e)
        return None


def registered_ids(report: StatusReport | None) -> set[str]:
    """Node and backend ids the broker sees alive."""
    if report is None:
        return set()
    ids = {n.node_id for n in report.nodes if n.alive}
    ids |= {b.backend_id for b in report.backends if b.alive and not b.cleared}
    return ids


@dataclass
class Removal:
    """A task ``scale`` chose to take away, and what it was doing then."""

    member: Member
    #: pending (waiting in squeue), starting (running, not registered), idle (registered, no jobs),
    #: serving (registered, with jobs), or unknown (running; the broker did not answer, so its load is not known).
    kind: str
    running: int = 0  # its running jobs (a bridge: its generate calls in flight), as the broker counts them
    held: int = 0  # every job placed on it (a node: running or queued there)
    reason: str = ""  # pending: Slurm's reason
    #: How it was asked to leave: "drain" (a node: Requeue=0, then SIGUSR2: running jobs finish, the rest goes
    #: back to the broker) or "term" (scancel: pending, starting, a bridge; or a drain that did not end in time).
    how: str = "term"

    def describe(self) -> str:
        if self.kind == "pending":
            return f"pending ({self.reason or 'not started'})"
        if self.kind == "starting":
            return "starting, not registered"
        if self.kind == "idle":
            return "idle"
        if self.kind == "serving":
            return f"serving, {self.running} running job(s)" + (f" of {self.held} placed" if self.held > self.running else "")
        return "running; load unknown (the broker did not answer)"


#: ``scale`` down takes tasks in this order: the least useful first.
REMOVAL_ORDER = ("pending", "starting", "idle", "unknown", "serving")


def choose_removals(role: str, members: list[Member], rows: list[squeue.SlurmTask], report: StatusReport | None,
                    n: int) -> list[Removal]:
    """Which ``n`` of a role's live tasks ``scale`` down takes away: pending ones first, then starting and idle
    ones, then the serving ones with the fewest running jobs (ties: the highest index first).

    Load comes from the broker's status (``report``): a node's running jobs (its stages' active counts, then every
    job placed on it), a backend's calls in flight. Without a report every running task's load is unknown.
    """
    by_id = {t.job_id: t for t in rows}
    loads: dict[str, tuple[int, int]] = {}
    if report is not None:
        if role == "nodes":
            loads = {nd.node_id: (sum(int(st.get("active", 0)) for st in nd.stages.values()), nd.inflight)
                     for nd in report.nodes if nd.alive}
        else:
            loads = {b.backend_id: (b.inflight, b.inflight) for b in report.backends if b.alive and not b.cleared}
    chosen: list[tuple[tuple[int, int, int, int], Removal]] = []
    for m in members:
        t = by_id.get(m.job_id)
        if t is None or not t.active:
            continue
        if t.state not in squeue.RUNNING_STATES:
            removal = Removal(m, "pending", reason=t.pending_reason or t.state)
        elif report is None:
            removal = Removal(m, "unknown")
        elif m.peer_id not in loads:
            removal = Removal(m, "starting")
        else:
            running, held = loads[m.peer_id]
            removal = Removal(m, "serving" if held else "idle", running=running, held=held)
        key = (REMOVAL_ORDER.index(removal.kind), removal.running, removal.held, -m.index)
        chosen.append((key, removal))
    chosen.sort(key=lambda item: item[0])
    return [removal for _, removal in chosen[:n]]


@dataclass
class ScaleResult:
    added: list[Member] = field(default_factory=list)
    removed: list[Removal] = field(default_factory=list)


def scale(cfg: DeployConfig, role: str, count: int, drain_wait_s: float | None = None) -> ScaleResult:
    """Grow or shrink an array to ``count`` live tasks.

    Shrinking takes tasks away in :func:`choose_removals`' order. A running
    node leaves with the drain of the time-limit warning, but is not requeued:
    its job is set Requeue=0, then sent SIGUSR2, so it hands back the jobs it
    has not started, lets running ones finish for its drain grace and delivers
    them, and exits. Pending and starting tasks and bridges get SIGTERM. The
    tasks go to launch.json's ``retired`` before they are signalled, so the
    supervisor never takes one for a failure. ``drain_wait_s`` (default: the
    nodes' drain grace + :data:`DRAIN_EXIT_MARGIN_S`) bounds the wait for a
    drain; a task still there then gets SIGTERM.
    """
    record = LaunchRecord.load(cfg.deployment_dir)
    if record is None:
        raise SlurmError(f"deployment {cfg.deployment!r} was not launched (no {cfg.deployment_dir / LAUNCH_NAME})")
    if role not in ("nodes", "inference"):
        raise SlurmError(f"cannot scale {role!r}: nodes or inference")
    if count < 0:
        raise SlurmError(f"--{role}: must be 0 or more, got {count}")
    report = None
    if count < len(record.of(role)):
        # Shrinking: the broker's view says which tasks are idle (asked before the lock: the supervisor waits on it).
        client = broker_client(cfg)
        try:
            report = broker_status(client)
        finally:
            if client is not None:
                client.close()
    with launch_lock(cfg.deployment_dir):
        record = LaunchRecord.load(cfg.deployment_dir) or record  # the supervisor may have replaced a task
        result = _scale_locked(cfg, record, role, count, report)
    if result.removed:
        _await_removal(cfg, result.removed, drain_wait_s)
    return result


def _scale_locked(cfg: DeployConfig, record: LaunchRecord, role: str, count: int,
                  report: StatusReport | None) -> ScaleResult:
    rows = squeue.active(record.job_ids)
    live_ids = {t.job_id for t in rows}
    live = sorted((m for m in record.of(role) if m.job_id in live_ids), key=lambda m: m.index)
    result = ScaleResult()
    if count > len(live):
        start = record.next_index(role)
        result.added = submit_role(cfg, role, list(range(start, start + count - len(live))))
        record.members += result.added
    elif count < len(live):
        result.removed = choose_removals(role, live, rows, report, len(live) - count)
        gone = {r.member.job_id for r in result.removed}
        # Retired before they are signalled: what they do next is asked for, never a failure to replace.
        record.members = [m for m in record.members if m.job_id not in gone]
        record.retired += [r.member for r in result.removed]
        record.save(cfg.deployment_dir)
        for removal in result.removed:
            _ask_to_leave(removal)
    record.save(cfg.deployment_dir)
    return result


def _ask_to_leave(removal: Removal) -> None:
    """A running node: Requeue=0, then SIGUSR2 (the drain with grace, no requeue). Anything else: SIGTERM."""
    ref = removal.member.job_id
    if removal.member.role == "nodes" and removal.kind in ("idle", "serving", "unknown"):
        try:
            squeue.set_requeue(ref, False)  # the role's requeue after its drain reads it and leaves for good
            squeue.cancel([ref], signal_name="USR2")
            removal.how = "drain"
            return
        except SlurmError as e:
            log.warning("cannot drain %s with grace (%s): sending SIGTERM", removal.member.peer_id, e)
    squeue.cancel([ref])  # SIGTERM: a node drains quickly and unregisters, a bridge unregisters
    removal.how = "term"


def _await_removal(cfg: DeployConfig, removed: list[Removal], drain_wait_s: float | None) -> None:
    """Wait until the removed tasks left squeue: a drain for its grace and a margin, then SIGTERM."""
    ids = [r.member.job_id for r in removed]
    if any(r.how == "drain" for r in removed):
        wait_s = drain_wait_s if drain_wait_s is not None else node_drain_grace_s(cfg) + DRAIN_EXIT_MARGIN_S
    else:
        wait_s = TERM_WAIT_S
    left = squeue.wait_gone(ids, wait_s)
    if not left:
        return
    late = [t.job_id for t in left]
    log.warning("still in squeue after %.0f s: %s; sending SIGTERM", wait_s, ", ".join(late))
    squeue.cancel(late)
    for r in removed:
        if r.member.job_id in late:
            r.how = "term"
    left = squeue.wait_gone(late, TERM_WAIT_S)
    if left:
        raise SlurmError(f"tasks still in squeue {wait_s + TERM_WAIT_S:.0f} s after they were asked to leave: "
                         f"{', '.join(t.job_id for t in left)} (retired; `prorl down` cancels them)")


@dataclass
class RoleCounts:
    """A role's tasks as they stand: what ``scale`` counts, said separately."""

    role: str
    serving: int = 0  # running and registered with the broker
    starting: int = 0  # running, not registered (yet)
    pending_restart: int = 0  # requeued, held for Slurm's requeue delay
    pending: int = 0  # waiting for resources
    #: Running while the broker did not answer (restarting, say): serving or starting, nobody can tell.
    running: int = 0

    @property
    def total(self) -> int:
        return self.serving + self.starting + self.running + self.pending_restart + self.pending

    def describe(self) -> str:
        parts = [f"{n} {what}" for n, what in ((self.serving, "serving"), (self.starting, "starting"),
                                                (self.running, "running (registered or not: the broker did not "
                                                               "answer)"),
                                                (self.pending_restart, "pending restart (requeued)"),
                                                (self.pending, "pending")) if n]
        return ", ".join(parts) or "none"


def count_role(role: str, members: list[Member], rows: list[squeue.SlurmTask],
               registered: set[str] | None) -> RoleCounts:
    """Classify a role's members by their squeue rows and the peers the broker sees alive (None: the broker did not
    answer, so a running task is neither serving nor starting as far as anyone knows)."""
    by_id = {t.job_id: t for t in rows}
    counts = RoleCounts(role)
    for m in members:
        t = by_id.get(m.job_id)
        if t is None or not t.active:
            continue
        if t.state in squeue.RUNNING_STATES:
            if registered is None:
                counts.running += 1
            elif m.peer_id in registered:
                counts.serving += 1
            else:
                counts.starting += 1
        elif t.pending_restart:
            counts.pending_restart += 1
        else:
            counts.pending += 1
    return counts


def role_counts(cfg: DeployConfig, role: str) -> RoleCounts:
    """:func:`count_role` for a launched deployment (squeue, and the broker's status when it answers)."""
    record = LaunchRecord.load(cfg.deployment_dir)
    if record is None:
        return RoleCounts(role)
    client = broker_client(cfg)
    try:
        report = broker_status(client)
    finally:
        if client is not None:
            client.close()
    registered = registered_ids(report) if report is not None else None
    return count_role(role, record.of(role), squeue.query(record.job_ids), registered)


#: The states of a finished job, as the broker's status counts them.
FINISHED_STATES = frozenset(state.value for state in TERMINAL_STATES)


@dataclass
class DownReport:
    """What ``prorl down`` did."""

    broker_stopped: bool
    cancelled: list[str]
    left: list[squeue.SlurmTask]
    rendezvous_removed: bool
    #: Where the journal of a broker that did not take the stop was moved (its unfinished jobs); None: none left.
    journal_kept: Path | None = None
    #: The jobs the kept journal holds, by state (empty when none was kept, or it did not read back).
    journal_jobs: dict[str, int] = field(default_factory=dict)
    #: The jobs the broker held when it took the stop, by state (empty when it did not take the stop).
    held_jobs: dict[str, int] = field(default_factory=dict)

    @property
    def cancelled_jobs(self) -> dict[str, int]:
        """Jobs the stop cancelled, by the state they were in."""
        return {state: n for state, n in self.held_jobs.items() if state not in FINISHED_STATES and n}


def down(cfg: DeployConfig, wait_s: float = 120.0, record: LaunchRecord | None = None) -> DownReport:
    """Broker stop (cancels jobs, nodes drain), scancel what is left, confirm squeue is empty, remove the rendezvous.

    ``record``: the launch record the caller has already read (read here otherwise); marking it ``stopping`` reads
    it once more under the launch lock, as the supervisor may have replaced a task since.
    """
    record = record if record is not None else LaunchRecord.load(cfg.deployment_dir)
    if record is None:
        raise SlurmError(f"deployment {cfg.deployment!r} was not launched (no {cfg.deployment_dir / LAUNCH_NAME})")
    # First of all: tasks that end from here on were asked to, and the supervisor must not replace them.
    record = mark_stopping(cfg.deployment_dir, record)
    stopped = False
    client = broker_client(cfg)
    held: dict[str, int] = {}
    if client is not None:
        try:
            # What the stop is about to cancel (accepted jobs not finished), said afterwards; not knowing it is no
            # reason to leave the broker running.
            held = dict(client.status().jobs)
        except (BrokerUnavailable, TimeoutError, ProrlError) as e:
            log.info("broker did not say what it holds: %s", e)
        try:
            client.stop()
            stopped = True
        except (BrokerUnavailable, TimeoutError, ProrlError) as e:
            log.info("broker did not take the stop: %s", e)
        finally:
            client.close()
    if stopped:
        # The broker exits once nodes and bridges left; give it that long before scancel.
        squeue.wait_gone([m.job_id for m in record.of("broker")], min(wait_s / 2, 60.0))
    left = squeue.active(record.all_job_ids)  # a task scaled away may still be draining
    cancelled = [t.job_id for t in left]
    squeue.cancel(cancelled)
    if record.broker_pid:
        _stop_local_broker(record.broker_pid)
    # A task that was requeueing itself when the scancel came (its drain on SIGUSR2 under way, a preemption) comes
    # back PENDING for Slurm's requeue delay and would start again later: cancel_until_gone cancels it again.
    remaining = squeue.cancel_until_gone(record.all_job_ids, wait_s)
    removed = False
    path = rendezvous_path(cfg.deployment_dir)
    if path.exists():
        path.unlink()
        removed = True
    journal_kept: Path | None = None
    if not remaining:
        # The launch's record and supervision state go to history/<launch id>/: the next launch starts afresh.
        archived = archive_launch(cfg.deployment_dir)
        # A broker that could not take the stop (cancelled, killed past its restarts) left its journal: the jobs it
        # had accepted and not finished. Down means nothing is replayed by the next launch, but they are the user's
        # work: kept beside the launch's record, for a launch to replay once copied back.
        journal = cfg.deployment_dir / JOURNAL_NAME
        if journal.exists():
            if archived is not None:
                journal_kept = archived / JOURNAL_NAME
                os.replace(journal, journal_kept)
            else:
                journal.unlink()
    report = DownReport(stopped, cancelled, remaining, removed, journal_kept=journal_kept,
                        held_jobs=held if stopped else {})
    if journal_kept is not None:
        report.journal_jobs = journal_counts(journal_kept)
    return report


def journal_counts(path: Path) -> dict[str, int]:
    """The jobs a broker's journal holds, by state (``run`` for one accepted and not finished, as it replays), or an
    empty map when it does not read back (what ``down`` says of a journal it kept, not a reason to fail)."""
    from prorl_cli.broker.journal import Journal

    try:
        jobs = Journal(path).replay()
    except OSError as e:
        log.warning("cannot read the journal %s: %s", path, e)
        return {}
    counts: dict[str, int] = {}
    for job in jobs.values():
        counts[job.state.value] = counts.get(job.state.value, 0) + 1
    return counts
