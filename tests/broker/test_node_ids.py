"""Two live node processes given one node id (real broker and nodes): one keeps the id, the other is told to go."""

from __future__ import annotations

import subprocess
from pathlib import Path

from prorl_cli.testing.harness import Deployment


def test_of_two_live_nodes_sharing_an_id_the_holder_keeps_it_and_the_other_is_sent_away(tmp_path: Path) -> None:
    """Left alone, each would take the id from the other at every heartbeat, each take requeueing the other's
    jobs until their attempts ran out. The broker names the clash and shuts the displaced process down."""
    with Deployment(tmp_path / "home", "dup") as stack:
        stack.start_broker()
        first = stack.start_node("dup")
        twin = stack.spawn("dup-twin", "serve", "node", "--node-id", "dup")
        try:
            first.wait(timeout=90)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the displaced node still runs:\n{stack.log('broker')}") from None
        line = next((ln for ln in stack.log("broker").splitlines() if "used by two live processes" in ln), None)
        assert line is not None, stack.log("broker")
        assert f"pid {first.pid}" in line and f"pid {twin.pid}" in line and "--node-id" in line
        assert "used by two live processes" in stack.log("dup"), "the node sent away says why"
        # The twin holds the id, and jobs run on it to the end (no more takes).
        assert twin.poll() is None
        assert stack.client.process("test", {"echo": 1}, timeout_s=60).state == "done"
        assert len([n for n in stack.client.status().nodes if n.node_id == "dup" and n.alive]) == 1
        assert twin.poll() is None and "used by two live processes" not in stack.log("dup-twin")
