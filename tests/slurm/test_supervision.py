"""A self-healing fleet on the test Slurm: a node task killed with SIGKILL is replaced under its name, `prorl logs
nodes[0] --all` shows the killed job's log and the replacement's, and every job completes once; a replacement whose setup line fails spends the name's max_restarts and status says so, with its log.
Restarts belong to one launch (a deployment taken down and launched again counts from zero; the old state is kept in
history/), and a replacement waits restart_backoff_s from when the failure was seen."""

from __future__ import annotations

import collections
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.client import RolloutClient
from prorl_cli.config import load_config
from prorl_cli.slurm import squeue
from prorl_cli.slurm.record import HISTORY_NAME, SUPERVISION_NAME, LaunchRecord
from tests.slurm.cluster import ROLE_CONFIG, logs_of, prorl, require_slurm, wait_until, write_yaml

pytestmark = pytest.mark.timeout(600)
NAME = "heal"


@pytest.fixture
def base(tmp_path: Path) -> Iterator[Path]:
    require_slurm()
    yield tmp_path


def _node_pid(client: RolloutClient, node_id: str) -> int | None:
    return next((n.pid for n in client.status().nodes if n.node_id == node_id and n.alive), None)


def _supervision(home: Path, name: str = NAME) -> dict[str, dict]:
    path = home / name / SUPERVISION_NAME
    return json.loads(path.read_text())["names"] if path.exists() else {}


def _launch_id(home: Path, name: str) -> str:
    record = LaunchRecord.load(home / name)
    assert record is not None and record.launch_id, "launch.json names its launch"
    return record.launch_id


def _node0_job(home: Path, name: str) -> str:
    record = LaunchRecord.load(home / name)
    assert record is not None
    return record.of("nodes")[0].job_id


def _client(home: Path, name: str) -> RolloutClient:
    return RolloutClient(name, config=load_config(overrides={"home": str(home), "deployment": name}))


def _kill_node0(home: Path, name: str) -> None:
    """SIGKILL node-0's process (no drain, no unregister): its Slurm task ends FAILED."""
    client = _client(home, name)
    try:
        pid = wait_until(lambda: _node_pid(client, "node-0"), 60, "node-0 registered with its pid")
    finally:
        client.close()
    os.kill(pid, signal.SIGKILL)


def _down(home: Path, name: str) -> None:
    """``prorl down`` of a launched deployment (none launched: nothing to do), then scancel anything it left."""
    if LaunchRecord.load(home / name) is None:
        return
    down = prorl(home, "down", name, timeout_s=200)
    record = LaunchRecord.load(home / name)
    if record is not None:
        squeue.cancel(t.job_id for t in squeue.active(record.job_ids))
    assert down.returncode == 0, down.stdout + down.stderr


def _one_node(base: Path, name: str, **nodes: object) -> Path:
    config = write_yaml(base / "prorl.yaml", ROLE_CONFIG)
    return write_yaml(base / "deploy.yaml", {
        "deployment": name, "home": str(base / "home"), "config": str(config),
        "broker": {"time": "15", "cpus_per_task": 1, "mem_gb": 0.5},
        "nodes": {"count": 1, "time": "15", "cpus_per_task": 1, "mem_gb": 0.5, **nodes},
    })


