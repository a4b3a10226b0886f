"""``prorl launch --dry-run``, the deployment named four ways, and ``prorl logs``, on a real Slurm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prorl_cli.slurm import squeue
from prorl_cli.slurm.record import LaunchRecord
from tests.slurm.cluster import ROLE_CONFIG, prorl, require_slurm, write_yaml

pytestmark = pytest.mark.timeout(400)


def _queued_names() -> list[str]:
    """Job names in squeue (every user's: the dry run must add none)."""
    out = subprocess.run(["squeue", "-h", "-a", "-o", "%j"], capture_output=True, text=True, check=True).stdout
    return sorted(out.split())


def test_dry_run_prints_every_role_and_submits_nothing(tmp_path: Path) -> None:
    require_slurm()
    home = tmp_path / "home"
    deploy = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": "fromfile", "home": str(home),
        "broker": {"time": "5", "cpus_per_task": 1},
        "nodes": {"count": 3, "array_parallelism": 2, "time": "10", "partition": "spread"},
        "inference": {"count": 1, "gpus_per_task": 1, "model": str(tmp_path), "engine": "transformers", "time": "10"},
    })
    before = _queued_names()
    env = {k: v for k, v in os.environ.items() if k != "PRORL_DEPLOYMENT"}
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "launch", str(deploy), "-d", "dry", "--dry-run"],
                       capture_output=True, text=True, timeout=120, env={**env, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for role in ("broker", "nodes", "inference"):
        assert f"# {role}: " in out and f"#SBATCH --job-name=prorl-dry-{role}" in out, role
    assert "#SBATCH --array=0-2%2" in out and "#SBATCH --partition=spread" in out
    assert "#SBATCH --gres=gpu:1" in out and "nothing submitted" in out
    # Other users' jobs may come and go meanwhile: the dry run's own names are what must not appear.
    assert not [n for n in set(_queued_names()) - set(before) if n.startswith("prorl-dry-")], "squeue unchanged"
    assert not home.exists(), "nothing written"
    # A model folder this machine cannot read a model from is said before Slurm starts anything on it.
    assert f"inference.model: {tmp_path} is not a model directory here (no config.json)" in r.stderr, r.stderr
    # The environment names the deployment when -d does not; -d wins over it.
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "launch", str(deploy), "--dry-run"], capture_output=True,
                       text=True, timeout=120, env={**env, "PRORL_DEPLOYMENT": "fromenv"})
    assert r.returncode == 0 and "prorl-fromenv-nodes" in r.stdout, r.stderr
    # deploy.yaml names no prorl.yaml: --config names the one every role reads, and --log-level reaches them; a
    # --config naming another file than deploy.yaml's is refused rather than dropped.
    mine = write_yaml(tmp_path / "mine.yaml", {"node": {"n_run": 3}})
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "launch", str(deploy), "-d", "dry", "--dry-run",
                        "--config", str(mine), "--log-level", "debug"], capture_output=True, text=True, timeout=120,
                       env={**env, "COLUMNS": "200"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"# the roles read prorl.yaml {mine}, log level DEBUG ($PRORL_LOG_LEVEL)" in r.stdout, r.stdout
    named = write_yaml(tmp_path / "named.yaml", {**yaml.safe_load(deploy.read_text()), "config": "other.yaml"})
    write_yaml(tmp_path / "other.yaml", {})
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "launch", str(named), "--dry-run", "--config", str(mine)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "name different files" in r.stderr and "config: " in r.stderr, r.stderr
    # A partition the cluster lacks: the plan is printed, and the dry run says the launch would be refused.
    wrong = write_yaml(tmp_path / "wrong.yaml", {"deployment": "dry", "home": str(home),
                                                 "nodes": {"count": 1, "partition": "nosuchpartition"}})
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "launch", str(wrong), "--dry-run"], capture_output=True,
                       text=True, timeout=120, env={**env, "COLUMNS": "200"})
    assert r.returncode == 1 and "#SBATCH --partition=nosuchpartition" in r.stdout, r.stderr
    assert "the launch would be refused" in r.stderr and "no Slurm partition 'nosuchpartition'" in r.stderr, r.stderr


def test_logs_of_a_launched_deployment(tmp_path: Path) -> None:
    require_slurm()
    home, name = tmp_path / "home", "logsdemo"
    config = write_yaml(tmp_path / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"where": "here", "bind_host": "127.0.0.1"},
        "nodes": {"count": 1, "time": "10", "cpus_per_task": 1, "mem_gb": 0.5},
    })
    up = prorl(home, "launch", str(deploy), "--wait-s", "240")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        node = prorl(home, "logs", "-d", name, "nodes[0]")
        assert node.returncode == 0, node.stderr
        assert "node node-0 registered" in node.stdout
        assert prorl(home, "-d", name, "logs", "node-0", "--lines", "1").stdout.count("\n") == 1
        broker = prorl(home, "logs", "broker", "-d", name)
        assert broker.returncode == 0 and "broker of" in broker.stdout, broker.stdout + broker.stderr
        missing = prorl(home, "logs", "-d", name, "inference[0]")
        assert missing.returncode == 1 and "nodes[0]" in missing.stderr, "names the tasks it has"
        assert prorl(home, "logs", "-d", name, "workers[0]").returncode == 2, "an unknown role is a usage error"
    finally:
        record = LaunchRecord.load(home / name)
        down = prorl(home, "down", "-d", name)
        assert down.returncode == 0, down.stdout + down.stderr
        if record is not None:
            squeue.cancel(t.job_id for t in squeue.active(record.job_ids))
    # Taken down (the way out after a crash): the last launch's logs are still read, and it says whose.
    after = prorl(home, "logs", "-d", name, "nodes[0]")
    assert after.returncode == 0 and "node node-0 registered" in after.stdout, after.stderr
    assert record is not None and f"was taken down: the logs of its last launch ({record.launch_id})" in after.stderr
