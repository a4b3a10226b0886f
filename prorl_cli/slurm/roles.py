"""The three roles as they run inside a Slurm allocation.

Both ``prorl launch`` (a submitit function call) and ``prorl serve ...``
(``prorl render-sbatch`` scripts, plain sbatch) end up here, so a role
behaves the same whichever way it was submitted:

- identity from Slurm's environment (:class:`SlurmIdentity`): a node or
  backend is named after its array index, so a requeued task rejoins as itself;
- nodes and bridges wait for the broker's rendezvous file (bounded) instead of
  dying when they start first;
- SIGTERM (``scancel``, ``prorl down``) drains and exits; SIGUSR2 (the
  ``--signal`` time-limit warning, or preemption with
  ``preempt_send_user_signal``) drains (a node with grace: its running jobs
  may finish for ``node.drain_grace_s``), then requeues the task with
  ``scontrol requeue`` so it comes back and rejoins. A broker leaves without
  cancelling jobs and keeps its journal; the requeued broker replays it;
- Slurm holds a requeued job in PENDING (BeginTime) for about two minutes: a
  node or bridge that sees its broker away (no rendezvous file) and its
  broker's job held that way makes it eligible at once (``scontrol update
  StartTime=now``); for requeued node and inference tasks the broker's
  supervisor does the same (``prorl launch``), or, for plain sbatch scripts,
  the broker itself from the notes the tasks leave (:mod:`prorl_cli.slurm.requeue`).

The role runs in this very process (no server child), so signals reach it
the same way under ``proctrack/cgroup`` and ``proctrack/linuxproc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from prorl_cli.config import ProrlConfig, load_config
from prorl_cli.exceptions import DeploymentStopped, RendezvousError
from prorl_cli.rendezvous import BrokerLock, raise_if_stopped, read_rendezvous, rendezvous_path
from prorl_cli.slurm.identity import SlurmIdentity
from prorl_cli.slurm.requeue import forget as forget_requeued
from prorl_cli.slurm.requeue import note_requeued, noted_broker_job, release_requeued_peers, watch

log = logging.getLogger(__name__)

Role = Literal["broker", "node", "inference"]


class RoleSignals:
    """SIGTERM: leave. SIGUSR2: leave, then requeue. Installed before a role's own handlers.

    While a role's event loop runs, its own SIGTERM handler takes over; SIGUSR2
    stays here and turns into a SIGTERM to this process, so the role drains
    through its one shutdown path. A signal can come before the role's
    handlers are in (Slurm sends the time-limit warning up to a minute early),
    so each role is handed :attr:`leave` and checks it once its own are.
    """

    def __init__(self) -> None:
        self.leave = threading.Event()
        self.requeue = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGUSR2, self._on_usr2)

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        log.info("SIGTERM: leaving")
        self.leave.set()

    def _on_usr2(self, signum: int, frame: FrameType | None) -> None:
        log.info("SIGUSR2 (time limit or preemption): draining, then requeueing")
        self.requeue = True
        self.leave.set()
        os.kill(os.getpid(), signal.SIGTERM)


def wait_for_broker(deployment_dir: Path, timeout_s: float, leave: threading.Event) -> bool:
    """Wait for the rendezvous file; False when asked to leave first, or when the deployment was stopped on
    purpose (``prorl stop``) since this task started: no broker is coming. Raises after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    logged = False
    while True:
        try:
            read_rendezvous(deployment_dir)
            return True
        except RendezvousError as e:
            try:
                raise_if_stopped(deployment_dir)
            except DeploymentStopped as stopped:
                log.info("%s while this task started: not waiting for a broker", stopped)
                return False
            if time.monotonic() >= deadline:
                raise RendezvousError(f"no broker after {timeout_s:.0f} s: {e}") from e
            if not logged:
                log.info("waiting up to %.0f s for the broker's rendezvous file in %s", timeout_s, deployment_dir)
                logged = True
        if leave.wait(0.5):
            return False


