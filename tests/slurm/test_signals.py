"""Slurm's signals reach the roles: preemption (drain, requeue, rejoin), the
time-limit warning (drain before the kill), and rendered sbatch scripts
submitted with plain sbatch behave as `prorl launch` does."""

from __future__ import annotations

import collections
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.client import RolloutClient
from prorl_cli.config import load_config
from prorl_cli.slurm import squeue
from prorl_cli.slurm.record import LaunchRecord
from tests.slurm.cluster import (
    ROLE_CONFIG,
    logs_of,
    prorl,
    require_slurm,
    scontrol,
    wait_until,
    write_yaml,
)

pytestmark = pytest.mark.timeout(400)


def _client(home: Path, name: str) -> RolloutClient:
    return RolloutClient(name, config=load_config(overrides={"home": str(home), "deployment": name}))


def _sbatch(*args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0]


@pytest.fixture
def base(tmp_path: Path) -> Iterator[Path]:
    require_slurm()
    yield tmp_path


def test_preempted_node_drains_is_requeued_and_rejoins(base: Path) -> None:
    home, name = base / "home", "preempt"
    config = write_yaml(base / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"where": "here", "bind_host": "127.0.0.1"},
        # `low` holds only n1 and is preempted (with SIGUSR2, then requeue) by jobs in `high`.
        "nodes": {"count": 1, "partition": "low", "time": "10", "cpus_per_task": 1, "mem_gb": 0.5, "signal_delay_s": 30},
    })
    up = prorl(home, "launch", str(deploy), "--wait-s", "120")
    high: str | None = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        again = prorl(home, "launch", str(deploy))
        assert again.returncode != 0 and "already launched" in again.stderr, "relaunching says so"
        record = LaunchRecord.load(home / name)
        assert record is not None
        node = record.of("nodes")[0]
        with _client(home, name) as client:
            ids = client.submit("test", [{"echo": i, "sleep_s": {"run": 1.0}} for i in range(20)], timeout_s=120)
            wait_until(lambda: client.status().jobs.get("run", 0) > 0, 60, "jobs running on node-0")
            high = _sbatch("-p", "high", "-c", "2", "--mem=256M", "-t", "2", "-o", "/dev/null", "--wrap", "sleep 3")
            wait_until(lambda: any(t.state == "PENDING" for t in squeue.query([node.job_id])), 90, "node-0 requeued")
            scontrol("update", f"JobId={node.job_id}", "StartTime=now")  # skip the ~120 s requeue delay
            results = client.wait(ids, timeout_s=240)
        assert collections.Counter(r.state for r in results) == {"done": 20}
        assert sorted(r.output["echo"] for r in results) == list(range(20)), "none lost or doubled"
        # The drained jobs may all be done before the requeued task is back: wait for it to rejoin.
        def rejoined() -> str | None:
            text = logs_of(home / name / "slurm" / "nodes")
            return text if "restart 1" in text and text.count("node node-0 registered") >= 2 else None

        text = wait_until(rejoined, 180, "the requeued node-0 task to come back and rejoin")
        assert "SIGUSR2" in text and "requeued" in text
    finally:
        if high:
            squeue.cancel([high])
        down = prorl(home, "down", name)
        assert down.returncode == 0, down.stdout + down.stderr


def test_rendered_sbatch_scripts_and_the_time_limit_warning(base: Path) -> None:
    home, name = base / "home", "plain"
    config = write_yaml(base / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"time": "5", "cpus_per_task": 1, "mem_gb": 0.5, "bind_host": "127.0.0.1"},
        # Slurm checks time limits every 30 s and sends the warning at the first check that is within
        # 30 s of it. Two minutes warned 60 s before: it comes 30-60 s in, after the nodes served, and with
        # a 30 s grace they leave by 90 s, well before the kill. (A warning due in the first 30 s can be
        # sent as the job starts, before anything can catch it.)
        "nodes": {"count": 2, "time": "2", "signal_delay_s": 60, "requeue": False, "cpus_per_task": 1, "mem_gb": 0.5},
    })
    out = base / "sbatch"
    rendered = prorl(home, "render-sbatch", str(deploy), "--out", str(out))
    assert rendered.returncode == 0, rendered.stderr
    # Nodes first: they wait for the broker's rendezvous file instead of dying.
    nodes = _sbatch(str(out / "node.sbatch"))
    broker = _sbatch(str(out / "broker.sbatch"))
    try:
        wait_until(lambda: (home / name / "broker.json").exists(), 120, "the broker's rendezvous file")
        with _client(home, name) as client:
            wait_until(lambda: {n.node_id for n in client.status().nodes if n.alive} == {"node-0", "node-1"},
                       120, "node-0 and node-1 to register")
            ids = client.submit("test", [{"echo": i, "sleep_s": {"run": 0.2}} for i in range(20)], timeout_s=60)
            results = client.wait(ids, timeout_s=120)
            assert collections.Counter(r.state for r in results) == {"done": 20}
            # The time-limit warning (SIGUSR2) comes; each node drains and leaves before the limit.
            wait_until(lambda: not squeue.active([nodes]), 120, "the node tasks to end")
        for task in (f"{nodes}_0", f"{nodes}_1"):
            state = scontrol("-o", "show", "job", task)
            assert "JobState=COMPLETED" in state, f"{task} drained and exited before the limit: {state[:200]}"
        text = logs_of(home / name / "slurm")
        assert text.count("SIGUSR2") >= 2 and "not requeueing" in text
        assert "node node-0 stopped" in text and "node node-1 stopped" in text
    finally:
        assert not squeue.cancel_until_gone([nodes, broker], 60)


