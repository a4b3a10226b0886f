"""BrokerConnection over real ZeroMQ sockets: a raw ROUTER (``tests.fakes.connections``) plays the broker's side of the wire."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from prorl_cli import protocol as P
from prorl_cli.connection import BrokerConnection
from prorl_cli.exceptions import (
    BackendFailed,
    BadAddress,
    BadRequest,
    BrokerRestarted,
    BrokerStopping,
    BrokerUnavailable,
    InferenceError,
    ProtocolMismatch,
    RemoteError,
    TaskNotServed,
    UnknownJob,
    UnknownTask,
)
from tests.fakes.connections import receive_request, with_router


async def _conn(router: zmq.asyncio.Socket, **kwargs: object) -> BrokerConnection:
    conn = BrokerConnection(address=router.getsockopt_string(zmq.LAST_ENDPOINT), deployment_dir=None, **kwargs)  # type: ignore[arg-type]
    conn.open()
    return conn


def test_a_cancel_racing_a_reply_is_never_lost() -> None:
    with_router(_a_cancel_racing_a_reply_is_never_lost)


async def _a_cancel_racing_a_reply_is_never_lost(router: zmq.asyncio.Socket) -> None:
    """CPython gh-86296: ``asyncio.wait_for`` returns the result when a cancel lands in the turn the reply does.

    The cancel here is issued from a callback on the reply's future, so it
    lands exactly then. Either the cancel comes too late (``cancel()`` says
    so) or the request ends cancelled and tells the broker; never both
    "cancel accepted" and a result.
    """
    conn = await _conn(router)
    try:
        for _ in range(20):
            task = asyncio.ensure_future(
                conn.request({"op": "generate", "job_id": "j"}, timeout_s=30, cancel={"op": "generate_cancel", "job_id": "j"})
            )
            identity, header = await receive_request(router)
            (fut,) = conn._pending.values()
            accepted: list[bool] = []
            fut.add_done_callback(lambda _f, t=task, a=accepted: a.append(t.cancel()))
            await router.send_multipart([identity, *P.encode(P.reply(header["rid"], value=1), ())])
            try:
                await task
                outcome = "result"
            except asyncio.CancelledError:
                outcome = "cancelled"
            assert accepted, "the cancel ran"
            if accepted[0]:
                assert outcome == "cancelled", "a cancel that was accepted was lost: the request returned its reply"
            else:
                assert outcome == "result"
        assert not conn._pending
    finally:
        await conn.close()


def test_a_cancelled_request_tells_the_broker() -> None:
    with_router(_a_cancelled_request_tells_the_broker)


async def _a_cancelled_request_tells_the_broker(router: zmq.asyncio.Socket) -> None:
    conn = await _conn(router)
    try:
        task = asyncio.ensure_future(conn.request({"op": "generate"}, cancel={"op": "generate_cancel", "job_id": "j"}))
        _, header = await receive_request(router)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        _, cancel = await receive_request(router)
        assert cancel == {**cancel, "op": "generate_cancel", "job_id": "j", "rid": header["rid"]}
    finally:
        await conn.close()


def test_a_new_boot_id_fails_the_requests_the_old_broker_had() -> None:
    with_router(_a_new_boot_id_fails_the_requests_the_old_broker_had)


async def _a_new_boot_id_fails_the_requests_the_old_broker_had(router: zmq.asyncio.Socket) -> None:
    boots: list[str] = []
    conn = await _conn(router, on_new_boot=boots.append)
    try:
        first = asyncio.ensure_future(conn.call({"op": "ping"}, timeout_s=30))
        identity, h1 = await receive_request(router)
        await router.send_multipart([identity, *P.encode(P.reply(h1["rid"], boot_id="A"), ())])
        await first
        lost = asyncio.ensure_future(conn.call({"op": "submit"}, timeout_s=30))
        answered = asyncio.ensure_future(conn.call({"op": "ping"}, timeout_s=30))
        _, h2 = await receive_request(router)
        _, h3 = await receive_request(router)
        # Only the ping is answered, by a broker with a new boot id: the submit went with the old one.
        await router.send_multipart([identity, *P.encode(P.reply(h3["rid"], boot_id="B"), ())])
        reply, _ = await answered
        assert reply["boot_id"] == "B"
        with pytest.raises(BrokerRestarted):
            await lost
        assert boots == ["B"] and conn.boot_id == "B"
        assert h2["op"] == "submit"
    finally:
        await conn.close()


def test_a_request_sent_after_the_one_that_met_the_new_broker_is_not_lost() -> None:
    with_router(_a_request_sent_after_the_one_that_met_the_new_broker_is_not_lost)


async def _a_request_sent_after_the_one_that_met_the_new_broker_is_not_lost(router: zmq.asyncio.Socket) -> None:
    conn = await _conn(router)
    try:
        first = asyncio.ensure_future(conn.call({"op": "ping"}, timeout_s=30))
        identity, h1 = await receive_request(router)
        await router.send_multipart([identity, *P.encode(P.reply(h1["rid"], boot_id="A"), ())])
        await first
        # Tasks start in the order they were made: the rids (and the sends) follow that order.
        lost = asyncio.ensure_future(conn.call({"op": "submit"}, timeout_s=30))
        ping = asyncio.ensure_future(conn.call({"op": "ping"}, timeout_s=30))
        retry = asyncio.ensure_future(conn.call({"op": "submit"}, timeout_s=30))
        _, h2 = await receive_request(router)
        _, h3 = await receive_request(router)
        _, h4 = await receive_request(router)
        assert [h2["op"], h3["op"], h4["op"]] == ["submit", "ping", "submit"]
        # The ping meets the new broker first; the retry, sent after it, reached that broker too and is answered.
        await router.send_multipart([identity, *P.encode(P.reply(h3["rid"], boot_id="B"), ())])
        await ping
        with pytest.raises(BrokerRestarted):
            await lost
        await router.send_multipart([identity, *P.encode(P.reply(h4["rid"], boot_id="B", accepted=["j"]), ())])
        reply, _ = await retry
        assert reply["accepted"] == ["j"]
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("code", "cls", "builtin"),
    [
        ("bad_field", BadRequest, ValueError),
        ("unknown_op", BadRequest, ValueError),
        ("unknown_job", UnknownJob, KeyError),
        ("unknown_task", TaskNotServed, UnknownTask),
        ("unknown_task", UnknownJob, KeyError),
        ("backend_error", BackendFailed, InferenceError),
        ("shutting_down", BrokerStopping, RuntimeError),
        ("something_new", RemoteError, RuntimeError),
    ],
)
def test_an_error_reply_becomes_a_typed_exception(code: str, cls: type, builtin: type) -> None:
    e = RemoteError.from_reply(P.error_reply(7, code, "what went wrong"))
    assert isinstance(e, cls) and isinstance(e, builtin) and isinstance(e, RemoteError)
    assert (e.code, e.message, str(e)) == (code, "what went wrong", f"{code}: what went wrong")


def test_a_malformed_error_reply_still_becomes_an_exception() -> None:
    e = RemoteError.from_reply({"op": "reply", "ok": False, "error": "just a string"})
    assert type(e) is RemoteError and e.code == "error" and "just a string" in e.message


def test_a_request_after_the_reader_died_is_answered_on_a_new_socket() -> None:
    with_router(_a_request_after_the_reader_died_is_answered_on_a_new_socket)


async def _a_request_after_the_reader_died_is_answered_on_a_new_socket(router: zmq.asyncio.Socket) -> None:
    """A broker message its handler fails on with an error the reader does not expect ends the reader; the
    request waiting then fails naming it, and later requests are not left waiting for replies no one reads:
    they go out on a new socket, which the broker knows nothing of (``on_new_boot`` watches again)."""
    def on_message(op: P.Op, header: dict[str, object], payload: list[bytes]) -> None:
        raise RuntimeError("a handler bug")

    boots: list[str] = []
    conn = await _conn(router, on_message=on_message, on_new_boot=boots.append)
    try:
        first = asyncio.ensure_future(conn.call({"op": "ping"}, timeout_s=30))
        identity, header = await receive_request(router)
        await router.send_multipart([identity, *P.encode(P.reply(header["rid"], boot_id="A"), ())])
        await first
        waiting = asyncio.ensure_future(conn.call({"op": "ping"}, timeout_s=30))
        identity, _ = await receive_request(router)
        await router.send_multipart([identity, *P.encode({"op": "shutdown"}, ())])
        with pytest.raises(BrokerUnavailable, match="a handler bug"):
            await waiting
        assert boots == []
        later = asyncio.ensure_future(conn.call({"op": "ping"}, timeout_s=30))
        new_identity, header = await receive_request(router)
        assert new_identity != identity and boots == ["A"]
        await router.send_multipart([new_identity, *P.encode(P.reply(header["rid"], value=2, boot_id="A"), ())])
        reply, _ = await later
        assert reply["value"] == 2 and boots == ["A"]
    finally:
        await conn.close()


def test_an_address_zeromq_refuses_leaves_no_socket_open(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[zmq.Socket] = []  # type: ignore[type-arg]
    make = zmq.asyncio.Context.socket

    def socket(self: zmq.asyncio.Context, *args: object, **kwargs: object) -> zmq.Socket:  # type: ignore[type-arg]
        sock = make(self, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(sock)
        return sock

    monkeypatch.setattr(zmq.asyncio.Context, "socket", socket)

    async def main() -> None:
        conn = BrokerConnection(address="tcp://127.0.0.1", deployment_dir=None)  # no port
        for _ in range(2):
            with pytest.raises(BadAddress, match=r"broker address 'tcp://127.0.0.1': not an endpoint to connect to "
                                                 r".*give tcp://HOST:PORT"):
                conn.open()
        assert conn.sock is None

    asyncio.run(main())
    assert len(opened) == 4 and all(s.closed for s in opened)  # the DEALER and its monitor, twice


def test_a_broker_of_another_protocol_version_is_named_not_waited_out() -> None:
    with_router(_a_broker_of_another_protocol_version_is_named_not_waited_out)


async def _a_broker_of_another_protocol_version_is_named_not_waited_out(router: zmq.asyncio.Socket) -> None:
    """A broker started by an older prorl answers in its own version: the request fails saying so, at once; a
    frame in another version that answers nothing of ours is only logged, and the link goes on."""
    conn = await _conn(router)
    old = P.PROTOCOL_VERSION - 1
    error = {"code": "bad_version", "message": f"protocol version {P.PROTOCOL_VERSION} is not supported"}
    try:
        task = asyncio.ensure_future(conn.request({"op": "status"}, timeout_s=60))
        identity, header = await receive_request(router)
        await router.send_multipart([identity, msgpack.packb({"v": old, "op": "shutdown"})])  # answers nothing
        await router.send_multipart([identity, msgpack.packb(
            {"v": old, "op": "reply", "rid": header["rid"], "ok": False, "error": error})])
        with pytest.raises(ProtocolMismatch) as e:
            await task
        assert f"speaks protocol version {old} and this" in str(e.value), str(e.value)
        assert f"speaks {P.PROTOCOL_VERSION}" in str(e.value)
        assert isinstance(e.value, BrokerUnavailable)
        # The next request, answered in this version, goes through.
        task = asyncio.ensure_future(conn.request({"op": "status"}, timeout_s=60))
        identity, header = await receive_request(router)
        await router.send_multipart([identity, *P.encode(P.reply(header["rid"], value=1), ())])
        reply, _ = await task
        assert reply["ok"] and reply["value"] == 1
    finally:
        await conn.close()