def requeue_self(identity: SlurmIdentity, deployment_dir: Path | None = None, peer_id: str | None = None) -> None:
    """Ask Slurm to requeue this task, unless its job says Requeue=0.

    Slurm then holds it for its requeue delay; whoever sees it held makes it
    eligible at once (the broker's supervisor for a node or bridge, the nodes
    and bridges for the broker). Without a launch record (plain sbatch scripts)
    it leaves a note in ``deployment_dir`` naming ``peer_id``, which its peers read.
    """
    ref = identity.task_ref
    if ref is None:
        return
    from prorl_cli.slurm.squeue import job_detail, seconds_left

    detail = job_detail(ref)
    if _not_to_requeue(ref, detail, identity.restart_count):
        return
    left_s = seconds_left(detail)
    if not _last_rank_done(identity, deployment_dir, ref, None if left_s is None else time.time() + left_s):
        return
    if (identity.step_tasks or 1) > 1 and _not_to_requeue(ref, job_detail(ref), identity.restart_count):
        return  # while it waited for the other ranks, a scancel came (or another rank requeued the job)
    # Requeueing sends us SIGTERM once more; we are done, so let it pass quietly.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    proc = subprocess.run(["scontrol", "requeue", ref], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed: %s", ref, proc.stderr.strip())
        return
    log.info("requeued %s", ref)
    # Also in a launched deployment: a task of a script of the user's own there is no member its supervisor watches.
    if deployment_dir is not None and peer_id is not None:
        try:
            note_requeued(deployment_dir, ref, peer_id)
        except OSError as e:
            log.warning("could not leave the requeue note for %s in %s (%s): it waits out Slurm's requeue delay",
                        ref, deployment_dir, e)


def _restarts(detail: dict[str, str]) -> int:
    try:
        return int(detail.get("Restarts", "0"))
    except ValueError:
        return 0


def _not_to_requeue(ref: str, detail: dict[str, str], restart_count: int = 0) -> bool:
    """Whether ``scontrol show job`` says this job must not be requeued now (said in the log); ``restart_count``:
    this run's ``SLURM_RESTART_COUNT``."""
    state = detail.get("JobState")
    if detail.get("Requeue") == "0":
        # Submitted with --no-requeue, or set so by `prorl scale` before it drained this task away.
        log.info("%s may not be requeued (Requeue=0): not requeueing", ref)
        return True
    if state in ("CANCELLED", "COMPLETING") and _restarts(detail) > restart_count:
        # Slurm is requeueing the job itself, ending this run: a preemption whose GraceTime ran out while the drain
        # ran (PreemptMode=REQUEUE), a requeue by hand or another rank's. Restarts counts it already; a scancel does
        # not. A requeue of ours now would be refused or end the next run.
        log.warning("%s is being requeued by Slurm (JobState=%s, Restarts=%s): preempted, and the partition's "
                    "GraceTime ran out before the drain did (or a requeue by hand, or by another rank); the jobs "
                    "still running went back to the broker, and the task comes back on its own", ref, state,
                    detail.get("Restarts"))
        return True
    if state in ("CANCELLED", "COMPLETING") and detail.get("Reason") != "TimeLimit":
        # scancel (`prorl down`, a user) came while the drain ran: the job is ending (scontrol shows COMPLETING,
        # reason None; at the time limit the reason is TimeLimit, and that one is requeued). Slurm would requeue
        # even a cancelled job, and it would come back and start again after the requeue delay.
        log.info("%s was cancelled while it drained (JobState=%s): not requeueing", ref, state)
        return True
    if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
        log.info("%s is requeued already (JobState=%s)", ref, state)
        return True
    return False


def _rank_marks(deployment_dir: Path, ref: str) -> Path:
    return deployment_dir / "slurm-requeued" / f".ranks-{ref}"


def forget_rank_mark(identity: SlurmIdentity, deployment_dir: Path, ref: str) -> None:
    """This rank runs (again): a mark it left in an earlier round of its job is not a drain of this one."""
    if identity.step_rank is not None:
        with contextlib.suppress(FileNotFoundError):
            (_rank_marks(deployment_dir, ref) / str(identity.step_rank)).unlink()


#: How long before its job's end a rank that finished draining stops waiting for the other ranks and requeues
#: (one that died never marks); how often it looks for their marks meanwhile.
RANKS_WAIT_MARGIN_S = 10.0
RANKS_POLL_S = 1.0


