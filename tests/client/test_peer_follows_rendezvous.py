"""A peer following the rendezvous file (a real broker and node): a bad file must not stop its heartbeat."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

from prorl_cli.rendezvous import read_rendezvous, rendezvous_path, write_rendezvous
from tests.client.test_client import wait_until
from tests.harness import Deployment, fixed_port


def test_a_bad_rendezvous_file_is_logged_and_the_peer_keeps_the_old_address(tmp_path: Path) -> None:
    """While the broker is away the node reads a file naming an address ZeroMQ refuses, a garbled one, one whose address is no string: it logs
    each (the file and what is wrong), keeps heartbeating, and re-registers when the broker is back at its address."""
    d = Deployment(tmp_path / "home", "hb", config={"broker": {"port": fixed_port()}})
    try:
        d.start_broker()
        d.start_node("n1")  # no address: it follows the rendezvous file
        info = read_rendezvous(d.deployment_dir)
        path = rendezvous_path(d.deployment_dir)
        d.kill("broker", signal.SIGKILL)
        d.drop_client()
        write_rendezvous(d.deployment_dir, dataclasses.replace(info, address="tcp://no-port-here"))
        wait_until(lambda: f"{path} names the broker address 'tcp://no-port-here'" in d.log("n1"), 30,
                   "the node to log the address it cannot connect to")
        path.write_text('{"address": ')
        wait_until(lambda: f"{path}: unreadable rendezvous file" in d.log("n1"), 30,
                   "the node to log the garbled file")
        path.write_text(json.dumps({**dataclasses.asdict(info), "address": 42}))
        wait_until(lambda: f"{path}: malformed rendezvous file: address 42 is not" in d.log("n1"), 30,
                   "the node to log the address that is no string")
        assert f"staying with {info.address}" in d.log("n1")
        d.start_broker()  # the same port: the address the node kept
        d.wait_for(lambda st: any(n.node_id == "n1" and n.alive for n in st.nodes), 30, "the node to re-register", "n1")
        assert f"re-registered with the broker at {info.address}" in d.log("n1")
    finally:
        d.close()
