"""Short load run: 1,024 jobs in flight from simulated nodes and bridges; the long one is ``scripts/chaos/load_broker.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.harness import REPO


def test_load_short_run_no_false_deaths_retention_holds_and_no_routing_leak() -> None:
    retention_mb = 32
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/chaos/load_broker.py"), "--jobs", "1024", "--nodes", "16",
         "--bridges", "4", "--generates-per-job", "2", "--cancel-fraction", "0.1",
         "--duration-s", "15", "--hold-s", "2", "6", "--result-kb", "64", "--retention-mb", str(retention_mb),
         "--sample-s", "3", "--seed", "12"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout + proc.stderr
    summary, samples = lines[-1], lines[:-1]
    assert summary["broker_alive"] and summary["missing"] == 0 and summary["duplicated"] == 0, summary
    assert summary["false_node_deaths"] == 0 and summary["false_bridge_deaths"] == 0, summary
    assert summary["results"] > 1024
    assert all(s["retained_mb"] <= retention_mb for s in samples), samples
    # Memory follows retention, not the number of jobs run: far below what keeping every result would take.
    kept_all_mb = summary["results"] * summary["result_kb"] / 1024
    assert summary["rss_max_mb"] - summary["rss_start_mb"] < max(4 * retention_mb + 64, kept_all_mb / 2), (summary, samples)
    # The generate path ran, cancels landed, and every call got an answer.
    assert summary["generates_ok"] > 1024 and summary["cancelled"] > 0, summary
    assert summary["generates_unanswered"] == 0 and summary["generate_errors_uncancelled"] == 0, summary
    # Calls that reached the broker after their job's cancel (there were some: nodes carry on
    # until they see the cancel) were refused, never routed ...
    assert summary["generates_after_cancel"] > 0 and summary["generates_after_cancel_routed"] == 0, summary
    # ... and after the drain no routing state is left: no live job on a backend, no call in flight or held.
    assert summary["routing_state_read"], summary
    assert summary["backend_jobs_after_drain"] == 0 and summary["backend_inflight_after_drain"] == 0, summary
    assert summary["held_generates_after_drain"] == 0 and summary["node_inflight_after_drain"] == 0, summary
    assert proc.returncode == 0, proc.stderr[-2000:]
