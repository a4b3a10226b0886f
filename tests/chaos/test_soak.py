"""Short soak: a few thousand jobs through injected stage failures, timeouts and cancels (queued and
running) with the broker's journal on. The long version (30 minutes): ``scripts/chaos/soak.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO


def test_soak_short_run_every_result_well_formed_and_no_fd_growth(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/chaos/soak.py"), "--duration-s", "20", "--rate", "100",
         "--sample-s", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout + proc.stderr[-3000:]
    s = json.loads(lines[-1])
    assert s["malformed"] == 0 and s["refused"] == 0, s
    assert s["results"] == s["jobs"] >= 1000, s
    assert all(s["alive"].values()), s
    # Every kind of trouble was injected and came back as it must.
    assert all(n > 0 for n in s["kinds"].values()), s["kinds"]
    assert s["states"]["failed"] == s["kinds"]["raise"], s["states"]
    assert s["states"]["timed_out"] == s["kinds"]["stage_timeout"] + s["kinds"]["job_timeout"], s["states"]
    assert s["cancel_outcomes"].get("cancel_queued:cancelled:queued", 0) > 0, s["cancel_outcomes"]
    assert s["cancel_outcomes"].get("cancel_running:cancelled:on_node", 0) > 0, s["cancel_outcomes"]
    # No descriptor leak: thousands of jobs, sockets and cancels leave the open-file count where it was.
    for name in ("broker", "n0", "n1"):
        fds = s[f"{name}_fds"]
        assert fds["end"] <= fds["warm"] + 4, (name, fds)
    assert (tmp_path / "soak.csv").read_text().count("\n") == s["samples"] + 1
    assert proc.returncode == 0, proc.stderr[-3000:]
