"""The requeue notes of plain sbatch scripts (``prorl_cli.slurm.requeue``) without a cluster: a task that runs again
takes its own note away, and with several broker notes the newest names the broker job to release."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.slurm.requeue import REQUEUED_DIR, note_requeued, noted_broker_job, requeued
from prorl_cli.slurm.roles import slurm_lifecycle


@pytest.fixture
def restore_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_a_requeued_task_that_runs_again_takes_its_note_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              restore_signals: object) -> None:
    note_requeued(tmp_path, "4242", "broker")
    note_requeued(tmp_path, "77_1", "node-1")
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with slurm_lifecycle(requeue=False, deployment_dir=tmp_path, peer_id="broker"):
        # The broker's job runs again: no peer may take 4242 for a broker job to release any more.
        assert noted_broker_job(tmp_path) is None
    assert requeued(tmp_path) == {"77_1": "node-1"}  # another task's note stays for its own release
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    with slurm_lifecycle(requeue=False, deployment_dir=tmp_path, peer_id="node-1"):
        assert requeued(tmp_path) == {}


def test_the_newest_broker_note_names_the_broker_job(tmp_path: Path) -> None:
    note_requeued(tmp_path, "900", "broker")  # an earlier broker job that never ran again
    note_requeued(tmp_path, "1000", "broker")
    note_requeued(tmp_path, "1001_0", "node-0")
    folder = tmp_path / REQUEUED_DIR
    os.utime(folder / "900", (2_000_000_000, 2_000_000_000))
    os.utime(folder / "1000", (1_000_000_000, 1_000_000_000))
    assert noted_broker_job(tmp_path) == "900"
    os.utime(folder / "1000", (2_000_000_100, 2_000_000_100))
    assert noted_broker_job(tmp_path) == "1000"


def test_in_an_srun_step_only_the_last_rank_to_drain_requeues_the_job(tmp_path: Path) -> None:
    """``srun -n 2 prorl serve node`` at its time limit: a requeue ends the whole job, so the first rank to end its
    drain would cut the other's short (its jobs stopped and run again)."""
    from prorl_cli.slurm.identity import SlurmIdentity
    from prorl_cli.slurm.roles import _last_rank_done

    def rank(r: int) -> SlurmIdentity:
        return SlurmIdentity.from_env({"SLURM_JOB_ID": "55", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": str(r)})

    assert _last_rank_done(rank(1), tmp_path, "55") is False
    assert _last_rank_done(rank(0), tmp_path, "55") is True
    assert not any((tmp_path / "slurm-requeued").iterdir()), "the marks go with the requeue"
    # A task alone in its step (or the batch script) requeues at once.
    assert _last_rank_done(SlurmIdentity.from_env({"SLURM_JOB_ID": "56"}), tmp_path, "56") is True


def test_a_rank_that_died_does_not_keep_the_others_from_requeueing(tmp_path: Path) -> None:
    """Rank 2 of 3 died before the time limit and never marks: the drained ranks wait for it only until the job's
    end is near, then one of them requeues. A mark left by an earlier round goes when its rank starts again."""
    import time

    from prorl_cli.slurm.identity import SlurmIdentity
    from prorl_cli.slurm.roles import RANKS_WAIT_MARGIN_S, _last_rank_done, forget_rank_mark

    def rank(r: int) -> SlurmIdentity:
        return SlurmIdentity.from_env({"SLURM_JOB_ID": "57", "SLURM_STEP_NUM_TASKS": "3", "SLURM_PROCID": str(r)})

    assert _last_rank_done(rank(0), tmp_path, "57") is False  # no end known: left to the last rank
    ending = time.time() + RANKS_WAIT_MARGIN_S - 1  # the job ends within the margin
    assert _last_rank_done(rank(1), tmp_path, "57", ending) is True
    assert not any((tmp_path / "slurm-requeued").iterdir()), "the marks went with the requeue"
    # The job runs again: rank 0 marked in that round, then died; starting again, its old mark goes.
    assert _last_rank_done(rank(0), tmp_path, "57") is False
    forget_rank_mark(rank(0), tmp_path, "57")
    assert not any((tmp_path / "slurm-requeued" / ".ranks-57").iterdir())


def test_a_hand_written_nodes_drain_fits_in_the_time_its_job_has_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """No node.drain_grace_s (a script of the user's own, not ``prorl launch``): a job warned 60 s before its limit
    (``--signal=USR2@60``) drained for the default 90 s, and Slurm's kill cut the drain short."""
    import datetime
    import time

    import prorl_cli.slurm.squeue as squeue
    from prorl_cli.node import server

    def end_in(s: float) -> dict[str, str]:
        return {"EndTime": datetime.datetime.fromtimestamp(time.time() + s).strftime("%Y-%m-%dT%H:%M:%S")}

    assert squeue.seconds_left({"EndTime": "Unknown"}) is None
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setattr(squeue, "time_left_s", lambda ref: squeue.seconds_left(end_in(60)))
    assert 25 <= server._slurm_drain_grace(None).grace_s <= 30  # 60 s left, 30 kept for stopping and the requeue
    monkeypatch.setattr(squeue, "time_left_s", lambda ref: squeue.seconds_left(end_in(3600)))  # long before its end
    assert server._slurm_drain_grace(None).grace_s == server.DEFAULT_DRAIN_GRACE_S
    monkeypatch.setattr(squeue, "time_left_s", lambda ref: None)  # no time limit
    assert server._slurm_drain_grace(None).grace_s == server.DEFAULT_DRAIN_GRACE_S
    monkeypatch.delenv("SLURM_JOB_ID")
    assert server._slurm_drain_grace(None).grace_s == server.DEFAULT_DRAIN_GRACE_S


def test_a_rank_waiting_for_the_others_that_gets_sigterm_does_not_requeue(tmp_path: Path) -> None:
    """A scancel (or Slurm ending the job another rank requeued) while a drained rank waits: it leaves quietly."""
    import threading
    import time

    from prorl_cli.slurm.roles import _rank_marks, _take_marks

    marks = _rank_marks(tmp_path, "58")
    marks.mkdir(parents=True)
    (marks / "0").touch()
    terminated = threading.Event()
    terminated.set()
    assert _take_marks(marks, 3, 0, "58", time.time() + 3600, terminated) is False
    assert (marks / "0").exists(), "the set stays for the ranks still draining"
