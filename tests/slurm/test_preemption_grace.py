"""A node's drain against its partition's preemption GraceTime, on the real Slurm.

One SIGUSR2 serves the time-limit warning and a preemption alike; a preemption gives only the partition's GraceTime
(20 s on ``low`` here), after which Slurm stops the task. A node bounds its drain by its job's end (now + GraceTime
on a preemption) less a margin, so it leaves before that; `launch` (and `--dry-run`, `config check`) say what a
preemption then costs, naming the partition and both figures. A role whose drain still outlasts the GraceTime
says it was preempted, not cancelled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prorl_cli.client import RolloutClient
from prorl_cli.config import load_config
from prorl_cli.node.server import drain_grace_within
from prorl_cli.slurm import squeue
from prorl_cli.slurm.record import LaunchRecord
from prorl_cli.slurm.squeue import PartitionPreemption, parse_partitions
from tests.slurm.cluster import (
    ROLE_CONFIG,
    logs_of,
    prorl,
    require_slurm,
    scontrol,
    wait_until,
    write_yaml,
)

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


def test_launch_and_config_check_say_a_preemption_shortens_the_drain(tmp_path: Path) -> None:
    require_slurm()
    grace_s = _grace_time_s("low")
    bound = drain_grace_within(90.0, float(grace_s))
    home = tmp_path / "home"
    config = write_yaml(tmp_path / "prorl.yaml", ROLE_CONFIG)

    def deploy(file: str, nodes: dict[str, object], prorl_yaml: Path = config) -> Path:
        return write_yaml(tmp_path / file, {"deployment": "graced", "home": str(home), "config": str(prorl_yaml),
                                            "broker": {"where": "here"}, "nodes": {"count": 1, **nodes}})

    # signal_delay_s 120 (the default): a time-limit drain of 90 s, on a partition that gives 20 s. What a preempted
    # node does is said (it bounds the drain itself), not a drain Slurm would cut, nor a setting to change.
    long_drain = deploy("long.yaml", {"partition": "low"})
    for args in (("launch", str(long_drain), "--dry-run"), ("config", "check", str(long_drain))):
        out = prorl(home, *args, timeout_s=120)
        assert out.returncode == 0, out.stdout + out.stderr
        said = " ".join(out.stderr.split())  # rich wraps long lines
        assert (f"nodes.partition: partition 'low' preempts with a GraceTime of {grace_s} s" in said
                and f"a preempted node drains for at most {bound.grace_s:g} s, not the 90 s of its time-limit drain "
                    f"(nodes.signal_delay_s 120 s - 30 s), keeping {bound.margin_s:g} s of the GraceTime" in said
                and "start again on another node as a new attempt" in said), (args, out.stderr)
        assert "set nodes.signal_delay_s" not in said and "mid-drain" not in said, out.stderr
    # A drain the GraceTime leaves whole, or a partition without one: nothing said.
    for file, nodes in (("fits.yaml", {"partition": "low", "signal_delay_s": int(bound.grace_s) + 30}),
                        ("debug.yaml", {"partition": "debug"})):
        out = prorl(home, "launch", str(deploy(file, nodes)), "--dry-run", timeout_s=120)
        assert out.returncode == 0 and "GraceTime" not in out.stderr, out.stderr
    # prorl.yaml's node.drain_grace_s decides the time-limit drain: that is the source named.
    own = write_yaml(tmp_path / "own.yaml", {**ROLE_CONFIG, "node": {**ROLE_CONFIG["node"], "drain_grace_s": 60}})
    out = prorl(home, "launch", str(deploy("own.yaml.deploy", {"partition": "low", "signal_delay_s": 40}, own)),
                "--dry-run", timeout_s=120)
    said = " ".join(out.stderr.split())
    assert (f"drains for at most {bound.grace_s:g} s, not the 60 s of its time-limit drain (prorl.yaml's "
            "node.drain_grace_s)") in said, out.stderr


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


@pytest.mark.timeout(420)
def test_a_preempted_node_drains_within_the_grace_time_and_leaves_before_slurm_stops_it(tmp_path: Path) -> None:
    """A node on `low` with the default time-limit drain of 90 s, preempted while a job runs: it reads its job's
    end (now + GraceTime) when the drain begins, drains only for what that leaves after the margin, stops the job
    and leaves, and requeues its task itself while Slurm still runs it. It used to drain for 90 s, and Slurm
    stopped it mid-drain at the end of the GraceTime."""
    require_slurm()
    grace_time_s = _grace_time_s("low")
    expected = drain_grace_within(90.0, float(grace_time_s))
    home, name = tmp_path / "home", "pregrace"
    config = write_yaml(tmp_path / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(tmp_path / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"where": "here", "bind_host": "127.0.0.1"},
        # signal_delay_s 120 (the default): launch sets node.drain_grace_s to 90 s.
        "nodes": {"count": 1, "partition": "low", "time": "10", "cpus_per_task": 1, "mem_gb": 0.5,
                  "restart_backoff_s": 1},
    })
    up = prorl(home, "launch", str(deploy), "--wait-s", "150", timeout_s=200)
    high: list[str] = []
    client: RolloutClient | None = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "a preempted node drains for at most" in " ".join(up.stderr.split()), up.stderr
        record = LaunchRecord.load(home / name)
        assert record is not None
        job = record.of("nodes")[0].job_id
        client = RolloutClient(name, config=load_config(overrides={"home": str(home), "deployment": name}))
        # Runs far past any drain the GraceTime allows: stopped by the drain (or, before, by Slurm).
        [long_job] = client.submit("test", [{"echo": "long", "sleep_s": {"run": 45.0}}])
        wait_until(lambda: client.status().jobs.get("run", 0) > 0, 90, "the job running on node-0")
        high.append(subprocess.run(["sbatch", "--parsable", "-p", "high", "-c", "2", "--mem=256M", "-t", "1", "-o",
                                    "/dev/null", "--wrap", "sleep 2"], capture_output=True, text=True,
                                   check=True).stdout.strip())
        logs = home / name / "slurm" / "nodes"

        def left() -> str | None:
            text = logs_of(logs)
            return text if f"requeued {job}" in text or f"{job} is being requeued by Slurm" in text else None

        text = wait_until(left, 150, f"node-0 ({job}) to leave after the preemption",
                          explain=lambda: logs_of(logs)[-3000:])
        drained = re.search(r"draining with a grace of (\d+) s, not the 90 s of node.drain_grace_s: the Slurm job "
                            r"ends in (\d+) s", text)
        assert drained, text[-3000:]
        # Read when the drain began: the GraceTime, less the moment the signal took.
        assert int(drained.group(1)) <= expected.grace_s and int(drained.group(2)) <= grace_time_s, drained.group(0)
        assert "drain grace over (the Slurm job's end is near): stopping 1 job(s)" in text, text[-3000:]
        # The node left on its own and requeued its task while Slurm still ran it: not stopped mid-drain.
        assert f"requeued {job}" in text and "GraceTime ran out before the drain did" not in text, text[-3000:]
        before_restart = text.split(f"requeued {job}", 1)[0]
        assert "SIGTERM" not in before_restart.split("SIGUSR2", 1)[-1], before_restart[-3000:]
        # The job it stopped is queued again at once (its RUN was stopped: it runs again as a new attempt), not
        # left on a node Slurm has yet to stop. Waiting for its rerun would wait out Slurm's requeue delay.
        wait_until(lambda: client.list_jobs().get(long_job) == "queued", 30, "the stopped job queued again",
                   explain=lambda: str(client.list_jobs()))
    finally:
        if client is not None:
            client.close()
        squeue.cancel(high)
        down = prorl(home, "down", name, timeout_s=180)
        assert down.returncode == 0, down.stdout + down.stderr
