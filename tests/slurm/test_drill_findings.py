"""What a user met in cluster drills: the simulated engine as the deployment's inference (dry runs and planning
on the cluster itself), a setup line that fails, a broker job killed moments ago, a broker cancelled by hand, and
`down` of a deployment whose broker was gone (the jobs it had accepted)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import yaml

from prorl_cli.broker.journal import JOURNAL_NAME, Journal, end_record, job_record
from prorl_cli.protocol.framing import JobState
from prorl_cli.protocol.records import JobSpec
from prorl_cli.slurm import squeue
from prorl_cli.slurm.deploy import load_deploy
from prorl_cli.slurm.launcher import plan
from prorl_cli.slurm.options import SETUP_FAILED, role_spec, sbatch_options
from prorl_cli.slurm.record import HISTORY_NAME, LaunchRecord, Member
from tests.slurm.cluster import ROLE_CONFIG, prorl, require_slurm, wait_until, write_yaml

pytestmark = pytest.mark.timeout(240)


def _sbatch(jobs: list[str], *args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-t", "5", "-c", "1", "--mem=64M", "-o", "/dev/null", *args],
                         capture_output=True, text=True, check=True).stdout
    jobs.append(out.strip().split(";")[0])
    return jobs[-1]


def _held(jobs: list[str]) -> str:
    """A job held pending for an hour: a stand-in for a node task that is still queued."""
    return _sbatch(jobs, "--begin", "now+1hour", "--wrap", "true")


def test_the_sim_engine_is_a_deployments_inference_without_a_model(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": "plan", "home": str(tmp_path / "home"),
        "inference": {"count": 2, "engine": "sim", "gpus_per_task": 0},
    })
    cfg = load_deploy(path)
    spec = role_spec(cfg, "inference", 0)
    assert spec.engine == "sim" and spec.model is None
    assert "gres" not in sbatch_options(cfg, "inference"), "gpus_per_task: 0 asks Slurm for no GPU"
    # A model given to the sim engine is only the name it serves: the nodes do not tokenize for it.
    path = write_yaml(tmp_path / "named.yaml", {
        "deployment": "plan", "home": str(tmp_path / "home"),
        "inference": {"count": 1, "engine": "sim", "model": "my-8b"},
    })
    assert "inference.tokenizer" not in role_spec(load_deploy(path), "nodes").overrides


def test_a_deployment_with_the_sim_engine_launches_and_serves(tmp_path: Path) -> None:
    require_slurm()
    home, name = tmp_path / "home", "simdry"
    config = write_yaml(tmp_path / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"time": "5", "signal_delay_s": 30, "mem_gb": 0.5},
        "nodes": {"count": 0},
        "inference": {"count": 1, "engine": "sim", "gpus_per_task": 0, "time": "5", "signal_delay_s": 30,
                      "cpus_per_task": 1, "mem_gb": 0.5},
    })
    try:
        out = prorl(home, "launch", str(deploy), "--wait-s", "150", timeout_s=200)
        assert out.returncode == 0, out.stdout + out.stderr
        status = prorl(home, "status", "-d", name, "--json", timeout_s=60)
        assert status.returncode == 0, status.stdout + status.stderr
        (backend,) = yaml.safe_load(status.stdout)["backends"]
        assert backend["backend_id"] == "inference-0" and backend["model"].startswith("sim"), backend
    finally:
        down = prorl(home, "down", "-d", name, timeout_s=200)
        assert down.returncode == 0, down.stdout + down.stderr


def test_a_setup_line_that_fails_stops_the_role_and_says_which(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": "setup", "home": str(tmp_path / "home"),
        "setup": ["export PRORL_DRILL=1", "prorl-no-such-command cuda/12.4"],
        "nodes": {"count": 1, "setup": ["echo node setup ran"]},
    })
    (nodes,) = [p for p in plan(load_deploy(path)) if p.role == "nodes"]
    # The batch script as submitted, up to the role's command: the role stands in as an echo.
    head = nodes.script.split("# command", 1)[0]
    script = tmp_path / "failing.sh"
    script.write_text(head + "\necho ROLE STARTED\n")
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 127, out.stdout + out.stderr
    assert "ROLE STARTED" not in out.stdout and "node setup ran" not in out.stdout, out.stdout
    assert f"{SETUP_FAILED} (exit 127): prorl-no-such-command cuda/12.4" in out.stderr, out.stderr
    # Setup lines that succeed run as before, and what they export reaches the role; a file they source may test
    # things that fail (a site's module init does), which is not a line of the setup failing.
    site_init = tmp_path / "site-init.sh"
    site_init.write_text("false\nexport PRORL_SITE=ok\n")
    path = write_yaml(tmp_path / "good.yaml", {
        "deployment": "setup", "home": str(tmp_path / "home"), "setup": ["export PRORL_DRILL=1", f"source {site_init}"],
        "nodes": {"count": 1, "setup": ["test -n \"$PRORL_DRILL\" || true"]},
    })
    (nodes,) = [p for p in plan(load_deploy(path)) if p.role == "nodes"]
    head = nodes.script.split("# command", 1)[0]
    script = tmp_path / "batch.sh"  # run as Slurm runs a batch script: a file, not bash -c
    script.write_text(head + "\nfalse; echo ROLE STARTED $PRORL_DRILL $PRORL_SITE\n")
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "ROLE STARTED 1 ok" in out.stdout, out.stdout + out.stderr


def _record(tmp_path: Path, name: str, broker: str, node: str) -> tuple[Path, Path]:
    home = tmp_path / "home"
    deploy = write_yaml(tmp_path / "deploy.yaml", {"deployment": name, "home": str(home), "nodes": {"count": 1}})
    LaunchRecord(name, str(deploy), str(home), time.time(), launch_id=f"{name}-L1",
                 members=[Member("broker", 0, broker), Member("nodes", 0, node)]).save(home / name)
    return home, deploy


def test_status_of_a_broker_killed_moments_ago_says_its_nodes_replace_it(tmp_path: Path, jobs: list[str]) -> None:
    # Before any node or bridge has looked at the broker's job (they take turns, every few seconds), status must
    # not call a broker they are about to replace gone.
    broker = _sbatch(jobs, "--wrap", "exit 3")
    wait_until(lambda: any(t.state == "FAILED" for t in squeue.query([broker], all_states=True)), 60,
               "the broker's stand-in to fail")
    home, _ = _record(tmp_path, "killed", broker, _held(jobs))
    out = prorl(home, "status", "-d", "killed", timeout_s=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "broker restarting" in out.stdout, out.stdout
    assert f"its Slurm job {broker} ended FAILED; its nodes and bridges replace it" in out.stdout, out.stdout
    assert "(restart 1 of 3)" in out.stdout, out.stdout
    out = prorl(home, "status", "-d", "killed", "--json", timeout_s=60)
    assert out.returncode == 0 and '"broker": "restarting"' in out.stdout, out.stdout


def test_a_broker_cancelled_by_hand_status_names_the_way_back_and_down_keeps_its_jobs(
        tmp_path: Path, jobs: list[str]) -> None:
    broker = _held(jobs)
    squeue.cancel([broker])  # a scancel of the broker: left alone, nothing replaces it
    home, deploy = _record(tmp_path, "cancelled", broker, _held(jobs))
    journal = home / "cancelled" / JOURNAL_NAME
    written = Journal(journal)  # what the broker had accepted: two jobs, one of them finished
    for job_id in ("j-0", "j-1"):
        written.append(job_record(JobSpec(job_id=job_id, task="test"), b"\x80"))
    written.append(end_record("j-0", JobState.DONE, b"\x80"))
    written.flush()
    written.close()
    accepted = journal.read_bytes()
    out = prorl(home, "status", "-d", "cancelled", timeout_s=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"its Slurm job {broker} ended CANCELLED, and nothing replaces it" in out.stderr, out.stderr
    assert "down -d cancelled" in out.stderr and f"launch {deploy} -d cancelled" in out.stderr, out.stderr
    out = prorl(home, "down", "-d", "cancelled", "--wait-s", "60", timeout_s=120)
    assert out.returncode == 0, out.stdout + out.stderr
    kept = home / "cancelled" / HISTORY_NAME / "cancelled-L1" / JOURNAL_NAME
    assert not journal.exists(), "the next launch must not replay it unasked"
    assert kept.read_bytes() == accepted, "down lost the broker's accepted jobs"
    said = " ".join(out.stdout.split())
    assert "its journal (1 job(s) accepted and not finished, 1 finished)" in said, out.stdout
    assert f"kept in {kept}" in said and f"cp {kept} {journal}" in said, out.stdout


def test_down_after_a_clean_stop_keeps_no_journal(tmp_path: Path, jobs: list[str]) -> None:
    # A broker that took the stop removed its journal itself: nothing is said about one.
    home, _ = _record(tmp_path, "clean", _held(jobs), _held(jobs))
    out = prorl(home, "down", "-d", "clean", "--wait-s", "60", timeout_s=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "journal" not in out.stdout, out.stdout
    assert not list((home / "clean").rglob(JOURNAL_NAME))


def test_logs_given_a_deployments_name_says_how_to_name_it(tmp_path: Path) -> None:
    # Every other command takes the deployment as its argument; logs takes the task there.
    home = tmp_path / "home"
    (home / "myrun").mkdir(parents=True)
    out = prorl(home, "logs", "myrun", timeout_s=60)
    assert out.returncode == 2, out.stdout + out.stderr
    said = " ".join(out.stderr.split())
    assert "'myrun' is a deployment" in said and "`prorl logs -d myrun ROLE[INDEX]`" in said, out.stderr
    out = prorl(home, "logs", "nodez", timeout_s=60)  # no such deployment: the forms a task takes, as before
    assert out.returncode == 2 and "expected broker, nodes[INDEX] or inference[INDEX]" in out.stderr, out.stderr


def test_launch_with_a_setup_line_that_fails_says_which_and_shows_no_time_left(tmp_path: Path) -> None:
    require_slurm()
    home, name = tmp_path / "home", "badsetup"
    deploy = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": name, "home": str(home), "setup": ["prorl-no-such-module-command load cuda/12.4"],
        "broker": {"time": "7", "signal_delay_s": 30, "mem_gb": 0.25},
        "nodes": {"count": 1, "time": "7", "signal_delay_s": 30, "cpus_per_task": 1, "mem_gb": 0.25},
    })
    try:
        out = prorl(home, "launch", str(deploy), "--wait-s", "120", timeout_s=180)
    finally:
        if (home / name / "launch.json").exists():  # it came up after all (the failure went unnoticed)
            prorl(home, "down", "-d", name, timeout_s=200)
    assert out.returncode != 0, out.stdout + out.stderr
    said = out.stdout + out.stderr
    assert "prorl: a setup line failed (exit 127): prorl-no-such-module-command load cuda/12.4" in said, said
    assert "nothing left queued" in said, said
    ended = [line for line in said.splitlines() if "FAILED" in line and "│" in line]
    assert ended and not any("7:00" in line for line in ended), f"an ended task shown with time left:\n{said}"


def test_down_says_how_many_unfinished_jobs_its_stop_cancelled(tmp_path: Path) -> None:
    require_slurm()
    home, name = tmp_path / "home", "inflight"
    config = write_yaml(tmp_path / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"time": "7", "signal_delay_s": 30, "mem_gb": 0.5},
        "nodes": {"count": 1, "time": "7", "signal_delay_s": 30, "cpus_per_task": 1, "mem_gb": 0.5,
                  "sandbox_runtime": "local"},
    })
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join('{"sleep_s": {"run": 600}}\n' for _ in range(3)))
    try:
        out = prorl(home, "launch", str(deploy), "--wait-s", "150", timeout_s=200)
        assert out.returncode == 0, out.stdout + out.stderr
        out = prorl(home, "submit", "-d", name, "--task", "test", str(tasks), "--id-prefix", "long", "--detach",
                    timeout_s=60)
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        down = prorl(home, "down", "-d", name, timeout_s=200)
    assert down.returncode == 0, down.stdout + down.stderr
    said = " ".join(down.stdout.split())
    assert "the broker cancelled 3 unfinished job(s) (" in said, down.stdout
