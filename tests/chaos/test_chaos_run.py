"""Short chaos run: node kill -9 and replacement, the broker killed twice (same port, then a new one).
The long version (2,000 jobs, a node killed every ~10 s): ``scripts/chaos/chaos_run.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.harness import REPO


def test_chaos_short_run_loses_and_duplicates_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/chaos/chaos_run.py"), "--jobs", "240", "--node-kill-every-s", "4"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout + proc.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert summary["broker_kills"] == 2, summary
    assert summary["lost"] == 0 and summary["duplicated"] == 0 and summary["conflicting"] == 0, (summary, proc.stderr[-3000:])
    assert summary["not_done_or_wrong"] == 0 and summary["orphan_processes"] == 0, (summary, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
