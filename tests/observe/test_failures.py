"""Failures the broker itself decides (a job's node died on its last attempt) are grouped with the nodes' ones."""

from __future__ import annotations

import re
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


def test_inspect_and_report_name_the_node_a_requeued_job_lost(observed_run: ObservedRun, tmp_path: Path) -> None:
    # A job whose node was killed under it is queued again (attempt 2): its result names only the node it ended
    # on (none here: cancelled while queued), so inspect and the report say which node it lost and why.
    d = observed_run.deployment
    d.start_node("n-doomed-2", "--handlers", str(LOST_HANDLERS), "--task", "obs_lost")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("{}\n")
    out = observed_run.prorl("submit", str(tasks), "--task", "obs_lost", "--id-prefix", "requeued", "--detach")
    assert out.returncode == 0, out.stderr
    d.wait_for(lambda st: st.by_task.get("obs_lost", {}).get("run") == 1, 30.0, "the doomed job to run", "n-doomed-2")
    d.kill("n-doomed-2", signal.SIGKILL)
    d.wait_for(lambda st: st.by_task.get("obs_lost", {}).get("queued") == 1, 60.0, "the job to be queued again")
    assert observed_run.prorl("cancel", "--prefix", "requeued").returncode == 0
    results = tmp_path / "results.jsonl"
    out = observed_run.prorl("results", "--prefix", "requeued", "--follow", "--out", str(results))
    assert out.returncode == 0, out.stderr

    out = observed_run.prorl("inspect", str(results))
    assert out.returncode == 0, out.stderr
    assert "attempt 2" in out.stdout
    assert re.search(r"node n-doomed-2 lost at [0-9.]+ s \(silent for [0-9.]+ s\): queued again", out.stdout), out.stdout
    page = tmp_path / "report.html"
    out = observed_run.prorl("report", str(results), "--html", str(page))
    assert out.returncode == 0, out.stderr
    assert re.search(r"node n-doomed-2 lost at [0-9.]+ s \(silent for [0-9.]+ s\): queued again", page.read_text())
