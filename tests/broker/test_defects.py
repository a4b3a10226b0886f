"""Broker reliability rules, each against a real broker and real nodes over ZeroMQ."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from prorl_cli import protocol as P
from tests.harness import Deployment, bare_dealer, fixed_port, next_message, one_node_deployment

REPLY_TIMEOUT_MS = 5000


class Raw:
    """A bare DEALER speaking the protocol by hand (a misbehaving or spoofing peer)."""

    def __init__(self, address: str, deployment_dir: Path) -> None:
        self.sock = bare_dealer(address, deployment_dir)

    def send(self, header: dict[str, Any], payload: list[bytes] | None = None, version: int = P.PROTOCOL_VERSION) -> None:
        frames = P.encode(header, payload or [])  # per-job items packed as the protocol packs them
        frames[0] = msgpack.packb({"v": version, **header}, use_bin_type=True)
        self.sock.send_multipart(frames)

    def reply(self, rid: Any = None) -> dict[str, Any]:
        """The next reply (skipping pushed heartbeats and assignments)."""
        return next_message(self.sock, "reply", rid, timeout_s=REPLY_TIMEOUT_MS / 1000)

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from one_node_deployment(tmp_path_factory, "defects")


@pytest.fixture
def raw(deployment: Deployment) -> Iterator[Raw]:
    r = Raw(deployment.address, deployment.deployment_dir)
    yield r
    r.close()


def _healthy(d: Deployment) -> None:
    r = d.client.process("test", {"echo": "alive"}, timeout_s=20)
    assert r.state == "done" and r.output["echo"] == "alive"
    d.client.status()  # status still answers


def test_header_errors_echo_the_rid_and_nan_is_refused(deployment: Deployment, raw: Raw) -> None:
    raw.send({"op": "submit", "rid": "r-7", "jobs": [{"job_id": "nan", "task": "test", "timeout_s": math.nan}]},
             [P.pack_obj({})])
    h = raw.reply()
    assert h["rid"] == "r-7" and h["error"]["code"] == "bad_field" and "timeout_s" in h["error"]["message"]
    raw.send({"op": "cancel", "rid": 8, "job_ids": "abc"})
    h = raw.reply()
    assert h["rid"] == 8 and h["error"]["code"] == "bad_field"
    raw.send({"op": "watch", "rid": 9})
    h = raw.reply()
    assert h["rid"] == 9 and h["error"]["code"] == "missing_field" and "job_ids" in h["error"]["message"]
    _healthy(deployment)


def test_messages_that_killed_the_broker(deployment: Deployment, raw: Raw) -> None:
    raw.send({"op": "register", "rid": 1, "node_id": "evil", "host": "h", "pid": "123", "credit": 1, "tasks": ["zzz"]})
    assert "pid" in raw.reply(1)["error"]["message"]
    raw.send({"op": "register_backend", "rid": 2, "backend_id": "b", "host": "h", "model": "m", "capacity": "9"})
    assert "capacity" in raw.reply(2)["error"]["message"]
    raw.send({"op": "register_backend", "rid": 3, "backend_id": "b", "host": "h", "model": 5})
    assert "model" in raw.reply(3)["error"]["message"]
    raw.send({"op": "register", "rid": 4, "node_id": "evil", "host": "h", "pid": 1, "credit": 1, "tasks": ["zzz"]})
    assert raw.reply(4)["ok"]
    raw.send({"op": "job_stage", "rid": 5, "updates": [{"job_id": ["x"], "attempt": 1, "stage": "run"}]})
    assert "updates[0].job_id" in raw.reply(5)["error"]["message"]
    raw.send({"op": "heartbeat", "rid": 6, "stages": {"run": "junk"}})
    assert "stages" in raw.reply(6)["error"]["message"]
    raw.send({"op": "unregister"})
    deployment.client.add_backend("http://127.0.0.1:9/v1")
    raw.send({"op": "clear_llm_server", "rid": 7, "url": 5})
    assert "url" in raw.reply(7)["error"]["message"]
    deployment.client.clear_backends()
    status = deployment.client.status()
    assert all(isinstance(n.stages, dict) for n in status.nodes)
    _healthy(deployment)


def test_garbage_instance_frames_are_refused_at_submit(deployment: Deployment, raw: Raw) -> None:
    spec = {"job_id": "garbage-inst", "task": "test"}
    raw.send({"op": "submit", "rid": 1, "jobs": [{"job_id": "ok-inst", "task": "test"}, spec]},
             [P.pack_obj({}), b"\xc1\xc1 not msgpack"])
    h = raw.reply(1)
    assert h["error"]["code"] == "bad_frame" and "jobs[1]" in h["error"]["message"]
    # Neither job was accepted.
    raw.send({"op": "watch", "rid": 2, "job_ids": ["ok-inst", "garbage-inst"]})
    assert raw.reply(2)["unknown"] == ["ok-inst", "garbage-inst"]
    _healthy(deployment)


def test_a_node_cannot_finish_or_claim_a_job_it_was_never_given(deployment: Deployment, raw: Raw) -> None:
    client = deployment.client
    client.hold()
    try:
        [job_id] = client.submit("test", [{"echo": "real"}])
        raw.send({"op": "register", "rid": 1, "node_id": "spoof", "host": "h", "pid": 1, "credit": 1, "tasks": ["zzz"],
                  "running": [{"job_id": job_id, "attempt": 1, "stage": "run"}]})
        assert raw.reply(1)["drop"] == [job_id]
        fake = P.JobResult(job_id=job_id, task="test", state="done", output={"echo": "spoofed"})
        raw.send({"op": "job_done", "jobs": [{"job_id": job_id, "attempt": 1, "state": "done"}]}, [P.pack_obj(fake.to_wire())])
        raw.send({"op": "job_stage", "updates": [{"job_id": job_id, "attempt": 1, "stage": "eval"}]})
        raw.send({"op": "ping", "rid": 2})
        raw.reply(2)  # the broker has read the spoofs
        assert client.status().jobs["queued"] >= 1
    finally:
        client.start()
    result = client.result(job_id, timeout_s=20)
    assert result.output["echo"] == "real" and result.node_id == "n1"
    raw.send({"op": "unregister"})


def test_cancel_reports_known_and_unknown_ids_and_forget_drops_results(deployment: Deployment, raw: Raw) -> None:
    client = deployment.client
    done = client.process("test", {"echo": 1}, timeout_s=20)
    client.hold()
    try:
        [queued] = client.submit("test", [{}])
        raw.send({"op": "cancel", "rid": 1, "job_ids": [queued, "never-was", done.job_id]})
        h = raw.reply(1)
    finally:
        client.start()
    assert h["ok"] and h["states"] == {queued: "cancelled", done.job_id: "done"} and h["unknown"] == ["never-was"]
    before = client.status()
    assert before.retained_results >= 2 and before.retained_bytes > 0
    raw.send({"op": "forget", "rid": 2, "job_ids": [done.job_id, queued, "never-was"]})
    h = raw.reply(2)
    assert h["forgotten"] == [done.job_id, queued] and h["running"] == [] and h["unknown"] == ["never-was"]
    after = client.status()
    assert after.retained_results == before.retained_results - 2 and after.retained_bytes < before.retained_bytes
    raw.send({"op": "watch", "rid": 3, "job_ids": [done.job_id]})
    assert raw.reply(3)["unknown"] == [done.job_id]


def test_liveness_token_heartbeats_from_another_connection(deployment: Deployment, raw: Raw) -> None:
    raw.send({"op": "register", "rid": 1, "node_id": "tok", "host": "h", "pid": 1, "credit": 1, "tasks": ["zzz"],
              "liveness_token": "secret"})
    assert raw.reply(1)["ok"]
    sidecar = Raw(deployment.address, deployment.deployment_dir)
    try:
        # Wrong tokens are ignored without a reply; the right one keeps "tok" alive while its own socket is silent.
        sidecar.send({"op": "heartbeat", "node_id": "tok", "liveness_token": "wrong"})
        dead_after_s = 0.25 * 8
        deadline = time.monotonic() + 2.5 * dead_after_s
        while time.monotonic() < deadline:
            sidecar.send({"op": "heartbeat", "node_id": "tok", "liveness_token": "secret"})
            time.sleep(0.1)
        assert not sidecar.sock.poll(100), "a sidecar heartbeat got an answer"
        status = deployment.client.status()
        assert any(n.node_id == "tok" and n.alive for n in status.nodes)
    finally:
        sidecar.close()
        raw.send({"op": "unregister"})


def test_cancel_reaches_a_job_placed_on_a_frozen_node(tmp_path: Path) -> None:
    """The job is placed (assigned) while its node is frozen; the cancel must reach the node."""
    journal = tmp_path / "stages"
    journal.mkdir()
    d = Deployment(tmp_path / "home", "frozen", config={"broker": {"heartbeat_liveness": 60}, "node": {"credit": 2}})
    try:
        d.start_broker()
        node = d.start_node("n1")
        client = d.client
        client.hold()
        [victim] = client.submit("test", [{"journal": str(journal), "sleep_s": {"init": 5.0}}])
        os.kill(node.pid, signal.SIGSTOP)
        try:
            client.start()
            d.wait_for(lambda st: st.jobs.get("assigned") == 1, 20, "the job to be assigned")
            assert client.cancel([victim]) == {victim: "cancelled"}
        finally:
            os.kill(node.pid, signal.SIGCONT)
        after = client.process("test", {"journal": str(journal)}, timeout_s=30)
        assert after.state == "done"
        d.wait_for(lambda st: all(n.inflight == 0 for n in st.nodes), 20, "the node to report the cancel")
        # The node, let go, may read the assignment before the cancel behind it has crossed its socket and
        # begin INIT; the cancel must stop it there (INIT sleeps 5 s), never let it reach RUN.
        log = journal / f"{victim}.log"
        stages = [line.split()[2] for line in log.read_text().splitlines()] if log.exists() else []
        assert stages in ([], ["init"]), stages
    finally:
        d.close()


def test_compaction_with_large_results_kills_no_node(tmp_path: Path) -> None:
    """Compaction (forced often) runs off the loop; no node is declared dead, no job re-runs."""
    d = Deployment(tmp_path / "home", "compact", config={
        # Liveness as in the other tests (2 s): on a shared CI machine a node's own loop may lag more than a
        # tighter bound; the mechanism itself is tested deterministically in test_loop.py.
        "broker": {"journal_compact_mb": 1, "journal_fsync": True},
    })
    try:
        d.start_broker()
        d.start_node("n1")
        blob = "x" * (512 * 1024)
        ids = d.client.submit("test", [{"echo": f"{i}{blob}"} for i in range(48)], timeout_s=60)
        results = d.client.wait(ids, timeout_s=120)
        assert [r.state for r in results] == ["done"] * 48
        assert {r.attempt for r in results} == {1}
        assert "compacted" in d.log("broker") and "lost" not in d.log("broker")
        assert all(n.alive for n in d.client.status().nodes)
    finally:
        d.close()


def test_after_a_restart_new_and_unplaced_jobs_do_not_wait_for_claims(tmp_path: Path) -> None:
    """Only jobs a node may still claim wait after a restart; the claim window here is 100 s."""
    d = Deployment(tmp_path / "home", "claims", config={
        "broker": {"port": fixed_port(), "heartbeat_liveness": 200},
        "node": {"n_init": 1, "n_run": 1, "n_eval": 1, "credit": 1},
    })
    try:
        d.start_broker()
        d.start_node("n1")
        client = d.client
        [running] = client.submit("test", [{"sleep_s": {"run": 3.0}, "echo": "claimed"}])
        d.wait_for(lambda st: st.jobs.get("run") == 1, 20, "the job to run")
        [waiting] = client.submit("test", [{"echo": "never placed"}])
        d.kill("broker", signal.SIGKILL)
        d.start_broker()
        results = {r.job_id: r for r in client.wait([running, waiting], timeout_s=40)}
        assert results[running].output["echo"] == "claimed" and results[running].attempt == 1
        assert results[waiting].output["echo"] == "never placed"
    finally:
        d.close()


def test_generate_headers_as_nodes_and_bridges_send_them_pass_validation(deployment: Deployment) -> None:
    """The schemas accept what the real peers send (sampling with every field, bridge replies and heartbeats)."""
    bridge, node = Raw(deployment.address, deployment.deployment_dir), Raw(deployment.address, deployment.deployment_dir)
    try:
        bridge.send({"op": "register_backend", "rid": 1, "backend_id": "fake-bridge", "host": "h", "model": "m",
                     "max_model_len": None, "capacity": 4})
        assert bridge.reply(1)["ok"]
        bridge.send({"op": "heartbeat", "backend_id": "fake-bridge", "inflight": 0})
        node.send({"op": "register", "rid": 1, "node_id": "gen-node", "host": "h", "pid": 1, "credit": 1,
                   "tasks": ["gen-only"], "running": []})
        assert node.reply(1)["ok"]
        # A job placed on this node (generate calls route only for running jobs).
        [job_id] = deployment.client.submit("gen-only", [{}])
        h = next_message(node.sock, "assign", timeout_s=REPLY_TIMEOUT_MS / 1000)
        assert h["jobs"][0]["job_id"] == job_id
        sampling = P.SamplingParams(max_tokens=4, seed=None, stop_token_ids=[2]).to_wire()
        node.send({"op": "generate", "rid": 5, "job_id": job_id, "sampling": sampling}, [P.pack_tokens([1, 2, 3])])
        assert bridge.sock.poll(REPLY_TIMEOUT_MS)
        frames = bridge.sock.recv_multipart()
        fwd = msgpack.unpackb(frames[0], raw=False)
        while fwd["op"] != "generate":
            assert bridge.sock.poll(REPLY_TIMEOUT_MS)
            frames = bridge.sock.recv_multipart()
            fwd = msgpack.unpackb(frames[0], raw=False)
        assert fwd["job_id"] == job_id and P.unpack_tokens(frames[1]) == [1, 2, 3]
        bridge.send({"op": "generate_reply", "rid": fwd["rid"], "finish_reason": "stop"},
                    [P.pack_tokens([7]), P.pack_floats([-0.5])])
        h = node.reply(5)
        assert h["ok"] and h["finish_reason"] == "stop" and h["backend_id"] == "fake-bridge"
        deployment.client.cancel([job_id])
    finally:
        bridge.send({"op": "unregister", "backend_id": "fake-bridge"})
        node.send({"op": "unregister", "node_id": "gen-node"})
        bridge.close()
        node.close()
