"""Self-healing: replace node and inference tasks that ended without being asked to.

Runs inside the broker's Slurm job (a child process the broker role starts
and stops; no daemon on the login node). Every ``SUPERVISE_INTERVAL_S`` it
reads the deployment's tasks from squeue (``-t all``: an ended task keeps its
final state there for MinJobAge). A task that ended FAILED, NODE_FAIL,
OUT_OF_MEMORY, TIMEOUT (not requeued), BOOT_FAIL or DEADLINE is replaced by a
new Slurm job under the same role name (``node-<index>``), after a backoff
that doubles with each restart of that name, at most ``max_restarts`` times
per name (deploy.yaml, per role). Why the old task ended (Slurm's state,
reason and exit code) is logged and kept in ``supervision.json``; a name
whose budget is spent is marked given up there with its log tail, which
``prorl status`` shows. Tasks that were asked to end (``scancel``: CANCELLED;
a drain that exited: COMPLETED) and requeued ones (PENDING) are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import ProrlError

log = logging.getLogger("prorl_cli.slurm.supervisor")  # also when run as __main__

SUPERVISION_NAME = "supervision.json"
LOCK_NAME = "launch.lock"
SUPERVISE_INTERVAL_S = 5.0


@dataclass
class NameState:
    """What supervision did for one role name."""

    restarts: int = 0
    last_restart_at: float = 0.0
    #: Every replaced task: {"job_id", "ended"} (Slurm's words for how it ended).
    history: list[dict[str, str]] = field(default_factory=list)
    #: Set once the budget is spent: {"job_id", "ended", "log_tail"}.
    gave_up: dict[str, str] | None = None


@dataclass
class Supervision:
    """``supervision.json``: per role name, its restarts and why."""

    names: dict[str, NameState] = field(default_factory=dict)

    @classmethod
    def load(cls, deployment_dir: Path) -> Supervision:
        try:
            data = json.loads((deployment_dir / SUPERVISION_NAME).read_text())
            return cls({k: NameState(**v) for k, v in data.get("names", {}).items()})
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, TypeError) as e:
            log.warning("%s unreadable (%s); starting afresh", deployment_dir / SUPERVISION_NAME, e)
            return cls()

    def save(self, deployment_dir: Path) -> None:
        path = deployment_dir / SUPERVISION_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"names": {k: asdict(v) for k, v in self.names.items()}}, indent=2))
        os.replace(tmp, path)


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


def supervise_once(deployment_dir: Path, now: float | None = None) -> list[str]:
    """One pass: replace what ended on its own and may be replaced; return the role names replaced."""
    from prorl_cli.slurm import launcher, squeue

    now = time.time() if now is None else now
    replaced: list[str] = []
    with launch_lock(deployment_dir):
        record, cfg = launcher.load_launched(deployment_dir)
        members = [m for m in record.members if m.role in ("nodes", "inference")]
        rows = {t.job_id: t for t in squeue.query([m.job_id for m in members], all_states=True)}
        sup = Supervision.load(deployment_dir)
        changed = False
        for m in members:
            t = rows.get(m.job_id)
            if t is None or t.state not in squeue.UNASKED_END_STATES:
                continue
            state = sup.names.setdefault(m.peer_id, NameState())
            if state.gave_up is not None and state.gave_up.get("job_id") == m.job_id:
                continue
            budget = cfg.role(m.role).max_restarts  # type: ignore[attr-defined]
            ended = squeue.ended(t).describe()
            if state.restarts >= budget:
                tail = launcher.log_tail(cfg, m, lines=12)
                state.gave_up = {"job_id": m.job_id, "ended": ended, "log_tail": tail}
                log.error("%s (Slurm job %s) ended %s; not replaced: its %d restart(s) (max_restarts) are spent",
                          m.peer_id, m.job_id, ended, budget)
                changed = True
                continue
            backoff_s = cfg.role(m.role).restart_backoff_s * (2 ** state.restarts)  # type: ignore[attr-defined]
            if now < state.last_restart_at + backoff_s:
                continue
            log.warning("%s (Slurm job %s) ended %s without being asked to: replacing it (restart %d of %d)",
                        m.peer_id, m.job_id, ended, state.restarts + 1, budget)
            try:
                [new] = launcher._submit(cfg, m.role, [m.index])
            except ProrlError as e:
                log.error("could not replace %s: %s", m.peer_id, e)
                continue
            state.restarts += 1
            state.last_restart_at = now
            state.history.append({"job_id": m.job_id, "ended": ended})
            record.members = [new if x is m else x for x in record.members]
            record.retired.append(m)
            replaced.append(m.peer_id)
            changed = True
            log.info("%s is now Slurm job %s", new.peer_id, new.job_id)
        if changed:
            sup.save(deployment_dir)
            record.save(deployment_dir)
    return replaced


def run(deployment_dir: Path, interval_s: float = SUPERVISE_INTERVAL_S) -> None:
    """Supervise until SIGTERM."""
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    log.info("supervising the node and inference tasks of %s every %.0f s", deployment_dir, interval_s)
    while not stop:
        try:
            supervise_once(deployment_dir)
        except ProrlError as e:
            log.warning("supervision pass failed: %s", e)
        deadline = time.monotonic() + interval_s
        while not stop and time.monotonic() < deadline:
            time.sleep(0.2)


def child_env() -> dict[str, str]:
    """This environment without the broker job's Slurm variables (sbatch would take them for the new job's)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SUBMITIT_"))}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s supervisor[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    run(Path(sys.argv[1]))
