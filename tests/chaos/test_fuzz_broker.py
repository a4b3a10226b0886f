"""Property-based fuzz of the broker: malformed messages from registered and unregistered peers, an honest
client alongside. The broker stays up, every honest job completes exactly once, its memory stays flat.
The long version: ``scripts/chaos/fuzz_broker.py``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgpack
import psutil
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prorl_cli import protocol as P
from prorl_cli.testing.fuzzing import HonestClient, Peer, malformed
from tests.harness import Deployment, bare_dealer, next_message

EXAMPLES = 400


def test_fuzzed_broker_stays_up_and_honest_jobs_finish_once(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "fuzz", config={"broker": {"journal": True}})
    try:
        broker = d.start_broker()
        d.start_node("n1")
        honest = HonestClient(d.address, d.deployment_dir, "honest")
        honest.submit(40, {"sleep_s": {"run": 0.05}, "echo": "honest"})
        peers = [Peer(d.address, d.deployment_dir), Peer(d.address, d.deployment_dir, register_as="fz-a"), Peer(d.address, d.deployment_dir, register_as="fz-b")]
        rss_before = psutil.Process(broker.pid).memory_info().rss

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.randoms(use_true_random=False), st.integers(0, len(peers) - 1))
        def attack(rng: random.Random, who: int) -> None:
            frames = malformed(rng, honest.ids)
            if frames:
                peers[who].send(frames)
            else:
                peers[who].send([b""])
            peers[who].drain()
            honest.pump()

        attack()
        honest.submit(20, {"echo": "after"})
        honest.wait_all(120)
        assert broker.poll() is None, d.log("broker")
        assert sorted(honest.results) == sorted(honest.ids)
        assert all(states == ["done"] for states in honest.results.values()), {
            j: s for j, s in honest.results.items() if s != ["done"]}
        rss_after = psutil.Process(broker.pid).memory_info().rss
        assert rss_after - rss_before < 64 * 1024 * 1024, (rss_before, rss_after)
        assert "Traceback" not in d.log("broker")
        for p in peers:
            p.close()
        honest.close()
    finally:
        d.close()


def _ask(sock: Any, header: dict[str, Any]) -> dict[str, Any]:
    sock.send_multipart([msgpack.packb(header, use_bin_type=True)])
    return next_message(sock)


def test_error_replies_echo_every_usable_rid_and_edge_rids_are_answered(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "rids", config={"broker": {"heartbeat_interval_s": 0.05, "heartbeat_liveness": 1000}})
    try:
        d.start_broker()
        sock = bare_dealer(d.address, d.deployment_dir)
        v = P.PROTOCOL_VERSION
        cases = {
            "unknown op": ({"v": v, "op": "frobnicate", "rid": 7}, "unknown_op"),
            "wrong version": ({"v": 99, "op": "ping", "rid": 8}, "bad_version"),
            "no version": ({"op": "ping", "rid": "nine"}, "bad_version"),
            "no op": ({"v": v, "rid": 10}, "missing_field"),
            "op not a string": ({"v": v, "op": 5, "rid": 11}, "missing_field"),
            "bad field": ({"v": v, "op": "cancel", "rid": 12, "job_ids": "x"}, "bad_field"),
        }
        for what, (header, code) in cases.items():
            reply = _ask(sock, header)
            assert (reply["ok"], reply["error"]["code"], reply["rid"]) == (False, code, header["rid"]), (what, reply)
        # A rid that is not usable is not echoed (a 300-character string): the reply still comes, rid null.
        reply = _ask(sock, {"v": v, "op": "ping", "rid": "r" * 300})
        assert (reply["ok"], reply["rid"]) == (False, None)
        # Any msgpack integer is a rid, echoed as sent (docs/protocol.md).
        for rid in ((1 << 64) - 1, -(1 << 63), 0):
            reply = _ask(sock, {"v": v, "op": "ping", "rid": rid})
            assert (reply["ok"], reply["rid"]) == (True, rid), reply
        # A node that leaves shows as lost, with why, in the very next status (no stale stage counts).
        registered = _ask(sock, {"v": v, "op": "register", "rid": 1, "node_id": "gone", "host": "h", "pid": 1,
                                 "credit": 1, "tasks": ["t"]})
        assert registered["ok"], registered
        sock.send_multipart(P.encode({"op": "unregister", "node_id": "gone"}))
        status = _ask(sock, {"v": v, "op": "status", "rid": 3})
        (node,) = [n for n in status["status"]["nodes"] if n["node_id"] == "gone"]
        assert (node["alive"], node["lost_reason"], node["stages"]) == (False, "left", {}), node
        sock.close(0)
    finally:
        d.close()
