"""Self-healing: replace node and inference tasks, and the broker, that ended without being asked to.

Runs inside the broker's Slurm job (a child process the broker role starts
and stops; no daemon on the login node). Every ``SUPERVISE_INTERVAL_S`` (and
when a replacement falls due) it reads the deployment's tasks from squeue
(``-t all``: an ended task keeps its final state there for MinJobAge). A task
that ended FAILED, NODE_FAIL, OUT_OF_MEMORY, TIMEOUT (not requeued),
BOOT_FAIL or DEADLINE is replaced by a new Slurm job under the same role name
(``node-<index>``) ``restart_backoff_s`` after the supervisor first saw it
ended, that wait doubling with each restart of that name, at most
``max_restarts`` times per name (deploy.yaml, per role). A task that left
squeue before any pass saw how it ended (it ended while the supervisor was
away for longer than Slurm's MinJobAge: the broker requeued or preempted) is
judged from its log: slurmstepd's cancel line without a cause, or submitit's
clean exit, after the task's last start means it was asked to end; anything
else is an end it was not asked for. Why the old task
ended (Slurm's state, reason and exit code) is logged and kept in
``supervision.json``; a name whose budget is spent is marked given up there
with its log tail, which ``prorl status`` shows. Tasks that were asked to end
(``scancel``: CANCELLED; a drain that exited: COMPLETED) and requeued ones
(PENDING) are left alone, and so is every planned exit: a task ``prorl scale``
takes away is moved to launch.json's ``retired`` before it is signalled (the
supervisor looks only at ``members``), and ``prorl down`` marks launch.json
``stopping`` before it stops anything (the supervisor then replaces nothing).

The broker's own job is looked after the same way by its nodes and bridges
(:class:`BrokerWatch`, in turn, with the broker's ``max_restarts`` and
``restart_backoff_s``): this supervisor ends with the broker's job.

A requeued task (a node's or bridge's drain on SIGUSR2, preemption, a
requeue by hand) waits in PENDING (BeginTime) for Slurm's requeue delay,
about two minutes; the supervisor makes it eligible at once
(``scontrol update StartTime=now``). The broker's own requeue is seen by the
nodes and bridges (:func:`prorl_cli.slurm.roles.release_requeued_broker`).

``supervision.json`` belongs to one launch: it carries the launch id of
``launch.json`` and is read only by that launch (a file of another launch is
ignored); ``prorl down`` and the next ``prorl launch`` move it into
``history/<launch id>/``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from prorl_cli.exceptions import ProrlError
from prorl_cli.slurm.record import (
    LAUNCH_NAME,
    SUPERVISION_NAME,
    LaunchRecord,
    Member,
    launch_lock,
    load_launched,
    log_end,
    log_tail,
)

log = logging.getLogger("prorl_cli.slurm.supervisor")  # also when run as __main__

SUPERVISE_INTERVAL_S = 5.0


@dataclass
class SeenFailure:
    """A task of a name that the supervisor saw ended on its own and has not replaced yet."""

    job_id: str
    ended: str  # Slurm's words for how it ended
    seen_at: float  # when the supervisor first saw it ended (epoch seconds)


@dataclass
class NameState:
    """What supervision did for one role name."""

    restarts: int = 0
    #: The name's current task, once seen ended on its own and until replaced or given up on.
    failure: SeenFailure | None = None
    #: Every replaced task: {"job_id", "ended"} (Slurm's words for how it ended).
    history: list[dict[str, str]] = field(default_factory=list)
    #: Set once the budget is spent: {"job_id", "ended", "log_tail"}.
    gave_up: dict[str, str] | None = None
    #: The name's task that left squeue unseen and whose log says it was asked to end: not read again.
    left_alone: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NameState:
        known = {f.name for f in fields(cls)}
        state = cls(**{k: v for k, v in data.items() if k in known})
        if isinstance(state.failure, dict):
            state.failure = SeenFailure(**state.failure)
        return state


@dataclass
class Supervision:
    """``supervision.json``: per role name of one launch, its restarts and why."""

    names: dict[str, NameState] = field(default_factory=dict)
    #: The launch (``launch.json``'s ``launch_id``) this state belongs to.
    launch_id: str = ""

    @classmethod
    def load(cls, deployment_dir: Path, launch_id: str) -> Supervision:
        """The state of launch ``launch_id``; empty when the file is missing or belongs to another launch."""
        path = deployment_dir / SUPERVISION_NAME
        try:
            data = json.loads(path.read_text())
            if data.get("launch_id", "") != launch_id:
                log.info("%s belongs to launch %r, not %r: not read", path, data.get("launch_id", ""), launch_id)
                return cls(launch_id=launch_id)
            return cls({k: NameState.from_dict(v) for k, v in data.get("names", {}).items()}, launch_id)
        except FileNotFoundError:
            return cls(launch_id=launch_id)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("%s unreadable (%s); starting afresh", path, e)
            return cls(launch_id=launch_id)

    def save(self, deployment_dir: Path) -> None:
        path = deployment_dir / SUPERVISION_NAME
        tmp = path.with_suffix(".tmp")
        data = {"launch_id": self.launch_id, "names": {k: asdict(v) for k, v in self.names.items()}}
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)


@dataclass(frozen=True)
class Decision:
    """What to do about a name's task that ended on its own."""

    #: wait: the replacement is not due yet; replace: it is; give_up: the budget is spent; done: given up already.
    action: Literal["wait", "replace", "give_up", "done"]
    due_at: float | None = None  # wait and replace: when the replacement is (was) due


