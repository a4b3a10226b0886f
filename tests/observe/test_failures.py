"""Failures the broker itself decides (a job's node died on its last attempt) are grouped with the nodes' ones."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.observe.conftest import ObservedRun

LOST_HANDLERS = Path(__file__).resolve().parent / "handlers_lost"


def test_node_lost_failures_show_in_status_and_the_dashboard(observed_run: ObservedRun) -> None:
    d = observed_run.deployment
    d.start_node("n-doomed", "--handlers", str(LOST_HANDLERS), "--task", "obs_lost")
    (job_id,) = d.client.submit("obs_lost", [{}], max_attempts=1)
    d.wait_for(lambda st: st.by_task.get("obs_lost", {}).get("run") == 1, 30.0, "the doomed job to run", "n-doomed")
    d.kill("n-doomed", signal.SIGKILL)
    result = d.client.result(job_id, timeout_s=60)
    assert result.state == "failed" and result.error is not None and result.error["type"] == "NodeLost"
    groups = [f for f in d.client.status().failures if f["task"] == "obs_lost"]
    assert groups == [{"task": "obs_lost", "stage": "node", "type": "NodeLost", "count": 1,
                       "sample": result.error["message"], "nodes": ["broker"]}]
    assert [ev[0] for ev in result.events or []][-2:] == ["assigned", "finished"]
    out = observed_run.prorl("top", "--json", "--interval-s", "0.2")
    assert out.returncode == 0, out.stderr
    assert "NodeLost" in out.stdout
