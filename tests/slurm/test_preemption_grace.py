"""A node's drain against its partition's preemption GraceTime, on the real Slurm.

One SIGUSR2 serves the time-limit warning and a preemption alike, and the node drains for ``node.drain_grace_s``
(``nodes.signal_delay_s`` - 30 s) on either; a preemption gives only the partition's GraceTime (20 s on ``low``
here), after which Slurm stops the task mid-drain. `launch` (and `--dry-run`, `config check`) say so, naming the
partition, both figures and the key; a role stopped that way says it was preempted, not cancelled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prorl_cli.slurm import squeue
from prorl_cli.slurm.squeue import PartitionPreemption, parse_partitions
from tests.slurm.cluster import ROLE_CONFIG, prorl, require_slurm, scontrol, wait_until, write_yaml

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]


def _grace_time_s(partition: str) -> int:
    """The partition's GraceTime, as plain ``scontrol show partition`` (not ``-o``) prints it."""
    match = re.search(r"GraceTime=(\d+)", scontrol("show", "partition", partition))
    assert match, f"scontrol shows no GraceTime for {partition}"
    return int(match.group(1))


def test_partitions_preemption_as_scontrol_prints_it() -> None:
    # One partition a line, fields in any order, a value with a space, an unknown field, clock-style GraceTime.
    text = "\n".join([
        "PartitionName=low AllowGroups=ALL GraceTime=20 Nodes=n1 PreemptMode=REQUEUE State=UP",
        "PartitionName=gpu PreemptMode=CANCEL GraceTime=00:02:00 Comment=two words NewField=x",
        "PartitionName=susp PreemptMode=GANG,SUSPEND GraceTime=30",
        "PartitionName=bare Nodes=n2",
        "PartitionName=odd GraceTime=soon PreemptMode=REQUEUE",
        "",
        "garbage without a partition name",
    ])
    parsed = parse_partitions(text)
    assert parsed == {
        "low": PartitionPreemption("low", "REQUEUE", 20),
        "gpu": PartitionPreemption("gpu", "CANCEL", 120),
        "susp": PartitionPreemption("susp", "GANG,SUSPEND", 30),
        "bare": PartitionPreemption("bare", "OFF", None),
        "odd": PartitionPreemption("odd", "REQUEUE", None),
    }
    assert [p for p, v in parsed.items() if v.stops_jobs] == ["low", "gpu", "odd"]
    assert parse_partitions("") == {}


def test_this_clusters_partitions_are_read() -> None:
    require_slurm()
    read = squeue.partition_preemption()
    assert read["low"].grace_time_s == _grace_time_s("low") > 0 and read["low"].stops_jobs
    assert read["debug"].grace_time_s == _grace_time_s("debug")


def test_launch_and_config_check_warn_when_the_drain_outlasts_the_grace_time(tmp_path: Path) -> None:
    require_slurm()
    grace_s = _grace_time_s("low")
    home = tmp_path / "home"
    config = write_yaml(tmp_path / "prorl.yaml", ROLE_CONFIG)

    def deploy(file: str, nodes: dict[str, object], prorl_yaml: Path = config) -> Path:
        return write_yaml(tmp_path / file, {"deployment": "graced", "home": str(home), "config": str(prorl_yaml),
                                            "broker": {"where": "here"}, "nodes": {"count": 1, **nodes}})

    # signal_delay_s 120 (the default): a drain of 90 s on a partition that gives 20.
    long_drain = deploy("long.yaml", {"partition": "low"})
    for args in (("launch", str(long_drain), "--dry-run"), ("config", "check", str(long_drain))):
        out = prorl(home, *args, timeout_s=120)
        assert out.returncode == 0, out.stdout + out.stderr
        said = " ".join(out.stderr.split())  # rich wraps long lines
        assert (f"nodes.partition: partition 'low' preempts with a GraceTime of {grace_s} s" in said
                and "a node drains for 90 s (nodes.signal_delay_s 120 s - 30 s)" in said
                and f"set nodes.signal_delay_s to {grace_s + 30} or less" in said), (args, out.stderr)
    # Within the GraceTime, or on a partition without one: nothing said.
    for file, nodes in (("fits.yaml", {"partition": "low", "signal_delay_s": grace_s + 30}),
                        ("debug.yaml", {"partition": "debug"})):
        out = prorl(home, "launch", str(deploy(file, nodes)), "--dry-run", timeout_s=120)
        assert out.returncode == 0 and "GraceTime" not in out.stderr, out.stderr
    # prorl.yaml's node.drain_grace_s decides the drain: that is the key named.
    own = write_yaml(tmp_path / "own.yaml", {**ROLE_CONFIG, "node": {**ROLE_CONFIG["node"], "drain_grace_s": 60}})
    out = prorl(home, "launch", str(deploy("own.yaml.deploy", {"partition": "low", "signal_delay_s": 40}, own)),
                "--dry-run", timeout_s=120)
    said = " ".join(out.stderr.split())
    assert "a node drains for 60 s (prorl.yaml's node.drain_grace_s)" in said, out.stderr
    assert f"set node.drain_grace_s in {own} to {grace_s} or less" in said, out.stderr


