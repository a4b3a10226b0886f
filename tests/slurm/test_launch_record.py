"""What `scale`, `status` and `logs` say and choose, without a cluster: role names never reused, tasks counted by what
they are doing, which tasks a scale-down takes (pending, then idle, then the least loaded), a broker that is restarting
told from one that is gone, every Slurm job of a task found by its name, how an ended task ended, stale submitit
results removed, the help naming the files render-sbatch writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from prorl_cli.cli import cli
from prorl_cli.cli.launch import SlurmView
from prorl_cli.exceptions import SlurmError
from prorl_cli.protocol import NodeStatus, StatusReport
from prorl_cli.slurm.deploy import load_deploy
from prorl_cli.slurm.launcher import choose_removals, count_role
from prorl_cli.slurm.record import LaunchRecord, Member
from prorl_cli.slurm.render import render_all
from prorl_cli.slurm.roles import remove_stale_results
from prorl_cli.slurm.squeue import EndedTask, SlurmTask, requeue_delayed
from prorl_cli.slurm.supervisor import NameState, Supervision


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
    # The broker did not answer (restarting): a running task is not called starting, nobody knows.
    unknown = count_role("nodes", members, rows, registered=None)
    assert (unknown.serving, unknown.starting, unknown.running, unknown.total) == (0, 0, 2, 4)
    assert unknown.describe().startswith("2 running (registered or not: the broker did not answer), "), unknown


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


def _report(**running: tuple[int, int]) -> StatusReport:
    """A broker status whose alive nodes hold these (running, placed) jobs."""
    nodes = [NodeStatus(node_id, "vm", 1, True, 16, held, ["test"], {"run": {"active": run, "queued": held - run}})
             for node_id, (run, held) in running.items()]
    return StatusReport("x", {}, 0, nodes, [], False, True, 1.0)


def test_scale_down_takes_pending_tasks_first_then_idle_then_the_least_loaded() -> None:
    members = [Member("nodes", i, f"30_{i}") for i in range(5)]
    rows = [_row("30_0", "RUNNING"), _row("30_1", "RUNNING"), _row("30_2", "RUNNING"), _row("30_3", "RUNNING"),
            _row("30_4", "PENDING", "Resources")]
    # node-0 runs 5 jobs, node-1 2 of 6 placed, node-2 none; node-3 runs but has not registered.
    report = _report(**{"node-0": (5, 5), "node-1": (2, 6), "node-2": (0, 0)})
    order = [(r.member.peer_id, r.kind) for r in choose_removals("nodes", members, rows, report, 5)]
    assert order == [("node-4", "pending"), ("node-3", "starting"), ("node-2", "idle"), ("node-1", "serving"),
                     ("node-0", "serving")]
    [one] = choose_removals("nodes", members, rows, report, 1)
    assert one.member.peer_id == "node-4" and one.describe() == "pending (Resources)"
    # It used to be the highest index whatever it did: with nothing pending, the idle node goes, not node-3's peers.
    busy = choose_removals("nodes", members[:3], rows, report, 1)
    assert [r.member.peer_id for r in busy] == ["node-2"]
    two = choose_removals("nodes", members[:2], rows, report, 1)
    assert [(r.member.peer_id, r.describe()) for r in two] == [("node-1", "serving, 2 running job(s) of 6 placed")]
    # Equal loads: the highest index goes first; ended tasks are never chosen.
    even = _report(**{"node-0": (1, 1), "node-1": (1, 1)})
    assert [r.member.peer_id for r in choose_removals("nodes", members[:2], rows, even, 1)] == ["node-1"]
    ended = [_row("30_0", "RUNNING"), _row("30_1", "FAILED")]
    assert [r.member.peer_id for r in choose_removals("nodes", members[:2], ended, even, 2)] == ["node-0"]
    # The broker not answering: pending ones still first, the running ones' load unknown.
    blind = choose_removals("nodes", members, rows, None, 2)
    assert [(r.member.peer_id, r.kind) for r in blind] == [("node-4", "pending"), ("node-3", "unknown")]


def test_a_broker_job_queued_or_running_is_restarting_and_an_ended_one_is_not() -> None:
    record = LaunchRecord(deployment="x", deploy_file="d.yaml", home="/h", created_at=0.0,
                          members=[Member("broker", 0, "40"), Member("nodes", 0, "41_0")])
    node = _row("41_0", "RUNNING")
    for state, reason, says in (("PENDING", "BeginTime", "its Slurm job 40 is PENDING (BeginTime)"),
                                ("RUNNING", "None", "its Slurm job 40 is RUNNING on n1")):
        view = SlurmView(record, [_row("40", state, reason), node])
        assert view.broker_restarting() == says and view.broker_ended() is None and not view.gone
    failed = SlurmView(record, [_row("40", "FAILED", "NonZeroExitCode"), node])
    assert failed.broker_restarting() is None and failed.broker_ended() == "its Slurm job 40 ended FAILED"
    cancelled = SlurmView(record, [_row("40", "CANCELLED"), node]).broker_ended() or ""
    assert cancelled.startswith("its Slurm job 40 ended CANCELLED, and nothing replaces it (a broker asked to end"), \
        "a scancel is left alone: the way back is named"
    assert SlurmView(record, [node]).broker_ended() == "its Slurm job 40 is not in squeue"
    assert SlurmView(record, [_row("40", "COMPLETED"), _row("41_0", "CANCELLED")]).gone
    assert SlurmView(record, None).broker_restarting() is None, "squeue did not answer: nothing to say"


def test_an_ended_broker_its_nodes_are_due_to_replace_is_restarting(tmp_path: Path) -> None:
    """Between a killed broker and its replacement, status called the deployment's broker ended (exit 1)."""
    from prorl_cli.slurm.supervisor import SeenFailure

    record = LaunchRecord(deployment="x", deploy_file="d.yaml", home=str(tmp_path), created_at=0.0, launch_id="L",
                          members=[Member("broker", 0, "40"), Member("nodes", 0, "41_0")])
    rows = [_row("40", "FAILED", "NonZeroExitCode"), _row("41_0", "RUNNING")]
    # Before a node has looked, its deploy file (d.yaml, not there) would tell the restarts left:
    # tests/slurm/test_drill_findings.py has that case.
    assert SlurmView(record, rows).broker_restarting() is None, "no failure seen yet, and no deploy file"
    (tmp_path / "x").mkdir()
    Supervision({"broker": NameState(failure=SeenFailure("40", "FAILED (exit code 137:0)", 0.0))}, "L").save(tmp_path / "x")
    assert SlurmView(record, rows).broker_restarting() == \
        "its Slurm job 40 ended FAILED (exit code 137:0); its nodes start a replacement"
    assert SlurmView(record, [rows[0], _row("41_0", "CANCELLED")]).broker_restarting() is None, "no node left to do it"


