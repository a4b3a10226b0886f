"""What a killed node's sandboxes leave when the deployment goes down before a replacement starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorl_cli.sandbox.runtime import wait_gone
from tests.harness import Deployment

pytestmark = [pytest.mark.bwrap, pytest.mark.usefixtures("need_bwrap")]


def test_a_deployment_taken_down_before_a_killed_nodes_replacement_started_leaves_nothing(
    tmp_path: Path, images: dict[str, str],
) -> None:
    """The node still up when its sibling is killed cleans up after it as it leaves (it started too early to)."""
    local = tmp_path / "sb"
    d = Deployment(tmp_path / "home", "reap", config={
        "sandbox": {"runtime": "bwrap", "image": images["rootfs"], "local_dir": str(local)},
        "jobs": {"timeout_s": 120.0},
    })
    try:
        d.start_broker()
        d.start_node("n1")
        d.client.submit("sandbox_demo", [{"hang_in_run": True}])
        records = d.deployment_dir / "nodes" / "n1" / "sandboxes"
        d.wait_for(lambda st: any(records.glob("*.json")) and st.jobs.get("run", 0) > 0, 120,
                   "the job to reach RUN with its sandbox", "n1")
        (record_path,) = records.glob("*.json")
        record = json.loads(record_path.read_text())
        d.start_node("n2")  # up while n1 lives: its start has nothing of n1's to reap
        d.kill("n1")
        # n1's watchdog ends its sandbox's processes; its record and session folder stay for a node to reap.
        assert wait_gone([record["pid"]], 60) == []
        assert record_path.exists() and Path(record["session_dir"]).exists()
    finally:
        d.close()  # n2 leaves: it stops what it runs, then reaps what dead n1 left
    assert not record_path.exists() and not Path(record["session_dir"]).exists()
    assert list(local.iterdir()) == [], list(local.iterdir())