def test_a_failing_scontrol_does_not_stop_the_check(tmp_path: Path) -> None:
    """No partition settings to read (scontrol fails: a controller down, a login node without it): no warning."""
    require_slurm()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text("#!/bin/sh\necho 'slurm_load_partitions error: Unable to contact slurm controller' >&2\nexit 1\n")
    fake.chmod(0o755)
    deploy = write_yaml(tmp_path / "deploy.yaml", {"deployment": "noctl", "home": str(tmp_path / "home"),
                                                   "config": str(write_yaml(tmp_path / "prorl.yaml", ROLE_CONFIG)),
                                                   "nodes": {"count": 1, "partition": "low"}})
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", str(tmp_path / "home"), "config", "check",
                          str(deploy)], capture_output=True, text=True, timeout=120, check=False, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
    assert "GraceTime" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_role_preempted_mid_drain_says_so(tmp_path: Path, jobs: list[str]) -> None:
    """The drain outlasts `low`'s GraceTime: Slurm stops the role and requeues it; the role says it was
    preempted (not "cancelled while it drained") and leaves the requeue to Slurm."""
    script = tmp_path / "role.py"
    script.write_text(textwrap.dedent(f"""
        import logging, signal, threading
        from pathlib import Path
        from prorl_cli.slurm.roles import slurm_lifecycle

        logging.basicConfig(level=logging.INFO)

        d = Path({str(tmp_path)!r})
        if not (d / "ran").exists():
            (d / "ran").touch()
            with slurm_lifecycle(requeue=True) as signals:
                (d / "ready").touch()
                signals.leave.wait()  # SIGUSR2: preempted, the drain begins
                stopped = threading.Event()
                signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
                (d / "draining").touch()
                stopped.wait()  # a drain longer than the GraceTime: Slurm's SIGTERM ends it
            print("out of the lifecycle", flush=True)
    """))
    out = tmp_path / "job.out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    job = subprocess.run(["sbatch", "--parsable", "-p", "low", "--requeue", "--signal=B:USR2@30", "-t", "5",
                          "-c", "1", "--mem=256M", "--open-mode=append", "-o", str(out), "--wrap",
                          f"exec {sys.executable} {script}"],
                         capture_output=True, text=True, check=True, env=env).stdout.strip().split(";")[0]
    jobs.append(job)
    wait_until((tmp_path / "ready").exists, 60, "the role to run")
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-c", "2", "--mem=256M", "-t", "1", "-o",
                           "/dev/null", "--wrap", "true"], capture_output=True, text=True, check=True).stdout.strip()
    jobs.append(high)
    wait_until((tmp_path / "draining").exists, 30, "the preemption's SIGUSR2 to start the drain")

    def stopped() -> str | None:
        text = out.read_text()
        return text if "out of the lifecycle" in text else None

    text = wait_until(stopped, 120, "Slurm to stop the role at the end of the GraceTime")
    assert f"{job} is being requeued by Slurm" in text and "GraceTime ran out before the drain did" in text, text
    assert "cancelled while it drained" not in text and "requeued " + job not in text, text
    # Slurm requeued it (PreemptMode=REQUEUE): it is not lost.
    wait_until(lambda: squeue.job_detail(job).get("Restarts") == "1", 60, "Slurm to requeue the preempted role")
