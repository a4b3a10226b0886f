"""A bridge that goes, comes back, or reloads weights mid-run: what the router still binds to it, against a real broker.

The bridges and the node are bare DEALERs speaking the protocol by hand, so
the test decides exactly when each one registers, loses its connection or
answers a weight load.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prorl_cli import protocol as P
from tests.harness import Deployment, bare_dealer, next_message

#: How long a peer waits for a message the broker must send (a failure bound, not a timing assertion).
MESSAGE_TIMEOUT_S = 5.0

#: Liveness long enough that a bare peer which never heartbeats stays alive for the whole test, and first
#: calls that wait for KV room wait longer than any test runs (so a call that is admitted was admitted for room).
CHURN_CONFIG: dict[str, Any] = {"broker": {"heartbeat_liveness": 400, "kv_admission": 1.0, "kv_admission_max_wait_s": 600.0}}


class Peer:
    """A bare DEALER: a bridge, a node or a trainer, as the test plays it."""

    def __init__(self, d: Deployment) -> None:
        self.sock = bare_dealer(d.address, d.deployment_dir)

    def send(self, header: dict[str, Any], payload: list[bytes] | None = None) -> None:
        self.sock.send_multipart(P.encode(header, payload or []))

    def next(self, op: str, rid: Any = None) -> dict[str, Any]:
        """The next message of ``op`` (and ``rid``) sent to this peer; heartbeats and other ops are skipped."""
        return next_message(self.sock, op, rid, timeout_s=MESSAGE_TIMEOUT_S)

    def close(self) -> None:
        self.sock.close(0)


class Churn:
    """A broker with admission on, one bare node serving ``gen-only`` and the bare bridges a test opens."""

    def __init__(self, home: Path) -> None:
        self.d = Deployment(home, "churn", config=CHURN_CONFIG)
        self.d.start_broker()
        self.peers: list[Peer] = []
        self.node = self.peer()
        self.node.send({"op": "register", "rid": 1, "node_id": "churn-node", "host": "h", "pid": 1, "credit": 8,
                        "tasks": ["gen-only"], "running": []})
        assert self.node.next("reply", 1)["ok"]
        self._rid = 100

    def peer(self) -> Peer:
        p = Peer(self.d)
        self.peers.append(p)
        return p

    def bridge(self, backend_id: str, kv_capacity_tokens: int | None = None, peer: Peer | None = None) -> Peer:
        """A bridge registered as ``backend_id`` (on ``peer``'s connection, else a new one), reporting its KV size."""
        bridge = peer or self.peer()
        self._rid += 1
        bridge.send({"op": "register_backend", "rid": self._rid, "backend_id": backend_id, "host": "h", "model": "m",
                     "capacity": 8})
        assert bridge.next("reply", self._rid)["ok"]
        if kv_capacity_tokens is not None:
            bridge.send({"op": "heartbeat", "backend_id": backend_id, "stats": {"kv_capacity_tokens": kv_capacity_tokens}})
            self.d.wait_for(lambda st: any(b.backend_id == backend_id and b.alive
                                           and b.stats.get("kv_capacity_tokens") == kv_capacity_tokens
                                           for b in st.backends), 20, f"{backend_id}'s KV capacity")
        return bridge

    def jobs(self, n: int) -> list[str]:
        """``n`` jobs placed on the node."""
        ids = self.d.client.submit("gen-only", [{}] * n)
        placed: set[str] = set()
        while placed != set(ids):
            placed.update(j["job_id"] for j in self.node.next("assign")["jobs"])
        return ids

    def generate(self, job_id: str, prompt_tokens: int, max_tokens: int) -> int:
        self._rid += 1
        self.node.send({"op": "generate", "rid": self._rid, "job_id": job_id,
                        "sampling": P.SamplingParams.from_given(max_tokens=max_tokens).to_wire()},
                       [P.pack_tokens(list(range(prompt_tokens)))])
        return self._rid

    def serve(self, bridge: Peer, job_id: str, rid: int) -> dict[str, Any]:
        """``bridge`` gets the call ``rid`` of ``job_id`` and answers it; the node's reply to it."""
        fwd = bridge.next("generate")
        assert fwd["job_id"] == job_id
        bridge.send({"op": "generate_reply", "rid": fwd["rid"], "finish_reason": "stop"},
                    [P.pack_tokens([7]), P.pack_floats([-0.5])])
        return self.node.next("reply", rid)

    def close(self) -> None:
        for p in self.peers:
            p.close()
        self.d.close()


@pytest.fixture
def churn(tmp_path: Path) -> Iterator[Churn]:
    c = Churn(tmp_path / "home")
    yield c
    c.close()


@pytest.mark.parametrize("how", ["left", "replaced"])
def test_a_bridge_back_under_its_name_is_not_full_of_the_kv_its_lost_jobs_reserved(churn: Churn, how: str) -> None:
    """A requeued bridge comes back under the same backend id on a new connection: its old jobs are not on it.

    The KV the jobs routed to the bridge that went had reserved must go with it; kept, it counts against the
    bridge that comes back under that name, and a new job's first call waits for room that is free.
    """
    old = churn.bridge("kv-bridge")
    placed, new = churn.jobs(2)
    assert churn.serve(old, placed, churn.generate(placed, 50, 40))["ok"]  # 90 of the 100 tokens reserved
    if how == "left":
        old.send({"op": "unregister", "backend_id": "kv-bridge"})
        churn.d.wait_for(lambda st: not st.backends and [g.backend_id for g in st.gone_backends] == ["kv-bridge"],
                         20, "the bridge to be gone")
    back = churn.bridge("kv-bridge", kv_capacity_tokens=100)  # "replaced": it registers while the old one is live
    # The new job's first call needs 90: the bridge back under that name serves no job, so it has room.
    assert churn.serve(back, new, churn.generate(new, 50, 40))["ok"]
    # The job whose bridge went is placed again like a new one: its call waits for room (90 + 90 > 100) until
    # the other job ends and frees its share.
    waiting = churn.generate(placed, 50, 40)
    assert churn.d.client.cancel([new]) == {new: "cancelled"}
    assert churn.serve(back, placed, waiting)["ok"]


def test_no_call_goes_to_a_bridge_that_reregistered_while_loading_weights(churn: Churn) -> None:
    """A bridge re-registers on its connection during a weight update (it thought the broker dead).

    It registers on the weights it had, so the broker sends it the update's weights and marks it loading:
    calls of the jobs it served must not go to it until it has loaded them.
    """
    bridge = churn.bridge("w-bridge")
    [job] = churn.jobs(1)
    assert churn.serve(bridge, job, churn.generate(job, 5, 5))["ok"]  # the job is now bound to the bridge
    trainer = churn.peer()
    trainer.send({"op": "update_weights", "rid": 1, "checkpoint": "/ckpt/v1", "policy_version": 1})
    update = bridge.next("update_weights")
    churn.bridge("w-bridge", peer=bridge)  # the same connection, still on its start weights
    catch_up = bridge.next("update_weights")
    assert catch_up["checkpoint"] == "/ckpt/v1" and catch_up["rid"] != update["rid"]
    assert [(b.backend_id, b.loading) for b in churn.d.client.status().backends] == [("w-bridge", True)]
    rid = churn.generate(job, 5, 5)
    held = churn.node.next("generate_held", rid)  # no bridge serves: the call waits at the broker
    assert held["job_id"] == job and held["held"]
    for fwd in (update, catch_up):
        bridge.send({"op": "weights_updated", "rid": fwd["rid"]})
    assert trainer.next("reply", 1)["ok"]
    # Loaded: the held call goes to it now, and is served on the new weights.
    reply = churn.serve(bridge, job, rid)
    assert reply["ok"] and reply["policy_version"] == 1