def test_a_killed_node_task_is_replaced_and_a_failing_one_given_up_with_its_log(base: Path) -> None:
    home = base / "home"
    broken = base / "broken"  # once it exists, a node task's setup line fails
    config = write_yaml(base / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": NAME, "home": str(home), "config": str(config),
        "broker": {"time": "15", "cpus_per_task": 1, "mem_gb": 0.5},
        "nodes": {"count": 2, "time": "15", "cpus_per_task": 1, "mem_gb": 0.5, "max_restarts": 2,
                  "restart_backoff_s": 1.0, "setup": [f"test ! -e {broken} || {{ echo 'setup: {broken} exists'; exit 3; }}"]},
    })
    up = prorl(home, "launch", str(deploy), "--wait-s", "240", timeout_s=300)
    client = RolloutClient(NAME, config=load_config(overrides={"home": str(home), "deployment": NAME}))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        ids = client.submit("test", [{"echo": i, "sleep_s": {"run": 1.0}} for i in range(30)], timeout_s=240)
        wait_until(lambda: client.status().jobs.get("run", 0) > 0, 60, "jobs running")
        first_pid = _node_pid(client, "node-0")
        assert first_pid is not None
        killed = _node0_job(home, NAME)
        os.kill(first_pid, signal.SIGKILL)  # the node task's process: no drain, no unregister; the task ends FAILED
        wait_until(lambda: _supervision(home).get("node-0", {}).get("restarts") == 1, 120, "node-0 replaced")
        wait_until(lambda: (_node_pid(client, "node-0") or first_pid) != first_pid, 180,
                   "the replacement to register as node-0")
        # Both Slurm jobs of nodes[0] by its name: the killed one's log and the replacement's.
        replacement = _node0_job(home, NAME)
        shown = prorl(home, "logs", "-d", NAME, "nodes[0]", "--all")
        assert shown.returncode == 0, shown.stderr
        assert f"nodes[0] attempt 1 (Slurm job {killed}, replaced; it ended FAILED" in shown.stderr, shown.stderr
        assert f"nodes[0] attempt 2 (Slurm job {replacement}, current)" in shown.stderr, shown.stderr
        assert shown.stdout.count("node node-0 registered") >= 2, "the killed job's log and the replacement's"
        first = prorl(home, "logs", "-d", NAME, "nodes[0]", "--attempt", "1")
        assert first.returncode == 0 and first.stdout.count("node node-0 registered") == 1, first.stderr
        results = client.wait(ids, timeout_s=240)
        assert collections.Counter(r.state for r in results) == {"done": 30}
        assert sorted(r.output["echo"] for r in results) == list(range(30)), "none lost or doubled"
        record = LaunchRecord.load(home / NAME)
        assert record is not None and len(record.of("nodes")) == 2
        assert [m.peer_id for m in record.retired] == ["node-0"], "the killed task's job is kept in the history"

        # A replacement that fails at start: replaced at most max_restarts times, then given up, with its log.
        broken.write_text("")
        second_pid = _node_pid(client, "node-0")
        assert second_pid is not None
        os.kill(second_pid, signal.SIGKILL)
        wait_until(lambda: _supervision(home).get("node-0", {}).get("gave_up"), 180, "node-0 given up")
        sup = _supervision(home)["node-0"]
        assert sup["restarts"] == 2 and len(sup["history"]) == 2, sup
        assert all("FAILED" in h["ended"] for h in sup["history"]), sup
        assert "exists" in sup["gave_up"]["log_tail"], sup["gave_up"]
        status = prorl(home, "status", NAME)
        assert "not replaced any more" in status.stdout and f"setup: {broken} exists" in status.stdout, status.stdout
        assert "without being asked to: replacing it" in logs_of(home / NAME / "slurm" / "broker")
    finally:
        client.close()
        down = prorl(home, "down", NAME, timeout_s=200)
        record = LaunchRecord.load(home / NAME)
        if record is not None:
            squeue.cancel(t.job_id for t in squeue.active(record.job_ids))
        assert down.returncode == 0, down.stdout + down.stderr