def replacement_due_at(restarts: int, seen_at: float, restart_backoff_s: float) -> float:
    """A name's next replacement: ``restart_backoff_s`` after its task was seen ended, doubled per restart made."""
    return seen_at + restart_backoff_s * (2**restarts)


def decide(state: NameState, job_id: str, now: float, max_restarts: int, restart_backoff_s: float) -> Decision:
    """What to do at ``now`` about ``job_id``, the name's task that ended on its own.

    Its failure counts as seen at ``state.failure.seen_at`` when recorded for
    this job, else at ``now`` (the caller records it).
    """
    if state.gave_up is not None and state.gave_up.get("job_id") == job_id:
        return Decision("done")
    if state.restarts >= max_restarts:
        return Decision("give_up")
    seen_at = state.failure.seen_at if state.failure is not None and state.failure.job_id == job_id else now
    due_at = replacement_due_at(state.restarts, seen_at, restart_backoff_s)
    return Decision("replace" if now >= due_at else "wait", due_at)


#: What slurmstepd writes into a task's log when it is cancelled, "*** JOB 282 ON n2 CANCELLED AT
#: 2026-12-05T21:10:41 ***", with " DUE TO TIME LIMIT" (NODE FAILURE, PREEMPTION, JOB REQUEUE) when Slurm did it.
_CANCELLED = re.compile(r"\*\*\* JOB \S+ ON \S+ CANCELLED AT \S+(?: DUE TO ([^*]+?))? \*\*\*")
#: What submitit writes at each start of a task; the log is appended to across requeues.
_STARTED = "- Starting with JobEnvironment("
#: What submitit writes when the task's function returned.
_CLEAN_EXIT = "- Exiting after successful completion"


