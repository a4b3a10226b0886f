"""Every op, every field at its bounds and just past them, against a live broker, node and bridge.

The messages come from the schema's own grammar (``prorl_cli/testing/grammar.py``), so
a field the schema lets through is tried at exactly the values a receiver might
mishandle (``http://`` passes a prefix check and names no host). Each server
answers every request that fails its checks with an error naming the field, and
keeps serving: an honest job (or generate call) afterwards succeeds, the process
is alive and its log holds no traceback. Then a hypothesis run mixes several bad
fields per message.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prorl_cli import protocol as P
from prorl_cli.exceptions import ProtocolError
from prorl_cli.protocol.headers import OP_SCHEMAS
from prorl_cli.testing import grammar
from prorl_cli.testing.samples import TO_BRIDGE, TO_NODE
from tests.harness import Deployment, bare_dealer, one_node_deployment

REPLY_TIMEOUT_MS = 10_000
#: Ops that never reach the broker as requests it acts on here: a valid one would end or pause the run.
NOT_VALID_AT_BROKER = {P.Op.STOP, P.Op.HOLD, P.Op.SHUTDOWN}
#: Ops whose peers speak as a node or as a bridge: sent from a registered peer of that kind and from a stranger.
NODE_OPS = {P.Op.REGISTER, P.Op.HEARTBEAT, P.Op.UNREGISTER, P.Op.JOB_STAGE, P.Op.JOB_DONE, P.Op.RELEASE,
            P.Op.GENERATE, P.Op.GENERATE_CANCEL}
BRIDGE_OPS = {P.Op.REGISTER_BACKEND, P.Op.GENERATE_REPLY, P.Op.GENERATE_DONE, P.Op.WEIGHTS_UPDATED}


def _valid(op: P.Op, header: dict[str, Any], payload: list[bytes]) -> bool:
    """Whether the receiver's own checks accept the message (decoded as it would decode it)."""
    frames = _pack(header, payload)
    if frames is None:
        return False
    try:
        header = P.decode_header(frames[0])
        P.parse(header, len(P.job_items(header["op"], frames[1:])))
    except ProtocolError:
        return False
    return True


def _usable_rid(header: dict[str, Any]) -> bool:
    rid = header.get("rid")
    return (isinstance(rid, str) and len(rid) <= P.MAX_ID_CHARS) or (isinstance(rid, int) and not isinstance(rid, bool))


def _pack(header: dict[str, Any], payload: list[bytes]) -> list[bytes] | None:
    """The frames of ``header`` (as given: no version added) and ``payload``, packed as the protocol packs
    per-job items when the header names such an op."""
    try:
        op = header.get("op")
        if isinstance(op, str) and op in P.JOB_ITEM_OPS:
            payload = [msgpack.packb(payload, use_bin_type=True)]
        return [msgpack.packb(header, use_bin_type=True), *payload]
    except (OverflowError, ValueError, TypeError):
        return None  # not a message msgpack can carry: nothing any peer could send


def _replies(sock: zmq.Socket, timeout_ms: int) -> list[dict[str, Any]]:
    out = []
    while sock.poll(timeout_ms):
        out.append(msgpack.unpackb(sock.recv_multipart()[0], raw=False, strict_map_key=False))
        timeout_ms = 0
    return out


def _expect_error(sock: zmq.Socket, what: str, rid: Any) -> None:
    """The broker's error reply to the request ``rid`` (other messages for this peer are read past)."""
    while True:
        assert sock.poll(REPLY_TIMEOUT_MS), f"no reply to {what}"
        reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False, strict_map_key=False)
        if reply.get("op") == P.Op.REPLY.value and reply.get("rid") == rid:
            assert reply["ok"] is False and reply["error"]["code"], (what, reply)
            return


def _ping(sock: zmq.Socket, what: str) -> None:
    sock.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "ping", "rid": "alive?"}))
    while True:
        assert sock.poll(REPLY_TIMEOUT_MS), f"the broker stopped answering after {what}"
        reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False, strict_map_key=False)
        if reply.get("rid") == "alive?":
            assert reply["ok"], reply
            return


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    yield from one_node_deployment(tmp_path_factory, "grammar", {"broker": {"journal": True}})