def test_a_deployment_launched_again_under_its_name_counts_no_earlier_restarts(base: Path) -> None:
    name, home = "heal-again", base / "home"
    deploy = _one_node(base, name, max_restarts=1, restart_backoff_s=0.0)
    try:
        up = prorl(home, "launch", str(deploy), "--wait-s", "240", timeout_s=300)
        assert up.returncode == 0, up.stdout + up.stderr
        first = _launch_id(home, name)
        _kill_node0(home, name)
        wait_until(lambda: _supervision(home, name).get("node-0", {}).get("restarts") == 1, 120, "node-0 replaced")
        assert "node-0: replaced its Slurm job" in prorl(home, "status", name).stdout
        _down(home, name)
        assert not (home / name / SUPERVISION_NAME).exists(), "down leaves no state for the next launch to read"
        archived = json.loads((home / name / HISTORY_NAME / first / SUPERVISION_NAME).read_text())
        assert archived["launch_id"] == first and archived["names"]["node-0"]["restarts"] == 1, archived

        up = prorl(home, "launch", str(deploy), "--wait-s", "240", timeout_s=300)
        assert up.returncode == 0, up.stdout + up.stderr
        second = _launch_id(home, name)
        assert second != first
        status = prorl(home, "status", name)
        assert "replaced its Slurm job" not in status.stdout, "the earlier launch's replacement is not this one's"
        killed = _node0_job(home, name)
        _kill_node0(home, name)
        # max_restarts 1: with the earlier launch's count the name would be given up on instead.
        wait_until(lambda: _supervision(home, name).get("node-0", {}).get("restarts") == 1, 120,
                   "node-0 replaced in the second launch")
        saved = json.loads((home / name / SUPERVISION_NAME).read_text())
        assert saved["launch_id"] == second and saved["names"]["node-0"]["gave_up"] is None, saved
        assert [h["job_id"] for h in saved["names"]["node-0"]["history"]] == [killed], saved
        record = LaunchRecord.load(home / name)
        assert record is not None
        broker_log = logs_of(home / name / "slurm" / "broker" / record.of("broker")[0].job_id)
        assert "replacing it (restart 1 of 1)" in broker_log and "max_restarts) are spent" not in broker_log
    finally:
        _down(home, name)


def test_a_failed_task_is_replaced_only_after_restart_backoff_s(base: Path) -> None:
    name, home = "heal-wait", base / "home"
    # Longer than the test: the replacement must not come before it is due.
    deploy = _one_node(base, name, max_restarts=1, restart_backoff_s=3600.0)
    try:
        up = prorl(home, "launch", str(deploy), "--wait-s", "240", timeout_s=300)
        assert up.returncode == 0, up.stdout + up.stderr
        killed = _node0_job(home, name)
        _kill_node0(home, name)
        broker_logs = home / name / "slurm" / "broker"
        wait_until(lambda: f"node-0 (Slurm job {killed}) ended" in logs_of(broker_logs), 120,
                   "the supervisor to log node-0's end")
        sup = wait_until(lambda: _supervision(home, name).get("node-0"), 60, "the supervisor's state of that pass")
        # The pass that saw it ended replaced nothing: the replacement is due an hour after that.
        assert sup["restarts"] == 0 and sup["history"] == [], sup
        assert sup["failure"]["job_id"] == killed and "FAILED" in sup["failure"]["ended"], sup
        assert _node0_job(home, name) == killed
        record = LaunchRecord.load(home / name)
        assert record is not None and record.retired == []
        broker_log = logs_of(broker_logs)
        assert "without being asked to: replacing it in 3600 s (restart 1 of 1)" in broker_log, broker_log[-3000:]
        status = prorl(home, "status", name)
        assert "replacement due in" in status.stdout and "(restart 1 of 1)" in status.stdout, status.stdout
    finally:
        _down(home, name)


def test_the_supervisor_outlives_a_pass_that_fails_with_an_os_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full or flaky shared filesystem fails a pass with OSError: the next pass still runs (no Slurm needed)."""
    from prorl_cli.slurm import supervisor

    passes: list[str] = []

    def flaky(deployment_dir: Path) -> supervisor.PassResult:
        passes.append("pass")
        if len(passes) == 1:
            raise OSError(28, "No space left on device")
        os.kill(os.getpid(), signal.SIGTERM)  # what stops a supervisor: the second pass ran
        return supervisor.PassResult()

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(supervisor, "supervise_once", flaky)
    try:
        supervisor.run(tmp_path, interval_s=0.01)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert passes == ["pass", "pass"]