def ended_unseen(log_text: str) -> str | None:
    """How a task that left squeue before a pass saw it ended, from its log: None when it was asked to end.

    Asked to end: a cancel without a cause (``scancel``), a requeue (the task left squeue later, cancelled while
    it waited), or a clean exit, after its last start; and an empty log: a task that never started cannot have
    crashed, and what ends one waiting in the queue is a scancel (or Slurm refusing it, which a replacement would
    meet again). Anything else (killed, a cancel by Slurm for a time limit, a node failure or a preemption that
    did not requeue it, a setup line that failed) is an end it was not asked for; the words returned say so for
    the supervisor's log and ``supervision.json``.
    """
    if not log_text.strip():
        return None
    start = log_text.rfind(_STARTED)
    last_run = log_text[start:] if start >= 0 else log_text
    cancels = _CANCELLED.findall(last_run)
    if cancels:
        cause = cancels[-1]
        if not cause or cause == "JOB REQUEUE":
            return None
        return f"CANCELLED DUE TO {cause} (from its log: it left squeue before it was seen ended)"
    if _CLEAN_EXIT in last_run:
        return None
    return "unseen (it left squeue before it was seen ended, and its log shows neither a scancel nor a clean exit)"


@dataclass
class PassResult:
    """What one supervision pass did."""

    replaced: list[str] = field(default_factory=list)  # role names given a new Slurm job
    next_due_at: float | None = None  # the earliest replacement still waiting for its backoff
    released: list[str] = field(default_factory=list)  # role names whose requeued task was made eligible now
    stopping: bool = False  # the deployment is being taken down: nothing was looked at


#: What the broker's supervisor looks after; the broker's own job is looked after by its nodes and bridges.
TASK_ROLES = ("nodes", "inference")
BROKER_ROLES = ("broker",)


def submit_outside_this_job(deployment_dir: Path, role: str, indices: list[int]) -> list[Member]:
    """Submit ``role`` tasks from a child process without this Slurm job's variables.

    sbatch takes SLURM_*/SBATCH_* variables for options of the new job, and submitit, in the new job, takes an
    inherited SLURM_ARRAY_JOB_ID for its own and looks for a pickle that is not there. The broker's supervisor
    starts with them removed; a node or bridge replacing the broker runs its sbatch through this child.
    """
    from prorl_cli.exceptions import SlurmError
    from prorl_cli.slurm.identity import child_env

    cmd = [sys.executable, "-m", "prorl_cli.slurm.supervisor", "--submit", str(deployment_dir), role,
           *map(str, indices)]
    try:
        proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"submitting the {role}: no answer in {e.timeout:.0f} s") from e
    if proc.returncode != 0:
        raise SlurmError(f"submitting the {role}: {proc.stderr.strip()[-2000:]}")
    try:
        return [Member(**m) for m in json.loads(proc.stdout.strip().splitlines()[-1])]
    except (ValueError, TypeError, IndexError) as e:
        raise SlurmError(f"submitting the {role}: unreadable answer {proc.stdout[-500:]!r}") from e


