"""A node started while its broker is down (a stale rendezvous file) and the broker restarted on a new address:
real broker and node processes. The self-healing case where both are replaced at once."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from prorl_cli.testing.harness import Deployment


def _wait_for_line(stack: Deployment, node: subprocess.Popen[bytes], text: str) -> None:
    """Until the node's log says ``text`` (polled, as ``wait_for`` polls status); it must not exit meanwhile."""
    deadline = time.monotonic() + 60
    while text not in stack.log("n1"):
        assert node.poll() is None, stack.log("n1")
        assert time.monotonic() < deadline, stack.log("n1")
        time.sleep(0.1)


def test_a_node_whose_first_register_went_to_a_dead_broker_serves_the_new_one(tmp_path: Path) -> None:
    """Its first register went to the old address; the broker's restart elsewhere superseded it. The node used
    to exit there ("the broker at ... is gone"), after its register with the new broker had gone out."""
    with Deployment(tmp_path / "home", "restart") as stack:
        stack.start_broker()
        old_address = stack.address
        stack.kill("broker")  # its rendezvous file stays, naming an address nobody answers
        node = stack.start_node("n1", wait=False)
        # Restart the broker only once the node has given up on the old address once (it is waiting on it).
        _wait_for_line(stack, node, "registering again")
        stack.start_broker()
        assert stack.address != old_address
        stack.wait_for(lambda st: any(n.node_id == "n1" and n.alive for n in st.nodes), 60, "n1 to register", "n1")
        assert stack.client.process("test", {"echo": 1}, timeout_s=60).state == "done"
        assert node.poll() is None, stack.log("n1")


def test_a_node_told_to_wait_waits_past_a_file_left_by_a_killed_broker(tmp_path: Path) -> None:
    """``--wait-s``: a rendezvous file naming a broker of this host whose process is gone is no broker; the node
    waits for the one that replaces it, and past its wait says what the file names."""
    with Deployment(tmp_path / "home", "wait") as stack:
        stack.start_broker()
        stack.kill("broker")
        short = stack.spawn("short", "serve", "node", "--node-id", "short", "--wait-s", "1")
        assert short.wait(timeout=60) != 0
        assert "whose process is gone" in stack.log("short") and "prorl serve broker -d wait" in stack.log("short")
        node = stack.start_node("n1", "--wait-s", "120", wait=False)
        stack.start_broker()
        stack.wait_for(lambda st: any(n.node_id == "n1" and n.alive for n in st.nodes), 60, "n1 to register", "n1")
        assert "registering again" not in stack.log("n1"), "it never spoke to the dead broker's address"
        assert node.poll() is None


def test_a_node_waiting_for_its_register_to_a_moved_broker_still_stops_on_sigterm(tmp_path: Path) -> None:
    """The rendezvous file moved to an address nobody answers while the node's first register was out: the node
    waits for the register there, and a SIGTERM (scancel, Ctrl-C) still stops it, as it does a registered node."""
    import dataclasses
    import signal
    import socket

    from prorl_cli.rendezvous import read_rendezvous, write_rendezvous

    with Deployment(tmp_path / "home", "moved") as stack:
        stack.start_broker()
        stack.kill("broker")
        node = stack.start_node("n1", wait=False)
        _wait_for_line(stack, node, "registering again")
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            nowhere = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        info = read_rendezvous(stack.deployment_dir)
        write_rendezvous(stack.deployment_dir, dataclasses.replace(info, address=nowhere))
        _wait_for_line(stack, node, "registering with the new one")
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=60) is not None, stack.log("n1")
        assert "Traceback" not in stack.log("n1"), stack.log("n1")