def _last_rank_done(identity: SlurmIdentity, deployment_dir: Path | None, ref: str,
                    end_at: float | None = None) -> bool:
    """Whether this task may requeue its job now: in an ``srun`` step of several tasks, only the last to end its
    drain does (a requeue ends the whole job, the ranks still draining included).

    Each rank leaves a mark in the deployment folder (shared by the step's nodes). A rank that finds every mark
    there takes the set (an atomic rename: one of two ranks ending together wins) and requeues. The others wait
    for that, or, where a rank died and never marks, until ``RANKS_WAIT_MARGIN_S`` before the job's end
    (``end_at``, epoch seconds; without one they leave it to the last rank), and then one of them requeues.
    """
    tasks, rank = identity.step_tasks, identity.step_rank
    if tasks is None or tasks <= 1 or rank is None or deployment_dir is None:
        return True
    marks = _rank_marks(deployment_dir, ref)
    try:
        marks.mkdir(parents=True, exist_ok=True)
        (marks / str(rank)).touch()
    except FileNotFoundError:
        return False  # another rank took the set between the two: it requeues
    except OSError as e:
        log.warning("could not mark rank %d of %s drained in %s (%s): requeueing now", rank, ref, marks, e)
        return True
    # A SIGTERM while this rank waits is a scancel, or Slurm ending the job another rank requeued: no requeue here.
    terminated = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()  # only the main thread takes signals
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set()) if in_main else None
    try:
        return _take_marks(marks, tasks, rank, ref, end_at, terminated)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _take_marks(marks: Path, tasks: int, rank: int, ref: str, end_at: float | None,
                terminated: threading.Event) -> bool:
    said = False
    while not terminated.is_set():
        try:
            done = sum(1 for _ in marks.iterdir())
        except FileNotFoundError:
            return False  # another rank took the set: it requeues
        out_of_time = end_at is not None and time.time() >= end_at - RANKS_WAIT_MARGIN_S
        if done >= tasks or out_of_time:
            taken = marks.with_name(f"{marks.name}.{rank}")
            try:
                os.rename(marks, taken)
            except FileNotFoundError:
                return False
            except OSError as e:
                log.warning("could not take the drain marks of %s in %s (%s): rank %d requeues the job", ref, marks,
                            e, rank)
                return True
            shutil.rmtree(taken, ignore_errors=True)
            if done < tasks:
                log.warning("%s: %d of %d ranks drained and the job ends soon (a rank died?): rank %d requeues it",
                            ref, done, tasks, rank)
            return True
        if end_at is None:
            log.info("%s: rank %d drained (%d of %d); the last rank to drain requeues the job", ref, rank, done, tasks)
            return False
        if not said:
            log.info("%s: rank %d drained (%d of %d); waiting for the others, the last one requeues the job", ref,
                     rank, done, tasks)
            said = True
        terminated.wait(RANKS_POLL_S)
    log.info("%s: SIGTERM while rank %d waited for the other ranks: not requeueing", ref, rank)
    return False


#: ``launch.json`` (prorl_cli.slurm.record.LAUNCH_NAME), read here without importing the record module.
_LAUNCH_NAME = "launch.json"


def broker_job_of(deployment_dir: Path) -> str | None:
    """The broker's Slurm job: of a ``prorl launch`` deployment (from launch.json), else the one a requeued broker
    of plain sbatch scripts noted (:mod:`prorl_cli.slurm.requeue`); None when neither says."""
    try:
        data = json.loads((deployment_dir / _LAUNCH_NAME).read_text())
    except FileNotFoundError:
        return noted_broker_job(deployment_dir)
    except (OSError, ValueError):
        return None
    members = data.get("members") if isinstance(data, dict) else None
    for m in members if isinstance(members, list) else []:
        if isinstance(m, dict) and m.get("role") == "broker" and m.get("job_id"):
            return str(m["job_id"])
    return None


def release_requeued_broker(deployment_dir: Path) -> bool:
    """While the broker is away (no rendezvous file), make its requeued Slurm job eligible now; True when it did.

    A requeued job waits in PENDING (BeginTime) for Slurm's requeue delay
    (about two minutes) and every client of the deployment with it. Its own
    job cannot shorten that (the delay is set once the job has ended), so the
    peers that wait for it do.
    """
    if rendezvous_path(deployment_dir).exists():
        return False
    ref = broker_job_of(deployment_dir)
    if ref is None:
        return False
    from prorl_cli.slurm.squeue import release_requeued

    if not release_requeued(ref):
        return False
    log.info("the broker's Slurm job %s was requeued and held for Slurm's requeue delay: "
             "made it eligible now (scontrol update StartTime=now)", ref)
    return True


@contextlib.contextmanager
def broker_requeue_watch(deployment_dir: Path, identity: SlurmIdentity) -> Iterator[None]:
    """Around a node or bridge in Slurm: a thread that releases the broker's requeued job
    (:func:`release_requeued_broker`) and, in turn with the other peers, replaces a broker job that ended on its
    own (:class:`prorl_cli.slurm.supervisor.BrokerWatch`)."""
    if not identity.in_slurm:
        yield
        return
    from prorl_cli.slurm.supervisor import BrokerWatch

    replace_ended_broker = BrokerWatch(deployment_dir)

    def check() -> None:
        release_requeued_broker(deployment_dir)
        replace_ended_broker()

    with watch("broker-watch", check):
        yield