def supervise_once(deployment_dir: Path, now: float | None = None,
                   roles: tuple[str, ...] = TASK_ROLES, from_this_job: bool = True) -> PassResult:
    """One pass over the members of ``roles``: replace what ended on its own and may be replaced (by now).

    ``from_this_job``: submit from this process, whose environment holds no Slurm job's variables (the
    supervisor's); else through :func:`submit_outside_this_job` (a node or bridge, inside its own Slurm job).
    """
    from prorl_cli.slurm import squeue
    from prorl_cli.slurm.options import submit_role

    now = time.time() if now is None else now
    result = PassResult()
    with launch_lock(deployment_dir):
        record, cfg = load_launched(deployment_dir)
        if record.stopping:  # `prorl down`: what ends now was asked to
            result.stopping = True
            return result
        # Only members: tasks scaled away went to `retired` before they were asked to leave.
        members = [m for m in record.members if m.role in roles]
        rows = {t.job_id: t for t in squeue.query([m.job_id for m in members], all_states=True)}
        sup = Supervision.load(deployment_dir, record.launch_id)
        changed = False
        for m in members:
            t = rows.get(m.job_id)
            state = sup.names.get(m.peer_id)
            seen = state is not None and state.failure is not None and state.failure.job_id == m.job_id
            if t is not None and t.state == "PENDING" and t.reason == "BeginTime" and squeue.release_requeued(m.job_id):
                log.info("%s (Slurm job %s) was requeued and held for Slurm's requeue delay: made it eligible now "
                         "(scontrol update StartTime=now)", m.peer_id, m.job_id)
                result.released.append(m.peer_id)
            if t is not None and t.state not in squeue.UNASKED_END_STATES:
                if seen and t.active and state is not None:  # requeued by hand: it runs again
                    state.failure = None
                    changed = True
                continue
            unseen_end: str | None = None
            if t is None and not seen:
                # Not in squeue: it ended and aged out (MinJobAge) before a pass saw it (a member is in squeue from
                # the moment sbatch returned). Its log tells an end it was asked for from one it was not.
                if state is not None and state.left_alone == m.job_id:
                    continue
                unseen_end = ended_unseen(log_end(cfg, m))
                if unseen_end is None:
                    log.info("%s (Slurm job %s) left squeue before it was seen ended; its log says it was asked to "
                             "end: not replaced", m.peer_id, m.job_id)
                    sup.names.setdefault(m.peer_id, NameState()).left_alone = m.job_id
                    changed = True
                    continue
            state = sup.names.setdefault(m.peer_id, NameState())
            opts = cfg.role(m.role)
            budget = opts.max_restarts  # type: ignore[attr-defined]
            decision = decide(state, m.job_id, now, budget, opts.restart_backoff_s)  # type: ignore[attr-defined]
            if decision.action == "done":
                continue
            if state.failure is not None and state.failure.job_id == m.job_id:
                ended = state.failure.ended
            elif t is not None:
                ended = squeue.ended(t).describe()
            else:
                ended = unseen_end or "unseen"
            if decision.action == "give_up":
                tail = log_tail(cfg, m, lines=12)
                state.gave_up = {"job_id": m.job_id, "ended": ended, "log_tail": tail}
                state.failure = None
                log.error("%s (Slurm job %s) ended %s; not replaced: its %d restart(s) (max_restarts) are spent",
                          m.peer_id, m.job_id, ended, budget)
                changed = True
                continue
            assert decision.due_at is not None
            if not seen:
                state.failure = SeenFailure(m.job_id, ended, now)
                changed = True
                if decision.action == "wait":
                    log.warning("%s (Slurm job %s) ended %s without being asked to: replacing it in %.0f s "
                                "(restart %d of %d)", m.peer_id, m.job_id, ended, decision.due_at - now,
                                state.restarts + 1, budget)
            if decision.action == "wait":
                result.next_due_at = min(decision.due_at, result.next_due_at or decision.due_at)
                continue
            log.warning("%s (Slurm job %s) ended %s without being asked to: replacing it (restart %d of %d)",
                        m.peer_id, m.job_id, ended, state.restarts + 1, budget)
            try:
                if from_this_job:
                    [new] = submit_role(cfg, m.role, [m.index])
                else:
                    [new] = submit_outside_this_job(deployment_dir, m.role, [m.index])
            except ProrlError as e:
                log.error("could not replace %s: %s", m.peer_id, e)
                continue
            state.restarts += 1
            state.failure = None
            state.history.append({"job_id": m.job_id, "ended": ended})
            record.members = [new if x is m else x for x in record.members]
            record.retired.append(m)
            result.replaced.append(m.peer_id)
            changed = True
            log.info("%s is now Slurm job %s", new.peer_id, new.job_id)
        if changed:
            sup.save(deployment_dir)
            record.save(deployment_dir)
    return result


#: Between them, the nodes and bridges of a deployment look at its broker's Slurm job about this often (each one
#: every BROKER_LOOK_S times their number, at random): one squeue every few seconds, whatever the deployment's size.
BROKER_LOOK_S = 5.0


