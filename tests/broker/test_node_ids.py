"""Two live node processes given one node id (real broker and nodes): the broker names the clash."""

from __future__ import annotations

import time
from pathlib import Path

from prorl_cli.testing.harness import Deployment


def test_two_live_nodes_sharing_an_id_are_named_in_the_brokers_log(tmp_path: Path) -> None:
    """Each takes the id from the other at its next heartbeat, and each take requeues the other's jobs: the broker
    says so, naming both processes, instead of leaving the user with jobs that restart for no visible reason."""
    with Deployment(tmp_path / "home", "dup") as stack:
        stack.start_broker()
        first = stack.start_node("dup")
        twin = stack.spawn("dup-twin", "serve", "node", "--node-id", "dup")
        deadline = time.monotonic() + 90
        # The broker's log is the only place the clash shows; read it until the line comes (or the bound runs out).
        while "used by two live processes" not in stack.log("broker"):
            assert time.monotonic() < deadline, f"the broker never named the clash:\n{stack.log('broker')}"
            assert first.poll() is None and twin.poll() is None, "a node exited"
            time.sleep(0.2)
        line = next(ln for ln in stack.log("broker").splitlines() if "used by two live processes" in ln)
        assert f"pid {first.pid}" in line and f"pid {twin.pid}" in line and "--node-id" in line