@dataclass
class RoleSpec:
    """Everything a submitted role needs; pickled by submitit, so plain values only."""

    role: Role
    deployment: str
    home: str
    config_path: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted prorl.yaml keys
    index: int | None = None  # array position (stable across requeues and scale-ups)
    rendezvous_wait_s: float = 600.0
    requeue: bool = True
    # broker
    bind_host: str = "0.0.0.0"
    port: int = 0
    # inference
    model: str | None = None
    engine: str = "vllm"
    vllm_args: list[str] = field(default_factory=list)
    capacity: int | None = None
    max_model_len: int | None = None

    def config(self) -> ProrlConfig:
        os.environ["PRORL_HOME"] = self.home
        os.environ["PRORL_DEPLOYMENT"] = self.deployment
        return load_config(self.config_path, self.overrides)


@contextlib.contextmanager
def slurm_lifecycle(requeue: bool = True, deployment_dir: Path | None = None,
                    peer_id: str | None = None) -> Iterator[RoleSignals]:
    """Around a role: SIGTERM leaves, SIGUSR2 leaves and (in Slurm, ``requeue``) requeues the task after
    (noting it in ``deployment_dir`` as ``peer_id`` for the peers that release it: :func:`requeue_self`)."""
    identity = SlurmIdentity.from_env()
    ref = identity.task_ref
    if identity.in_slurm and deployment_dir is not None and ref is not None:
        # This task runs again: the note it left when it requeued itself goes (a peer would take the stale
        # note's job for the one to release the next time this role is away).
        try:
            forget_requeued(deployment_dir, ref)
            forget_rank_mark(identity, deployment_dir, ref)
        except OSError as e:
            log.warning("could not remove the requeue note of %s in %s: %s", ref, deployment_dir, e)
    signals = RoleSignals()
    signals.install()
    try:
        yield signals
    finally:
        signals.install()  # a role's event loop restores the default handlers on its way out
        if signals.requeue and requeue and identity.in_slurm:
            requeue_self(identity, deployment_dir, peer_id)


def serve_role(spec: RoleSpec, config: ProrlConfig | None = None) -> int:
    """Run one role in this process until it is stopped; return its exit code."""
    identity = SlurmIdentity.from_env()
    if config is None:
        config = spec.config()
        from prorl_cli.observe.logs import configure_logging

        configure_logging(spec.role, config.log_level)
    if identity.in_slurm:
        log.info("%s of deployment %r: %s", spec.role, config.deployment, identity.describe())
    peer_id = "broker" if spec.role == "broker" else identity.member_id(spec.role, spec.index)
    with slurm_lifecycle(spec.requeue, config.deployment_dir, peer_id) as signals:
        if spec.role == "broker":
            return _serve_broker(spec, config, signals)
        with broker_requeue_watch(config.deployment_dir, identity):
            if spec.role == "inference":
                # The engine starts while the broker may still be coming up; the bridge waits for it.
                return _serve_inference(spec, config, identity, signals)
            if not wait_for_broker(config.deployment_dir, spec.rendezvous_wait_s, signals.leave):
                log.info("leaving before the broker appeared")
                return 0
            _serve_node(spec, config, identity, signals)
            return 0


def _serve_broker(spec: RoleSpec, config: ProrlConfig, signals: RoleSignals) -> int:
    from prorl_cli.broker.server import Broker

    config.broker.bind_host = spec.bind_host
    config.broker.port = spec.port
    # One live broker per deployment: a second (say, a stray resubmission) refuses here.
    with BrokerLock.acquire(config.deployment_dir):
        broker = Broker(config)
        log.info("broker of %r on %s", config.deployment, broker.address)
        supervisor = _Supervisor(config.deployment_dir)
        try:
            with _peer_requeue_watch(config.deployment_dir), \
                    watch("supervisor-watch", supervisor.keep_running):
                broker.serve_forever(leave_requested=signals.leave)
        finally:
            supervisor.stop()
    return 0