class BrokerWatch:
    """Run by each node and bridge of a ``prorl launch`` deployment on Slurm, every few seconds: replace the broker's
    job when it ended on its own (killed, FAILED, OUT_OF_MEMORY, NODE_FAIL), as the broker's supervisor replaces
    theirs; that supervisor is the broker job's child and ended with it.

    Several peers may look at once: the launch lock orders them, and the first one's replacement is what the
    others then find in launch.json. The new broker replays the journal and the peers follow its rendezvous file.
    """

    def __init__(self, deployment_dir: Path) -> None:
        self.deployment_dir = deployment_dir
        self._next_at = time.monotonic() + self._interval_s()

    def _interval_s(self) -> float:
        try:
            record = LaunchRecord.load(self.deployment_dir)
        except ProrlError:
            record = None
        peers = sum(m.role in TASK_ROLES for m in record.members) if record is not None else 1
        return random.uniform(0.5, 1.5) * BROKER_LOOK_S * max(2, peers)

    def __call__(self) -> None:
        """Look now if this peer's turn has come (plain sbatch scripts, without launch.json, have no broker to replace)."""
        if time.monotonic() < self._next_at:
            return
        self._next_at = time.monotonic() + self._interval_s()
        if (self.deployment_dir / LAUNCH_NAME).exists():
            supervise_once(self.deployment_dir, roles=BROKER_ROLES, from_this_job=False)


def run(deployment_dir: Path, interval_s: float = SUPERVISE_INTERVAL_S, parent_pid: int | None = None) -> None:
    """Supervise until SIGTERM, or until ``parent_pid`` (the broker that started it) is gone: a pass every
    ``interval_s``, and one when a replacement falls due.

    The broker stops it on its way out, but a broker killed outright (SIGKILL, the OOM killer) cannot; in its
    own session, under ``proctrack/linuxproc`` it would outlive the job and go on submitting replacements.
    """
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    def orphaned() -> bool:
        if parent_pid is None or os.getppid() == parent_pid:
            return False
        log.warning("its broker (pid %d) is gone: stopping", parent_pid)
        return True

    signal.signal(signal.SIGTERM, on_term)
    log.info("supervising the node and inference tasks of %s every %.0f s", deployment_dir, interval_s)
    said_stopping = False
    while not stop and not orphaned():
        wait_s = interval_s
        try:
            passed = supervise_once(deployment_dir)
            if passed.stopping and not said_stopping:
                log.info("the deployment is being taken down: replacing nothing")
                said_stopping = True
            if passed.next_due_at is not None:
                wait_s = min(interval_s, max(0.0, passed.next_due_at - time.time()))
        except (ProrlError, OSError, ValueError) as e:
            # A pass that fails (squeue unreachable, a full or flaky shared filesystem, a torn state file) is
            # retried at the next one: the supervisor outlives it, or no dead task would be replaced again.
            log.warning("supervision pass failed: %s: %s", type(e).__name__, e)
        except Exception:  # noqa: BLE001 - the rule above holds for a bug too; its traceback goes to the log
            log.exception("supervision pass failed")
        deadline = time.monotonic() + wait_s
        while not stop and time.monotonic() < deadline and (parent_pid is None or os.getppid() == parent_pid):
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _submit_main(args: list[str]) -> int:
    """``--submit DEPLOYMENT_DIR ROLE INDEX...``: submit, print the new members as one line of JSON.

    Run by :func:`submit_outside_this_job` while its caller holds the launch lock: read launch.json, never lock.
    """
    from prorl_cli.slurm.options import submit_role

    deployment_dir, role, indices = Path(args[0]), args[1], [int(i) for i in args[2:]]
    _, cfg = load_launched(deployment_dir)
    try:
        members = submit_role(cfg, role, indices)
    except ProrlError as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps([asdict(m) for m in members]))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s supervisor[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    if sys.argv[1:2] == ["--submit"]:
        sys.exit(_submit_main(sys.argv[2:]))
    run(Path(sys.argv[1]), parent_pid=int(sys.argv[2]) if len(sys.argv) > 2 else None)
