"""Bad input at the broker's socket: each gets an error reply or is refused; nothing is lost."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from prorl_cli import protocol as P
from prorl_cli.exceptions import RemoteError
from tests.harness import Deployment, bare_dealer, one_node_deployment

REPLY_TIMEOUT_MS = 5000


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    yield from one_node_deployment(tmp_path_factory, "bad")


@pytest.fixture
def raw(deployment: Deployment):
    sock = bare_dealer(deployment.address, deployment.deployment_dir)
    yield sock
    sock.close(0)


def _reply(sock: zmq.Socket) -> dict:
    assert sock.poll(REPLY_TIMEOUT_MS), "no reply from the broker"
    frames = sock.recv_multipart()
    return msgpack.unpackb(frames[0], raw=False)


def _error(sock: zmq.Socket) -> tuple[str, str]:
    h = _reply(sock)
    assert h["op"] == "reply" and h["ok"] is False, h
    return h["error"]["code"], h["error"]["message"]


def _healthy(deployment: Deployment) -> None:
    """The broker still serves, and a job submitted right after succeeds."""
    client = deployment.new_client()
    try:
        r = client.process("test", {"echo": "still alive"}, timeout_s=10)
        assert r.state == "done" and r.output["echo"] == "still alive"
    finally:
        client.close()


def test_garbage_bytes(deployment: Deployment, raw: zmq.Socket) -> None:
    raw.send(b"\xc1\xff garbage, not msgpack")
    code, msg = _error(raw)
    assert code == "bad_frame" and "not msgpack" in msg
    raw.send(b"")
    code, _ = _error(raw)
    assert code == "bad_frame"
    raw.send(msgpack.packb([1, 2, 3]))
    code, msg = _error(raw)
    assert code == "bad_frame" and "map" in msg
    _healthy(deployment)


def test_unknown_op(deployment: Deployment, raw: zmq.Socket) -> None:
    raw.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "launch_missiles", "rid": 1}))
    code, msg = _error(raw)
    assert code == "unknown_op" and "launch_missiles" in msg
    # A real op that only the broker sends is refused too.
    raw.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "assign", "rid": 2, "jobs": []}))
    code, _ = _error(raw)
    assert code == "unknown_op"
    _healthy(deployment)


def test_wrong_protocol_version(deployment: Deployment, raw: zmq.Socket) -> None:
    raw.send(msgpack.packb({"v": 999, "op": "status", "rid": 1}))
    code, msg = _error(raw)
    assert code == "bad_version" and "999" in msg
    raw.send(msgpack.packb({"op": "status", "rid": 1}))
    code, _ = _error(raw)
    assert code == "bad_version"
    _healthy(deployment)


def test_missing_and_mistyped_fields(deployment: Deployment, raw: zmq.Socket) -> None:
    raw.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "submit", "rid": 1}))
    code, msg = _error(raw)
    assert code == "missing_field" and "'jobs'" in msg
    raw.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "cancel", "rid": 1, "job_ids": "abc"}))
    code, msg = _error(raw)
    assert code == "bad_field" and "job_ids" in msg
    # A job record missing its task, and one with a bad timeout.
    raw.send_multipart(P.encode({"op": "submit", "rid": 2, "jobs": [{"job_id": "x"}]}, [P.pack_obj({})]))
    code, msg = _error(raw)
    assert code == "missing_field" and "task" in msg
    raw.send_multipart(P.encode({"op": "submit", "rid": 3, "jobs": [{"job_id": "y", "task": "test", "timeout_s": -1}]},
                                [P.pack_obj({})]))
    code, msg = _error(raw)
    assert code == "bad_field" and "timeout_s" in msg
    # Instances and job records that do not pair up.
    raw.send_multipart(P.encode({"op": "submit", "rid": 4, "jobs": [{"job_id": "z", "task": "test"}]}, []))
    code, msg = _error(raw)
    assert code == "bad_field" and "carries 0 payload item(s) but needs 1" in msg
    _healthy(deployment)


def test_job_items_not_packed_as_the_protocol_says(deployment: Deployment, raw: zmq.Socket) -> None:
    header = msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "submit", "rid": 5, "jobs": [{"job_id": "p", "task": "test"}]})
    # A frame per job (protocol version 1's way), no frame, garbage, and an array holding something else than bin.
    for payload, words in [([P.pack_obj({}), P.pack_obj({})], "got 2 frames"), ([], "got 0 frames"),
                           ([b"\xc1"], "not msgpack"), ([msgpack.packb(["text"])], "holding ['str']"),
                           ([msgpack.packb({"a": b"x"})], "got dict")]:
        raw.send_multipart([header, *payload])
        code, msg = _error(raw)
        assert code == "bad_frame" and "'submit'" in msg and words in msg, (payload, msg)
    # A peer of the last protocol version is told which one this broker speaks.
    raw.send_multipart([msgpack.packb({"v": 1, "op": "submit", "rid": 6, "jobs": [{"job_id": "q", "task": "test"}]}),
                        P.pack_obj({})])
    code, msg = _error(raw)
    assert code == "bad_version" and f"speaks {P.PROTOCOL_VERSION}" in msg
    client = deployment.new_client()
    try:
        assert client.cancel(["p", "q"]) == {"p": "unknown", "q": "unknown"}  # nothing of them was taken
    finally:
        client.close()
    _healthy(deployment)


@pytest.mark.parametrize("url", ["http://", "https:///", "http://:80", "http://host:99999", "http://a b",
                                 "http://host\x00", "http:/host", "ftp://host"])
def test_an_add_llm_server_url_without_a_host_is_answered_and_the_broker_serves_on(
    deployment: Deployment, raw: zmq.Socket, url: str
) -> None:
    raw.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "add_llm_server", "rid": 7138, "url": url}))
    code, msg = _error(raw)
    assert code == "bad_field" and "url" in msg, (code, msg)
    _healthy(deployment)


def test_unknown_task_names_the_served_tasks(deployment: Deployment) -> None:
    client = deployment.new_client()
    try:
        with pytest.raises(RemoteError) as e:
            client.submit("no-such-task", [{}])
        assert e.value.code == "unknown_task"
        assert "no-such-task" in e.value.message and "test" in e.value.message
        # cancel reports per id: unknown ids are named, not raised.
        assert client.cancel(["never-submitted"]) == {"never-submitted": "unknown"}
    finally:
        client.close()
    _healthy(deployment)


def test_oversized_frame_is_refused(deployment: Deployment, raw: zmq.Socket) -> None:
    # Jobs accepted before the attack must survive it.
    client = deployment.new_client()
    ids = client.submit("test", [{"sleep_s": {"run": 0.3}, "echo": i} for i in range(5)], timeout_s=30)
    header = msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "submit", "rid": 1, "jobs": [{"job_id": "big", "task": "test"}]})
    raw.send_multipart([header, b"\0" * (100 * 1024 * 1024)])
    # libzmq drops a peer whose message exceeds MAXMSGSIZE: no reply, no job.
    assert not raw.poll(1000)
    assert client.cancel(["big"]) == {"big": "unknown"}
    results = client.wait(ids, timeout_s=30)
    assert [r.output["echo"] for r in results] == list(range(5))
    client.close()
    # An oversized header (inside the frame limit) gets an error reply.
    fresh = bare_dealer(deployment.address, deployment.deployment_dir)
    fresh.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "status", "rid": 1, "pad": "x" * (5 * 1024 * 1024)}))
    code, msg = _error(fresh)
    fresh.close(0)
    assert code == "bad_frame" and "limit" in msg
    _healthy(deployment)


def test_node_ops_from_an_unregistered_peer(deployment: Deployment, raw: zmq.Socket) -> None:
    raw.send_multipart(P.encode({"op": "job_done", "jobs": [{"job_id": "x", "attempt": 1, "state": "done"}]}, [b"x"]))
    code, _ = _error(raw)
    assert code == "unknown_peer"
    # A stranger cannot cancel anyone's generate calls.
    raw.send_multipart([msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "generate_cancel", "rid": 1, "job_id": "x"})])
    code, _ = _error(raw)
    assert code == "unknown_peer"
    raw.send_multipart([msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "generate_cancel", "rid": 1})])
    code, message = _error(raw)
    assert code == "missing_field" and "job_id" in message
    _healthy(deployment)