class _Supervisor:
    """The broker job's supervisor child, started again when it ends while the broker serves (killed, a crash):
    self-healing must not stop without a sign."""

    def __init__(self, deployment_dir: Path) -> None:
        self.deployment_dir = deployment_dir
        self._lock = threading.Lock()
        self._stopped = False
        self.proc = _start_supervisor(deployment_dir)
        self.wanted = self.proc is not None

    def keep_running(self) -> None:
        with self._lock:
            if self._stopped or self.proc is None or self.proc.poll() is None:
                return
            log.warning("the supervisor (pid %d) ended with exit code %s while the broker serves: starting it again",
                        self.proc.pid, self.proc.returncode)
            self.proc = _start_supervisor(self.deployment_dir)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self.proc is not None:
                stop_process_group(self.proc)


@contextlib.contextmanager
def _peer_requeue_watch(deployment_dir: Path) -> Iterator[None]:
    """In the broker's Slurm job: release requeued nodes and bridges that left a note (plain sbatch scripts, and
    scripts of the user's own beside a launched deployment, whose supervisor watches only its members; a member
    released by both is made eligible once, by whichever sees it held first)."""
    if not SlurmIdentity.from_env().in_slurm:
        yield
        return
    with watch("peer-requeue-watch", lambda: release_requeued_peers(deployment_dir)):
        yield


def _start_supervisor(deployment_dir: Path) -> subprocess.Popen[bytes] | None:
    """In the broker's Slurm job of a ``prorl launch`` deployment: the child that replaces crashed tasks."""
    from prorl_cli.slurm.identity import child_env
    from prorl_cli.slurm.record import LAUNCH_NAME

    if not SlurmIdentity.from_env().in_slurm or not (deployment_dir / LAUNCH_NAME).exists():
        return None  # plain sbatch scripts or a broker outside Slurm: nothing recorded to supervise
    # It is given the broker's pid and stops once the broker is gone (killed outright, it cannot stop its child).
    return subprocess.Popen([sys.executable, "-m", "prorl_cli.slurm.supervisor", str(deployment_dir), str(os.getpid())],
                            env=child_env(), stdin=subprocess.DEVNULL, start_new_session=True)


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM a child's process group, SIGKILL it after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _serve_node(spec: RoleSpec, config: ProrlConfig, identity: SlurmIdentity, signals: RoleSignals) -> None:
    from prorl_cli.node.server import run_node

    if identity.cpus and "node.n_run" not in spec.overrides:
        log.info("Slurm gave %d CPU(s); pools as configured (n_run=%d)", identity.cpus, config.node.n_run)
    def preempted() -> None:  # the node drains with grace on its own loop; the task is requeued once it left
        signals.requeue = True

    run_node(config, node_id=identity.member_id("node", spec.index), on_preempt=preempted, leave_requested=signals.leave)


def _serve_inference(spec: RoleSpec, config: ProrlConfig, identity: SlurmIdentity, signals: RoleSignals) -> int:
    from prorl_cli.inference.serve import BridgeOptions, run_bridge

    if identity.in_slurm:
        log.info("GPUs visible: %s", ",".join(identity.gpus) or "none")
    vllm_args = list(spec.vllm_args)
    if spec.engine == "vllm" and len(identity.gpus) > 1 and not any(a.startswith("--tensor-parallel-size") for a in vllm_args):
        # One backend per task over every GPU Slurm gave it.
        vllm_args += ["--tensor-parallel-size", str(len(identity.gpus))]
    opts = BridgeOptions(
        engine=spec.engine,
        model=spec.model,
        backend_id=identity.member_id("inference", spec.index),
        capacity=spec.capacity or config.inference.capacity,
        max_model_len=spec.max_model_len,
        vllm_args=vllm_args,
        broker_wait_s=spec.rendezvous_wait_s,
    )
    return asyncio.run(run_bridge(opts, config, leave_requested=signals.leave))


def remove_stale_results(folder: str | None, task_ref: str | None) -> list[Path]:
    """Delete result pickles a previous run of this task left in its submitit folder (``SUBMITIT_FOLDER``).

    A requeued task runs again from its original pickle, but the run that
    was stopped left its ``<task_ref>_<n>_result.pkl`` behind, which
    submitit would take for this run's result. Only this task's are touched.
    """
    if not folder or not task_ref:
        return []
    stale = sorted(Path(folder).glob(f"{task_ref}_*_result.pkl"))
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.info("removed %d result pickle(s) a previous run of this task left: %s", len(stale),
                 ", ".join(p.name for p in stale))
    return stale


def submitted_role(spec: RoleSpec) -> int:
    """The function submitit runs in the Slurm task (module level, so it pickles by reference)."""
    remove_stale_results(os.environ.get("SUBMITIT_FOLDER"), SlurmIdentity.from_env().task_ref)
    return serve_role(spec)
