"""Helpers for the tests on a real Slurm (scripts/provision/50-slurm.sh starts one here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from prorl_cli.slurm.squeue import slurm_available
from prorl_cli.testing import TEST_HANDLERS

T = TypeVar("T")

# Short heartbeats so lost peers are noticed in test time; small pools for 2 cores.
ROLE_CONFIG: dict[str, Any] = {
    "broker": {"heartbeat_interval_s": 0.5, "heartbeat_liveness": 6},
    "node": {"n_init": 4, "n_run": 8, "n_eval": 4, "stop_grace_s": 3.0, "handler_paths": [TEST_HANDLERS]},
    "jobs": {"timeout_s": 120.0},
}


def require_slurm() -> None:
    if not slurm_available():
        pytest.skip("no Slurm controller here (as root, scripts/provision/50-slurm.sh installs and starts one)")


def prorl(home: Path, *args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (children inherit PYTHONPATH, so Slurm jobs run this tree too)."""
    return subprocess.run(
        [sys.executable, "-m", "prorl_cli", "--home", str(home), *args],
        capture_output=True, text=True, timeout=timeout_s, check=False, env={**os.environ, "COLUMNS": "200"},
    )


def node_memory_gb() -> float:
    """RealMemory of the fake node n1: node tasks ask for 60% so no two share a Slurm node."""
    out = subprocess.run(["scontrol", "-o", "show", "node", "n1"], capture_output=True, text=True, check=True).stdout
    real_mb = next(int(t.split("=", 1)[1]) for t in out.split() if t.startswith("RealMemory="))
    return real_mb / 1024


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def wait_until(predicate: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.5,
               explain: Callable[[], str] | None = None) -> T:
    """Poll Slurm or the broker (neither pushes events to us) until ``predicate`` is truthy.

    ``explain`` says what the cluster looked like when the wait timed out (it goes into the failure's message).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            seen = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{seen}")
        time.sleep(interval_s)


def scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True).stdout


def logs_of(folder: Path) -> str:
    """Every Slurm log under a folder, concatenated."""
    return "\n".join(p.read_text(errors="replace") for p in sorted(folder.rglob("*.out")))


def temporary_partition(name: str, *settings: str) -> Iterator[str]:
    """A fixture's body: the partition ``name`` (``scontrol create`` with ``settings``) for the test, deleted after;
    the test is skipped where this Slurm does not let the tests create one."""
    subprocess.run(["scontrol", "delete", f"PartitionName={name}"], capture_output=True, check=False)
    made = subprocess.run(["scontrol", "create", f"PartitionName={name}", *settings],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot create a partition here (scontrol create: {made.stderr.strip()}); it needs Slurm's admin")
    try:
        yield name
    finally:
        subprocess.run(["scontrol", "delete", f"PartitionName={name}"], capture_output=True, check=False)
