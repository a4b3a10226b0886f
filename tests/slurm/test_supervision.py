"""A self-healing fleet on the test Slurm: a node task killed with SIGKILL is replaced under its name and every job
completes once; a replacement whose setup line fails spends the name's max_restarts and status says so, with its log."""

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
from prorl_cli.slurm.launcher import LaunchRecord
from prorl_cli.slurm.supervisor import SUPERVISION_NAME
from tests.slurm.cluster import ROLE_CONFIG, logs_of, prorl, require_slurm, wait_until, write_yaml

pytestmark = pytest.mark.timeout(600)
NAME = "heal"


@pytest.fixture
def base(tmp_path: Path) -> Iterator[Path]:
    require_slurm()
    yield tmp_path


def _node_pid(client: RolloutClient, node_id: str) -> int | None:
    return next((n.pid for n in client.status().nodes if n.node_id == node_id and n.alive), None)


def _supervision(home: Path) -> dict[str, dict]:
    path = home / NAME / SUPERVISION_NAME
    return json.loads(path.read_text())["names"] if path.exists() else {}


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
        os.kill(first_pid, signal.SIGKILL)  # the node task's process: no drain, no unregister; the task ends FAILED
        wait_until(lambda: _supervision(home).get("node-0", {}).get("restarts") == 1, 120, "node-0 replaced")
        wait_until(lambda: (_node_pid(client, "node-0") or first_pid) != first_pid, 180,
                   "the replacement to register as node-0")
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
