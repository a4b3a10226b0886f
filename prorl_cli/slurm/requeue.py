"""Requeued tasks made eligible at once where no supervisor does it: deployments of ``prorl render-sbatch`` scripts.

Slurm keeps a requeued job PENDING (reason ``BeginTime``) for its requeue
delay, about two minutes, and the job itself cannot shorten it: the delay
is set once its last process has exited. Someone else must run ``scontrol
update JobId=REF StartTime=now`` (the user may, for their own jobs). In a
``prorl launch`` deployment the broker's supervisor does it for nodes and
bridges, and they do it for the broker, whose job they find in
``launch.json``. Plain sbatch scripts have neither, so each task that
requeues itself leaves a note in the deployment folder::

    <deployment>/slurm-requeued/<slurm ref>      # holds the peer id: node-0, inference-1, broker

and the peers read it: the broker (in a Slurm job, without a supervisor)
releases the nodes and bridges named there, and the nodes and bridges
release the broker while it is away. A note goes once its task runs again
or has left squeue.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from prorl_cli.exceptions import ProrlError

log = logging.getLogger(__name__)

#: The notes' folder under the deployment folder.
REQUEUED_DIR = "slurm-requeued"
#: How often the watchers look: a random pick in this range, so a large deployment does not ask Slurm at once.
WATCH_INTERVAL_S = (2.0, 4.0)


def note_requeued(deployment_dir: Path, ref: str, peer_id: str) -> None:
    """Leave a note that ``peer_id`` (Slurm task ``ref``) requeued itself, for a peer to release it."""
    folder = deployment_dir / REQUEUED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{ref}.tmp"
    tmp.write_text(peer_id)
    tmp.replace(folder / ref)  # whole or not at all, for a reader that lists the folder meanwhile


def requeued(deployment_dir: Path) -> dict[str, str]:
    """The notes: Slurm ref -> peer id."""
    folder = deployment_dir / REQUEUED_DIR
    notes = {}
    with contextlib.suppress(FileNotFoundError):
        for path in folder.iterdir():
            if not path.name.startswith("."):
                with contextlib.suppress(OSError):
                    notes[path.name] = path.read_text().strip()
    return notes


def forget(deployment_dir: Path, ref: str) -> None:
    """Remove the note of ``ref`` (it runs again, or is gone)."""
    (deployment_dir / REQUEUED_DIR / ref).unlink(missing_ok=True)


def noted_broker_job(deployment_dir: Path) -> str | None:
    """The Slurm job of a broker that requeued itself (plain sbatch scripts), or None; the newest note when
    several name a broker (one of an earlier broker job that never ran again stays until it leaves squeue)."""
    folder = deployment_dir / REQUEUED_DIR
    newest: tuple[float, str] | None = None
    for ref, peer in requeued(deployment_dir).items():
        if peer != "broker":
            continue
        try:
            mtime = (folder / ref).stat().st_mtime
        except OSError:
            continue  # gone meanwhile
        if newest is None or mtime > newest[0]:
            newest = (mtime, ref)
    return None if newest is None else newest[1]


def release_requeued_peers(deployment_dir: Path) -> list[str]:
    """The broker's side: make the requeued nodes and bridges noted here eligible now; return the peers released.

    A note stays while its task is requeued but not yet held (Slurm still ending it) and goes once the
    task runs again or has left squeue.
    """
    from prorl_cli.slurm.squeue import job_detail, release_requeued, requeue_delayed

    released = []
    for ref, peer in requeued(deployment_dir).items():
        if peer == "broker":
            continue
        detail = job_detail(ref)
        if requeue_delayed(detail):
            if release_requeued(ref):
                log.info("%s (Slurm job %s) was requeued and held for Slurm's requeue delay: made it eligible now "
                         "(scontrol update StartTime=now)", peer, ref)
                released.append(peer)
        elif not detail or detail.get("JobState") in ("RUNNING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"):
            forget(deployment_dir, ref)
    return released


@contextlib.contextmanager
def watch(name: str, check: Callable[[], object]) -> Iterator[None]:
    """Run ``check`` every few seconds in a thread while the block runs (Slurm unreachable: tried again next time)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(random.uniform(*WATCH_INTERVAL_S)):
            try:
                check()
            except (ProrlError, OSError) as e:
                log.debug("%s: %s", name, e)
            except Exception:  # noqa: BLE001 - a bug must not end the watch for good; its traceback goes to the log
                log.exception("%s failed", name)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
