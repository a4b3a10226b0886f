"""The broker's Prometheus endpoint: one scrape target with the broker's, the node's and the bridge's figures."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from prorl_cli.testing.harness import Deployment
from tests.harness import fixed_port, need_module
from tests.observe.conftest import INSTANCES, ObservedRun, scrape, total


def test_one_scrape_has_broker_node_and_bridge_figures(observed_run: ObservedRun) -> None:
    n_jobs, n_calls = len(INSTANCES), sum(i["turns"] for i in INSTANCES)
    # Node and bridge figures arrive with their heartbeats, the broker's state gauges are refreshed each
    # second: scrape until both have happened since the run ended.
    deadline = time.monotonic() + 30
    while True:
        s = scrape(observed_run.metrics_url)
        if (total(s, "prorl_node_jobs_total", node="n1", task="obs") == n_jobs and total(s, "prorl_bridge_generate_calls_total") == n_calls
                and total(s, "prorl_jobs_finished_total", task="obs") == n_jobs):
            break
        assert time.monotonic() < deadline, dict(s)
        time.sleep(0.2)
    assert total(s, "prorl_jobs_submitted_total", task="obs") == n_jobs
    assert total(s, "prorl_jobs_finished_total", task="obs") == n_jobs
    assert total(s, "prorl_jobs_finished_total", task="obs", state="done") == 4
    assert total(s, "prorl_jobs_finished_total", task="obs", state="failed") == 2
    assert total(s, "prorl_jobs_finished_total", task="obs", attempt="1") == n_jobs
    assert total(s, "prorl_job_queue_seconds_count", task="obs") == n_jobs
    # The state gauges are refreshed each second: the one before the run ended may still be served.
    deadline = time.monotonic() + 30
    while total(s, "prorl_jobs", state="failed") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
        s = scrape(observed_run.metrics_url)
    assert total(s, "prorl_jobs", state="failed") >= 2
    assert total(s, "prorl_peers", kind="node", alive="true") == 1
    assert total(s, "prorl_peers", kind="bridge", alive="true") == 1
    assert total(s, "prorl_journal_bytes") > 0
    # The node's figures, labelled with the node.
    assert total(s, "prorl_node_jobs_total", node="n1", task="obs", state="failed") == 2
    assert total(s, "prorl_stage_seconds_count", node="n1", task="obs", stage="init") == n_jobs
    assert total(s, "prorl_stage_seconds_count", node="n1", task="obs", stage="eval") == n_jobs - 1  # RUN failed once: no EVAL
    assert total(s, "prorl_generate_calls_total", node="n1", backend="sim-a", outcome="ok") == n_calls
    assert total(s, "prorl_generate_output_tokens_total", node="n1", backend="sim-a") == 8 * n_calls
    assert total(s, "prorl_generate_seconds_count", node="n1", backend="sim-a") == n_calls
    assert total(s, "prorl_tool_call_seconds_count", node="n1", tool="add") == sum(i["turns"] * i["tools"] for i in INSTANCES)
    assert total(s, "prorl_sandbox_starts_total", node="n1", runtime="local", outcome="ok") == 1
    assert total(s, "prorl_sandbox_start_seconds_count", node="n1", runtime="local") == 1
    # The bridge's figures, labelled with the backend.
    assert total(s, "prorl_bridge_generate_calls_total", backend="sim-a", outcome="ok") == n_calls
    assert total(s, "prorl_bridge_output_tokens_total", backend="sim-a") == 8 * n_calls
    assert total(s, "prorl_bridge_generate_seconds_count", backend="sim-a") == n_calls
    assert total(s, "prorl_backend_served_total", backend="sim-a") == n_calls
    # Histogram buckets are cumulative and end at the count.
    inf = [v for lb, v in s["prorl_stage_seconds_bucket"] if lb["le"] == "+Inf" and lb["stage"] == "init" and lb["task"] == "obs"]
    assert sum(inf) == n_jobs


def test_status_names_the_metrics_endpoint(observed_run: ObservedRun) -> None:
    assert observed_run.deployment.client.status().metrics_url == observed_run.metrics_url


def test_heartbeat_metrics_are_checked_field_by_field() -> None:
    import pytest

    from prorl_cli import protocol as P
    from prorl_cli.exceptions import ProtocolError

    def check(metrics: object) -> None:
        P.validate(P.decode_header(P.encode({"op": "heartbeat", "node_id": "n1", "metrics": metrics})[0]))

    check([["prorl_node_jobs", ["t", "done"], 3], ["prorl_stage_seconds", ["t", "run"], 0.5, [0, 1, 2]]])
    for bad, field in ((["x", [1], 1.0], r"metrics\[0\]\[1\]"), (["x", [], float("inf")], r"metrics\[0\]\[2\]"),
                       (["x", [], 1.0, [-1]], r"metrics\[0\]\[3\]"), (["x", []], r"metrics\[0\]'"), ("x", r"metrics\[0\]'")):
        with pytest.raises(ProtocolError, match=field):
            check([bad])


def test_a_job_requeued_from_a_lost_node_is_counted(tmp_path: Path) -> None:
    """``prorl_jobs_requeued_total`` counts the jobs a lost node's death put back in the queue (a killed node,
    its job running): documented, and the only series that shows requeues to an alert."""
    need_module("prometheus_client", "observe")
    port = fixed_port()
    with Deployment(tmp_path / "home", "requeue", config={"broker": {"metrics_port": port}}) as d:
        d.start_broker()
        node = d.start_node("n1")
        (job,) = d.client.submit("test", [{"sleep_s": {"run": 600}}])
        d.wait_for(lambda st: st.jobs.get("run") == 1, 60, "the job to run")
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
        d.wait_for(lambda st: st.jobs.get("queued") == 1, 60, "the job to be queued again")
        s = scrape(f"http://127.0.0.1:{port}/metrics")
        assert total(s, "prorl_jobs_requeued_total", task="test") == 1, dict(s)
        d.client.cancel([job])
