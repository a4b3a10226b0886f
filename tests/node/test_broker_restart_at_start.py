"""A node started while its broker is down (a stale rendezvous file) and the broker restarted on a new address:
real broker and node processes. The self-healing case where both are replaced at once."""

from __future__ import annotations

import time
from pathlib import Path

from prorl_cli.testing.harness import Deployment


def test_a_node_whose_first_register_went_to_a_dead_broker_serves_the_new_one(tmp_path: Path) -> None:
    """Its first register went to the old address; the broker's restart elsewhere superseded it. The node used
    to exit there ("the broker at ... is gone"), after its register with the new broker had gone out."""
    with Deployment(tmp_path / "home", "restart") as stack:
        stack.start_broker()
        old_address = stack.address
        stack.kill("broker")  # its rendezvous file stays, naming an address nobody answers
        node = stack.start_node("n1", wait=False)
        deadline = time.monotonic() + 60
        # Restart the broker only once the node has given up on the old address once (it is waiting on it).
        while "registering again" not in stack.log("n1"):
            assert node.poll() is None, stack.log("n1")
            assert time.monotonic() < deadline, stack.log("n1")
            time.sleep(0.1)
        stack.start_broker()
        assert stack.address != old_address
        stack.wait_for(lambda st: any(n.node_id == "n1" and n.alive for n in st.nodes), 60, "n1 to register", "n1")
        assert stack.client.process("test", {"echo": 1}, timeout_s=60).state == "done"
        assert node.poll() is None, stack.log("n1")
