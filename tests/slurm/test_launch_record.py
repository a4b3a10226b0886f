"""What `scale` and `status` say, without a cluster: role names never reused, tasks counted by what they are doing,
how an ended task ended, stale submitit results removed, the help naming the files render-sbatch writes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from click.testing import CliRunner

from prorl_cli.cli import cli
from prorl_cli.slurm.deploy import load_deploy
from prorl_cli.slurm.launcher import LaunchRecord, Member, count_role
from prorl_cli.slurm.render import render_all
from prorl_cli.slurm.roles import remove_stale_results
from prorl_cli.slurm.squeue import EndedTask, SlurmTask


def _row(job_id: str, state: str, reason: str = "None") -> SlurmTask:
    return SlurmTask(job_id, state, reason, "n1" if state == "RUNNING" else "", "0:10", "9:50", "prorl-x-nodes")


def test_a_scaled_away_role_name_is_never_given_to_another_slurm_job(tmp_path: Path) -> None:
    record = LaunchRecord(deployment="x", deploy_file="d.yaml", home=str(tmp_path), created_at=0.0,
                          members=[Member("nodes", i, f"10_{i}") for i in range(4)])
    # Scaled down by one, as launcher.scale does: node-3 retires.
    record.retired.append(record.members.pop())
    record.save(tmp_path)
    loaded = LaunchRecord.load(tmp_path)
    assert loaded is not None and [m.peer_id for m in loaded.retired] == ["node-3"]
    assert loaded.next_index("nodes") == 4, "node-3 belonged to Slurm job 10_3: a new task is node-4"
    assert loaded.next_index("inference") == 0


def test_scale_counts_serving_starting_pending_restart_and_pending_apart() -> None:
    members = [Member("nodes", i, f"20_{i}") for i in range(5)]
    rows = [_row("20_0", "RUNNING"), _row("20_1", "RUNNING"), _row("20_2", "PENDING", "BeginTime"),
            _row("20_3", "PENDING", "Resources"), _row("20_4", "FAILED", "NonZeroExitCode")]
    counts = count_role("nodes", members, rows, registered={"node-0"})
    assert (counts.serving, counts.starting, counts.pending_restart, counts.pending) == (1, 1, 1, 1)
    assert counts.total == 4, "the task that ended is not counted"
    assert counts.describe() == "1 serving, 1 starting, 1 pending restart (requeued), 1 pending"


def test_an_ended_task_says_its_state_exit_code_and_reason() -> None:
    assert EndedTask("7", "FAILED", "NonZeroExitCode", "1:0").describe() == "FAILED (exit code 1:0, reason NonZeroExitCode)"
    assert EndedTask("7", "OUT_OF_MEMORY", "None", "0:125").describe() == "OUT_OF_MEMORY (exit code 0:125)"


def test_a_requeued_task_removes_only_its_own_stale_result_pickles(tmp_path: Path) -> None:
    mine = tmp_path / "30_2_0_result.pkl"
    other = tmp_path / "30_21_0_result.pkl"
    submitted = tmp_path / "30_2_submitted.pkl"
    for path in (mine, other, submitted):
        path.write_bytes(b"x")
    assert remove_stale_results(str(tmp_path), "30_2") == [mine]
    assert not mine.exists() and other.exists() and submitted.exists()
    assert remove_stale_results(None, "30_2") == []


def test_render_sbatch_help_names_the_files_it_writes(tmp_path: Path) -> None:
    out = CliRunner().invoke(cli, ["render-sbatch", "--help"])
    named = set(re.findall(r"DIR/([\w-]+\.sbatch)", out.output))
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"deployment": "r", "home": str(tmp_path / "home"), "nodes": {"count": 1},
                                     "inference": {"count": 1, "model": str(tmp_path)}}))
    written = {p.name for p in render_all(load_deploy(path), tmp_path / "out")}
    assert named and named <= written, (named, written)
