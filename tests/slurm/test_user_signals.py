"""Signals that reach a launched task from outside, on the real Slurm: ``scancel --signal=USR2 --full`` reaches
submitit's batch shell as well as the role, and must drain and requeue the task like the time-limit warning,
not kill the shell (the task then ended FAILED, exit code 0:12, and was replaced as a crash); a preemption
that cancels (PreemptMode=CANCEL) is an end the task was not asked for, replaced at once."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.client import RolloutClient
from prorl_cli.config import load_config
from prorl_cli.slurm import squeue
from prorl_cli.slurm.record import LaunchRecord
from prorl_cli.slurm.squeue import EndedTask
from tests.slurm.cluster import (
    ROLE_CONFIG,
    logs_of,
    prorl,
    require_slurm,
    temporary_partition,
    wait_until,
    write_yaml,
)

pytestmark = pytest.mark.timeout(300)


def test_an_exit_by_signal_is_named() -> None:
    assert EndedTask("7", "FAILED", "None", "0:12").describe() == "FAILED (exit code 0:12, killed by SIGUSR2)"
    assert EndedTask("7", "FAILED", "None", "0:9").describe() == "FAILED (exit code 0:9, killed by SIGKILL)"
    assert EndedTask("7", "FAILED", "None", "2:0").describe() == "FAILED (exit code 2:0)"


def test_usr2_to_the_whole_job_drains_and_requeues_a_node(tmp_path: Path) -> None:
    require_slurm()
    home, name = tmp_path / "home", "usr2full"
    config = write_yaml(tmp_path / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"where": "here", "bind_host": "127.0.0.1"},
        "nodes": {"count": 1, "time": "5", "cpus_per_task": 1, "mem_gb": 0.5, "signal_delay_s": 30},
    })
    up = prorl(home, "launch", str(deploy), "--wait-s", "120", timeout_s=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        record = LaunchRecord.load(home / name)
        assert record is not None
        job = record.of("nodes")[0].job_id
        subprocess.run(["scancel", "--signal=USR2", "--full", job], check=True)

        def settled() -> dict[str, str] | None:
            detail = squeue.job_detail(job)
            return detail if detail.get("Restarts") == "1" or detail.get("JobState") == "FAILED" else None

        detail = wait_until(settled, 120, f"node-0 ({job}) to be requeued")
        assert detail.get("JobState") != "FAILED", (
            f"the batch shell died of SIGUSR2: {detail.get('JobState')} exit code {detail.get('ExitCode')}")
        text = logs_of(home / name / "slurm" / "nodes")
        assert "SIGUSR2" in text and f"requeued {job}" in text, text[-2000:]
    finally:
        down = prorl(home, "down", name, timeout_s=180)
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture
def cancel_partition() -> Iterator[str]:
    """A partition on n1 whose jobs `high` preempts by cancelling them at once (PreemptMode=CANCEL, no GraceTime: with
    one, the node's drain, bounded by it, ends in time for the role to requeue its task itself). Created at run
    time, deleted after."""
    yield from temporary_partition("prorlcancel", "Nodes=n1", "PriorityTier=1", "PreemptMode=CANCEL", "GraceTime=0", "OverSubscribe=NO", "State=UP")


def test_a_node_preempted_without_a_requeue_is_replaced(tmp_path: Path, cancel_partition: str) -> None:
    """PreemptMode=CANCEL ends a preempted task PREEMPTED, not requeued: the supervisor replaces it as soon as it
    sees that (it used to take PREEMPTED for an end the task was asked for, and `status` said it would not be
    replaced, until the task left squeue after MinJobAge and its log told otherwise)."""
    require_slurm()
    home, name = tmp_path / "home", "precancel"
    config = write_yaml(tmp_path / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        # Off n1, where `high` preempts whatever runs in a lower tier.
        "broker": {"time": "10", "cpus_per_task": 1, "mem_gb": 0.5, "signal_delay_s": 30,
                   "sbatch_options": {"exclude": "n1"}},
        # No GraceTime: Slurm cancels the task at once, so the role cannot requeue itself.
        "nodes": {"count": 1, "partition": cancel_partition, "time": "10", "cpus_per_task": 1, "mem_gb": 0.5,
                  "signal_delay_s": 120, "restart_backoff_s": 1},
    })
    up = prorl(home, "launch", str(deploy), "--wait-s", "150", timeout_s=200)
    high: list[str] = []
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        record = LaunchRecord.load(home / name)
        assert record is not None
        first = record.of("nodes")[0].job_id
        client = RolloutClient(name, config=load_config(overrides={"home": str(home), "deployment": name}))
        ids = client.submit("test", [{"echo": i, "sleep_s": {"run": 40.0}} for i in range(4)], timeout_s=300)
        wait_until(lambda: client.status().jobs.get("run", 0) > 0, 60, "jobs running on node-0")
        high.append(subprocess.run(["sbatch", "--parsable", "-p", "high", "-c", "2", "--mem=256M", "-t", "1", "-o",
                                    "/dev/null", "--wrap", "sleep 2"], capture_output=True, text=True,
                                   check=True).stdout.strip())

        def replaced() -> str | None:
            now = LaunchRecord.load(home / name)
            job = now.of("nodes")[0].job_id if now is not None else first
            return job if job != first else None

        second = wait_until(replaced, 150, f"the supervisor to replace node-0 ({first}) once it was preempted",
                            explain=lambda: str(squeue.query([first], all_states=True)))
        wait_until(lambda: any(t.state == "RUNNING" for t in squeue.query([second])), 120, "the replacement to run")
        status = prorl(home, "status", "-d", name, timeout_s=60)
        said = " ".join(status.stdout.split())
        assert f"node-0: replaced its Slurm job {first}, which ended PREEMPTED" in said, status.stdout
        results = client.wait(ids, timeout_s=240)
        client.close()
        assert sorted(r.output["echo"] for r in results if r.state == "done") == [0, 1, 2, 3], "none lost"
    finally:
        squeue.cancel(high)
        down = prorl(home, "down", name, timeout_s=180)
        assert down.returncode == 0, down.stdout + down.stderr