def test_only_a_requeued_job_held_for_the_requeue_delay_is_released() -> None:
    assert requeue_delayed({"JobState": "PENDING", "Reason": "BeginTime", "Restarts": "1"})
    assert not requeue_delayed({"JobState": "PENDING", "Reason": "BeginTime", "Restarts": "0"}), "a later --begin"
    assert not requeue_delayed({"JobState": "PENDING", "Reason": "Resources", "Restarts": "2"})
    assert not requeue_delayed({"JobState": "RUNNING", "Reason": "None", "Restarts": "1"})
    assert not requeue_delayed({})


def test_logs_finds_every_slurm_job_a_task_had_by_its_name(tmp_path: Path) -> None:
    home, name = tmp_path / "home", "lg"
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"deployment": name, "home": str(home), "nodes": {"count": 2}}))
    # node-0 crashed and was replaced (50_0 -> 52_0); node-1 was scaled away; the broker has had one job.
    record = LaunchRecord(deployment=name, deploy_file=str(deploy), home=str(home), created_at=0.0, launch_id="L1",
                          members=[Member("broker", 0, "49"), Member("nodes", 0, "52_0")],
                          retired=[Member("nodes", 1, "50_1"), Member("nodes", 0, "50_0")])
    record.save(home / name)
    Supervision({"node-0": NameState(restarts=1, history=[{"job_id": "50_0", "ended": "FAILED (exit code 0:9)"}])},
                "L1").save(home / name)
    for role, job in (("nodes", "50_0"), ("nodes", "50_1"), ("nodes", "52_0"), ("broker", "49")):
        folder = home / name / "slurm" / role / job
        folder.mkdir(parents=True)
        (folder / f"{job}_0_log.out").write_text(f"log of {job}\n")

    def logs(*args: str) -> tuple[int, str, str]:
        out = CliRunner().invoke(cli, ["--home", str(home), "logs", "-d", name, *args])
        return out.exit_code, out.stdout, out.stderr

    code, out, err = logs("nodes[0]")
    assert code == 0 and out == "log of 52_0\n", "the latest job by default"
    assert "attempt 1 = 50_0 (replaced; it ended FAILED (exit code 0:9))" in err and "--all" in err
    code, out, err = logs("nodes[0]", "--all")
    assert code == 0 and out == "log of 50_0\nlog of 52_0\n"
    assert "nodes[0] attempt 1 (Slurm job 50_0" in err and "nodes[0] attempt 2 (Slurm job 52_0, current)" in err
    assert logs("node-0", "--attempt", "1")[1] == "log of 50_0\n"
    code, _, err = logs("nodes[0]", "--attempt", "3")
    assert code == 1 and "has had 2 Slurm job(s)" in err
    code, out, _ = logs("nodes[1]")
    assert code == 0 and out == "log of 50_1\n", "a task scaled away is found by its name"
    code, out, _ = logs("nodes[0]", "--list")
    assert code == 0 and out.splitlines()[0].startswith("nodes[0] attempt 1: Slurm job 50_0 (replaced;")
    assert "nodes[0] attempt 2: Slurm job 52_0 (current)" in out
    assert logs("nodes")[1] == "log of 52_0\n", "the role: its live tasks"
    assert logs("nodes", "--all")[1] == "log of 50_0\nlog of 52_0\nlog of 50_1\n", "the role: every task it had"
    code, _, err = logs("nodes[7]")
    assert code == 1 and "nodes[0], nodes[1]" in err
    assert logs("broker")[1] == "log of 49\n"
    # Taken down (`down` moves the launch's state into history/): the post-mortem still tells the crash.
    from prorl_cli.slurm.record import archive_launch

    archive_launch(home / name)
    code, out, _ = logs("nodes[0]", "--list")
    assert code == 0 and out.splitlines()[0].startswith("nodes[0] attempt 1: Slurm job 50_0 (replaced;"), out
    assert "Slurm job 52_0 (last; the launch ended)" in out, out