def test_all_in_one_allocation_serves_and_stops_on_scancel(base: Path) -> None:
    home, name = base / "home", "aio"
    config = write_yaml(base / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"bind_host": "127.0.0.1"},
        "nodes": {"count": 1, "time": "5", "cpus_per_task": 1, "mem_gb": 1},
    })
    out = base / "sbatch"
    assert prorl(home, "render-sbatch", str(deploy), "--out", str(out)).returncode == 0
    job = _sbatch(str(out / "all-in-one.sbatch"))
    try:
        wait_until(lambda: (home / name / "broker.json").exists(), 120, "the broker's rendezvous file")
        with _client(home, name) as client:
            wait_until(lambda: [n.node_id for n in client.status().nodes if n.alive] == [f"node-{job}"],
                       120, "the allocation's node server to register")
            results = client.wait(client.submit("test", [{"echo": i} for i in range(10)], timeout_s=60), timeout_s=60)
            assert collections.Counter(r.state for r in results) == {"done": 10}
        squeue.cancel([job])  # the trap forwards SIGTERM to every role at once
        assert not squeue.wait_gone([job], 60)
        text = logs_of(home / name / "slurm")
        assert f"node node-{job} stopped" in text and "leaving on a signal" in text
    finally:
        squeue.cancel([job])


def _restarts(ref: str) -> int:
    detail = squeue.job_detail(ref)
    return int(detail.get("Restarts", "0") or 0)


def _usr2(ref: str) -> None:
    """The time-limit warning to a plain sbatch task: its batch step is the role itself (``exec``)."""
    subprocess.run(["scancel", "--batch", "--signal=USR2", ref], check=True, capture_output=True)


def _one_job_done(home: Path, name: str, tag: str) -> None:
    with _client(home, name) as client:
        (job,) = client.submit("test", [{"echo": tag}], timeout_s=60)
        (result,) = client.wait([job], timeout_s=120)
    assert result.state == "done" and result.output["echo"] == tag, result


def test_rendered_scripts_requeue_without_waiting_out_slurms_delay(base: Path) -> None:
    """Plain sbatch scripts (no supervisor): a node requeued on SIGUSR2 is made eligible by the broker, a broker
    requeued on SIGUSR2 by its node, each from the note the requeued task left; both serve again."""
    home, name = base / "home", "plainrq"
    config = write_yaml(base / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"time": "10", "cpus_per_task": 1, "mem_gb": 0.5, "bind_host": "127.0.0.1", "signal_delay_s": 30},
        "nodes": {"count": 1, "time": "10", "signal_delay_s": 30, "cpus_per_task": 1, "mem_gb": 0.5},
    })
    out = base / "sbatch"
    rendered = prorl(home, "render-sbatch", str(deploy), "--out", str(out))
    assert rendered.returncode == 0, rendered.stderr
    nodes = _sbatch(str(out / "node.sbatch"))
    broker = _sbatch(str(out / "broker.sbatch"))
    node = f"{nodes}_0"
    logs = home / name / "slurm"
    figures = {}
    try:
        wait_until(lambda: (home / name / "broker.json").exists(), 120, "the broker's rendezvous file")
        wait_until(lambda: logs_of(logs).count("node node-0 registered from") >= 1, 120, "node-0 to register")
        _one_job_done(home, name, "before")

        started = time.monotonic()
        _usr2(node)  # drain, requeue itself, leave a note; the broker makes it eligible at once
        # The broker's line (the node logs "registered with"), counted once Slurm has requeued the task: the
        # USR2 is delivered asynchronously, and a job sent meanwhile may still be served by the old task.
        wait_until(lambda: _restarts(node) == 1 and logs_of(logs).count("node node-0 registered from") >= 2, 240,
                   "node-0 back after its requeue")
        _one_job_done(home, name, "node-back")
        figures["node USR2 -> serving again"] = time.monotonic() - started
        assert _restarts(node) == 1
        text = logs_of(logs)
        assert f"node-0 (Slurm job {node}) was requeued and held for Slurm's requeue delay: made it eligible now" in text

        started = time.monotonic()
        _usr2(broker)  # leave keeping the journal, requeue itself, leave a note; node-0 makes it eligible
        wait_until(lambda: _restarts(broker) == 1 and (home / name / "broker.json").exists(), 240,
                   "the broker back after its requeue")
        _one_job_done(home, name, "broker-back")
        figures["broker USR2 -> serving again"] = time.monotonic() - started
        text = logs_of(logs)
        assert f"the broker's Slurm job {broker} was requeued and held for Slurm's requeue delay: made it eligible now" \
            in text, text[-3000:]
    finally:
        assert not squeue.cancel_until_gone([nodes, broker], 60)
    # Seconds on this machine (docs/reliability.md quotes them; no assertion on speed here).
    print({k: round(v, 1) for k, v in figures.items()})
