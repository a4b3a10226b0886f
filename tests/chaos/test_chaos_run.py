"""Short chaos runs: node kill -9 and replacement, the broker killed twice (same port, then a new one); with
the test handler, then with a real sandbox per job (bubblewrap, 40 jobs; Apptainer, 24). The long version (2,000 jobs, a
node killed every ~10 s): ``scripts/chaos/chaos_run.py [--runtime ...]``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO

IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))


def _chaos(*args: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/chaos/chaos_run.py"), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout + proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads(lines[-1])
    assert summary["broker_kills"] == 2 and summary["node_kills"] >= 1, summary
    assert summary["lost"] == 0 and summary["duplicated"] == 0 and summary["conflicting"] == 0, (summary, proc.stderr[-3000:])
    assert summary["not_done_or_wrong"] == 0 and summary["orphan_processes"] == 0, (summary, proc.stderr[-3000:])
    assert summary["left_on_disk"] == 0, (summary, proc.stderr[-3000:])  # records and session folders
    assert proc.returncode == 0, proc.stderr[-3000:]
    return summary, proc


def test_chaos_short_run_loses_and_duplicates_nothing() -> None:
    _chaos("--jobs", "240", "--node-kill-every-s", "4")


@pytest.mark.parametrize("runtime, tool, image, jobs", [
    ("bwrap", "bwrap", "python-rootfs", 40),
    pytest.param("apptainer", "apptainer", "python.sif", 24, marks=pytest.mark.apptainer),  # slower starts
])
def test_chaos_with_a_sandbox_per_job_leaves_no_process(runtime: str, tool: str, image: str, jobs: int) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (scripts/provision/)")
    if not (IMAGES / image).exists():
        pytest.skip(f"test image {IMAGES / image} missing (scripts/provision/45-test-images.sh)")
    summary, _ = _chaos("--runtime", runtime, "--jobs", str(jobs), "--node-kill-every-s", "4", "--hold-s", "0.5", "1.5")
    # Node kills landed while sandboxes ran: the count of orphans above means something.
    assert summary["sandboxes_seen"] >= jobs, summary