def test_a_launch_record_that_is_not_a_json_object_is_refused_naming_the_file(tmp_path: Path) -> None:
    import pytest

    from prorl_cli.exceptions import SlurmError
    from prorl_cli.slurm.record import LAUNCH_NAME

    for text in ("[]", "null", '"x"', '{"members": [1]}'):
        (tmp_path / LAUNCH_NAME).write_text(text)
        with pytest.raises(SlurmError, match=f"{LAUNCH_NAME}: malformed launch record"):
            LaunchRecord.load(tmp_path)


def test_a_deployment_is_managed_from_any_folder_and_after_its_file_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prorl_cli.slurm.deploy import deploy_snapshot, load_deploy
    from prorl_cli.slurm.record import load_launched

    home, name = tmp_path / "home", "mv"
    project = tmp_path / "project"
    project.mkdir()
    (project / "deploy.yaml").write_text(yaml.safe_dump({"deployment": name, "home": str(home), "log_dir": "logs"}))
    monkeypatch.chdir(project)
    cfg = load_deploy("deploy.yaml")  # as typed on the command line: relative to the launch's folder
    record = LaunchRecord(deployment=name, deploy_file=str(Path(cfg.source).absolute()), home=str(home), created_at=0.0,
                          launch_id="L1", members=[Member("nodes", 0, "61_0")], deploy=deploy_snapshot(cfg))
    record.save(home / name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Another folder holding another deployment's deploy.yaml must not be read instead.
    (elsewhere / "deploy.yaml").write_text(yaml.safe_dump({"deployment": "other", "log_dir": "other-logs"}))
    monkeypatch.chdir(elsewhere)
    _, loaded = load_launched(home / name)
    assert loaded.log_path == project / "logs" and loaded.source == str(project / "deploy.yaml")
    # The file deleted after the launch: its settings as launched still name the logs (and the jobs).
    (project / "deploy.yaml").unlink()
    _, loaded = load_launched(home / name)
    assert loaded.log_path == project / "logs" and loaded.deployment == name
    # A record of an older prorl (a relative path, no snapshot) says where to run from.
    LaunchRecord(deployment=name, deploy_file="deploy.yaml", home=str(home), created_at=0.0).save(home / name)
    (elsewhere / "deploy.yaml").unlink()
    with pytest.raises(SlurmError, match="relative to the folder of that launch"):
        load_launched(home / name)
    LaunchRecord(deployment=name, deploy_file=str(project / "deploy.yaml"), home=str(home), created_at=0.0,
                 members=[Member("nodes", 0, "61_0")]).save(home / name)
    with pytest.raises(SlurmError, match="scancel 61_0"):
        load_launched(home / name)


def test_a_deployment_taken_down_is_not_called_never_launched(tmp_path: Path) -> None:
    from prorl_cli.slurm.record import archive_launch, load_launched

    home, name = tmp_path / "home", "twice"
    LaunchRecord(deployment=name, deploy_file="d.yaml", home=str(home), created_at=0.0, launch_id="L7").save(home / name)
    archive_launch(home / name)  # what `down` does once squeue is empty
    with pytest.raises(SlurmError, match=r"'twice' is not launched now: its last launch \(L7\) was taken down"):
        load_launched(home / name)
    with pytest.raises(SlurmError, match="'never' was not launched"):
        load_launched(home / "never")