def test_every_field_of_every_op_at_its_edges_is_answered_and_the_broker_serves_on(deployment: Deployment) -> None:
    d = deployment
    client = bare_dealer(d.address, d.deployment_dir)
    stranger = bare_dealer(d.address, d.deployment_dir)
    node = bare_dealer(d.address, d.deployment_dir)
    bridge = bare_dealer(d.address, d.deployment_dir)
    for sock, op in ((node, P.Op.REGISTER), (bridge, P.Op.REGISTER_BACKEND)):
        header, _ = grammar.SAMPLES[op]
        sock.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": op.value, **header, "rid": "reg"}))
        (reply,) = _replies(sock, REPLY_TIMEOUT_MS)
        assert reply["ok"], reply
    sent = refused = 0
    for op in OP_SCHEMAS:
        base_rid = grammar.SAMPLES[op][0].get("rid")
        for n, (what, header, payload) in enumerate(grammar.variants(op)):
            if base_rid is not None and header.get("rid") == base_rid:
                header = {**header, "rid": f"{op.value}-{n}"}  # its own: a late reply to another is not its answer
            valid = _valid(op, header, payload)
            if valid and op in NOT_VALID_AT_BROKER:
                continue
            frames = _pack(header, payload)
            if frames is None:
                continue
            peer = client
            if op in NODE_OPS:
                peer = node if n % 2 else stranger
            elif op in BRIDGE_OPS:
                peer = bridge if n % 2 else stranger
            peer.send_multipart(frames)
            sent += 1
            if not valid and "rid" in OP_SCHEMAS[op].fields and _usable_rid(header):
                _expect_error(peer, what, header["rid"])
                refused += 1
            else:
                _replies(peer, 0)
        _ping(client, f"the {op.value} variants")
        for sock in (stranger, node, bridge):
            _replies(sock, 0)
    assert sent > 3000 and refused > 1000, (sent, refused)
    honest = d.new_client()
    try:
        result = honest.process("test", {"echo": "after the grammar"}, timeout_s=60)
    finally:
        honest.close()
    assert result.state == "done" and result.output["echo"] == "after the grammar", result
    assert d.procs["broker"].poll() is None
    assert "Traceback" not in d.log("broker"), d.log("broker")
    for sock in (client, stranger, node, bridge):
        sock.close(0)


def test_several_bad_fields_at_once_never_stop_the_broker(deployment: Deployment) -> None:
    d = deployment
    peer = bare_dealer(d.address, d.deployment_dir)
    ops = [op for op in OP_SCHEMAS if op not in NOT_VALID_AT_BROKER]

    @settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(ops).flatmap(lambda op: st.tuples(st.just(op), grammar.headers(op))))
    def attack(case: tuple[P.Op, dict[str, Any]]) -> None:
        op, header = case
        frames = _pack(header, grammar.SAMPLES[op][1])
        if frames is not None and not (op in NOT_VALID_AT_BROKER and _valid(op, header, frames[1:])):
            peer.send_multipart(frames)
        _replies(peer, 0)

    attack()
    _ping(peer, "the mixed messages")
    peer.close(0)
    assert d.procs["broker"].poll() is None and "Traceback" not in d.log("broker")


class FakeBroker:
    """A ROUTER on loopback that plays the broker's side for one peer: the peer's input is the test's to choose."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peer: bytes | None = None
        self.seen: list[tuple[dict[str, Any], list[bytes]]] = []

    def pump(self, timeout_ms: int) -> None:
        """Read what came (answering registrations as a broker does)."""
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            identity, first, *rest = self.sock.recv_multipart()
            header = msgpack.unpackb(first, raw=False, strict_map_key=False)
            self.peer = identity
            if header.get("op") in (P.Op.REGISTER.value, P.Op.REGISTER_BACKEND.value):
                self.send(P.reply(header.get("rid"), heartbeat_interval_s=1.0, heartbeat_liveness=10_000, drop=[],
                                  boot_id="fake"), [])
            self.seen.append((header, rest))

    def send(self, header: dict[str, Any], payload: list[bytes]) -> bool:
        frames = _pack(header, payload)
        if frames is None or self.peer is None:
            return False
        self.sock.send_multipart([self.peer, *frames])
        return True

    def wait_for(self, what: str, match: Any, timeout_ms: int = 60_000) -> dict[str, Any]:
        """The first message from the peer (from now on) that ``match`` accepts."""
        start = len(self.seen)
        while True:
            for header, _ in self.seen[start:]:
                if match(header):
                    return header
            start = len(self.seen)
            assert self.sock.poll(timeout_ms), f"the peer never sent {what}"
            self.pump(0)

    def close(self) -> None:
        self.sock.close(0)


def _serve(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    d = Deployment(tmp_path / "home", "peer", config={"inference": {"sim_speedup": 1000.0}})
    log = open(tmp_path / "peer.log", "wb")  # noqa: SIM115 (the child writes it until it is stopped)
    return subprocess.Popen([sys.executable, "-m", "prorl_cli", "-d", "peer", *args], env=d.env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    from prorl_cli.processes import stop_groups

    stop_groups([proc], 10.0)


def test_a_node_takes_every_edge_of_the_brokers_ops_and_still_runs_a_job(tmp_path: Path) -> None:
    fake = FakeBroker()
    proc = _serve(tmp_path, "serve", "node", "--node-id", "fz", "--address", fake.address)
    try:
        fake.wait_for("its registration", lambda h: h.get("op") == "register")
        for op, sample in TO_NODE.items():
            for _, header, payload in grammar.variants(op, sample):
                fake.send(header, payload)
                fake.pump(0)
        fake.send({"v": P.PROTOCOL_VERSION, "op": "assign", "jobs": [P.JobSpec(job_id="honest", task="test").to_wire()]},
                  [P.pack_obj({"echo": "honest"})])
        done = fake.wait_for("the honest job's result", lambda h: h.get("op") == "job_done"
                             and any(j.get("job_id") == "honest" for j in h.get("jobs", [])))
        assert [j["state"] for j in done["jobs"] if j["job_id"] == "honest"] == ["done"], done
        assert proc.poll() is None, (tmp_path / "peer.log").read_text()[-3000:]
    finally:
        _stop(proc)
        fake.close()
    assert "Traceback" not in (tmp_path / "peer.log").read_text()


def test_a_bridge_answers_every_edge_of_generate_and_update_weights_and_still_generates(tmp_path: Path) -> None:
    fake = FakeBroker()
    proc = _serve(tmp_path, "serve", "inference", "--engine", "sim", "--backend-id", "fzb", "--address", fake.address)
    try:
        fake.wait_for("its registration", lambda h: h.get("op") == "register_backend")
        answered = 0
        for n, (op, sample) in enumerate(TO_BRIDGE.items()):
            for m, (what, header, payload) in enumerate(grammar.variants(op, sample)):
                rid = f"fz-{n}-{m}"
                if "rid" in header and _usable_rid(header):
                    header = {**header, "rid": rid}
                if not fake.send(header, payload):
                    continue
                if op in (P.Op.GENERATE, P.Op.UPDATE_WEIGHTS) and header.get("rid") == rid:
                    reply_op = "generate_reply" if op is P.Op.GENERATE else "weights_updated"
                    fake.wait_for(f"an answer to {what}", lambda h, r=rid, o=reply_op: h.get("op") == o and h.get("rid") == r)
                    answered += 1
                fake.pump(0)
        assert answered > 300, answered
        fake.send({"v": P.PROTOCOL_VERSION, "op": "generate", "rid": "honest", "job_id": "h",
                   "sampling": {"max_tokens": 4}}, [P.pack_tokens([1, 2, 3])])
        reply = fake.wait_for("the honest generate", lambda h: h.get("op") == "generate_reply" and h.get("rid") == "honest")
        assert "error" not in reply, reply
        assert proc.poll() is None, (tmp_path / "peer.log").read_text()[-3000:]
    finally:
        _stop(proc)
        fake.close()
    assert "Traceback" not in (tmp_path / "peer.log").read_text()


def test_every_op_has_a_sample_and_every_field_checker_a_grammar() -> None:
    """A new op, or a field checked by a function the grammar does not know, is fuzzed at its edges or fails here."""
    assert set(OP_SCHEMAS) <= set(grammar.SAMPLES), set(OP_SCHEMAS) - set(grammar.SAMPLES)
    from prorl_cli.protocol.schema import GRAMMAR, Opt

    unknown = []
    for op, schema in OP_SCHEMAS.items():
        for path, check in grammar._fields(schema.fields, (), grammar.SAMPLES[op][0]):
            if check not in GRAMMAR:
                unknown.append(f"{op.value}.{'.'.join(map(str, path))}")
            kind, bounds = GRAMMAR.get(check, ("", {}))
            for sub in ([bounds["item"]] if kind == "list" else [bounds["key"], bounds["value"]] if kind == "dict" else []):
                if sub not in GRAMMAR:
                    unknown.append(f"{op.value}.{'.'.join(map(str, path))}[]")
            assert not isinstance(check, Opt)
    assert unknown == [], unknown
