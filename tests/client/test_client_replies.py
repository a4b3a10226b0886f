"""The client reads each broker reply through its typed form: a malformed one is a ProtocolError naming the field.

A raw ROUTER over real ZeroMQ plays the broker and answers each request with a canned reply.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from prorl_cli import protocol as P
from prorl_cli.client import AsyncRolloutClient
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import CheckpointNotADirectory, CheckpointNotFound, ProtocolError
from prorl_cli.protocol import headers as H
from prorl_cli.protocol.checks import declared_fields
from tests.fakes.connections import receive_request, with_router


@pytest.mark.parametrize("op", list(P.REPLY_SCHEMAS), ids=lambda op: op.value)
def test_every_typed_reply_is_declared_by_its_class(op: P.Op) -> None:
    assert P.REPLY_SCHEMAS[op] == declared_fields(H.REPLIES[op])


def test_a_reply_is_typed_and_fields_it_does_not_name_are_ignored() -> None:
    page = P.parse_reply(P.Op.LIST_JOBS, P.reply(7, jobs={"a": "done"}, next=3, newer_field=[1]))
    assert page == H.JobPage(jobs={"a": "done"}, next=3)
    # Absent fields are empty, as the client always took them.
    assert P.parse_reply(P.Op.FORGET, P.reply(7)) == P.ForgetOutcome()


def test_a_newer_brokers_status_report_reads_with_the_fields_this_client_does_not_know_dropped() -> None:
    # A client one release behind the cluster's broker: the report and its nodes and backends may carry more.
    backend = {"backend_id": "b", "kind": "http", "url": "http://h:8000/v1", "host": None, "model": None,
               "max_model_len": None, "inflight": 0, "jobs": 0, "served": 3, "cleared": False, "alive": True}
    node = {"node_id": "n1", "host": "h", "pid": 7, "alive": True, "inflight": 0, "credit": 4, "tasks": ["t"]}
    report = {"deployment": "d", "jobs": {"done": 3}, "queued": 0, "nodes": [{**node, "newer_node_field": 1}],
              "backends": [{**backend, "newer_backend_field": "x"}], "gone_backends": [], "generation_paused": False,
              "placing": True, "uptime_s": 1.0, "newer_report_field": {"a": 1}}
    status = P.parse_reply(P.Op.STATUS, P.reply(7, status=report)).status
    assert (status.deployment, status.jobs, status.nodes[0].node_id, status.backends[0].served) == ("d", {"done": 3}, "n1", 3)
    backend_reply = P.parse_reply(P.Op.ADD_LLM_SERVER, P.reply(7, backend={**backend, "newer_backend_field": 2}))
    assert backend_reply.backend.backend_id == "b"
    # Records peers send the broker stay strict: an unknown field there is refused, naming it.
    with pytest.raises(ProtocolError, match=r"unknown field\(s\) \['newer'\]"):
        P.JobResult.from_wire({"job_id": "j", "task": "t", "state": "done", "attempt": 1, "newer": 1})


#: Per client call: the canned (malformed) reply fields and what the error must say.
MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    ("submit", {"accepted": ["j1", 5], "existing": []},
     r"reply to 'submit': field 'accepted\[1\]' must be a string, got int"),
    ("list_jobs", {"jobs": {"j1": 3}}, r"""reply to 'list_jobs': field "jobs\['j1'\]" must be a string, got int"""),
    ("list_jobs", {"jobs": {}, "next": "2"}, r"reply to 'list_jobs': field 'next' must be an integer, got str"),
    ("forget", {"forgotten": "j1"}, r"reply to 'forget': field 'forgotten' must be a list, got str"),
    ("cancel", {"states": ["j1"]}, r"reply to 'cancel': field 'states' must be a map, got list"),
    ("result", {"unknown": [None]}, r"reply to 'watch': field 'unknown\[0\]' must be a string, got NoneType"),
    ("update_weights", {"updated": "b1"}, r"reply to 'update_weights': field 'updated' must be a list, got str"),
    ("status", {}, r"reply to 'status': field 'status' is missing"),
    ("list_backends", {"backends": [{"backend_id": "b"}]},
     r"reply to 'list_llm_servers': field 'backends\[0\]' is not a BackendStatus: .*missing .*required"),
]


@pytest.mark.parametrize(("call", "fields", "message"), MALFORMED,
                         ids=[f"{call}-{i}" for i, (call, _, _) in enumerate(MALFORMED)])
def test_a_malformed_reply_is_a_protocol_error_naming_the_field(
    call: str, fields: dict[str, Any], message: str, tmp_path: Path
) -> None:
    async def play(router: zmq.asyncio.Socket) -> None:
        client = AsyncRolloutClient(address=router.getsockopt_string(zmq.LAST_ENDPOINT),
                                    config=ProrlConfig(home=str(tmp_path)))
        calls = {
            "submit": lambda: client.submit("t", [{}], job_ids=["j1"]),
            "list_jobs": lambda: client.list_jobs(),
            "forget": lambda: client.forget(["j1"]),
            "cancel": lambda: client.cancel(["j1"]),
            "result": lambda: client.result("j1", timeout_s=30),
            "update_weights": lambda: client.update_weights(tmp_path, 1, timeout_s=30),
            "status": lambda: client.status(),
            "list_backends": lambda: client.list_backends(),
        }
        try:
            task = asyncio.ensure_future(calls[call]())
            identity, header = await receive_request(router)
            await router.send_multipart([identity, *P.encode(P.reply(header["rid"], **fields), ())])
            with pytest.raises(ProtocolError, match=message) as info:
                await task
            want = P.ErrorCode.MISSING_FIELD if "missing" in message else P.ErrorCode.BAD_FIELD
            assert info.value.code == want.value
            if call == "submit":
                # The broker took the jobs whatever its reply looked like: the client still watches them.
                assert "j1" in client._watched
        finally:
            await client.close()

    with_router(play)


def test_bad_arguments_to_a_step_boundary_are_refused_before_anything_is_sent(tmp_path: Path) -> None:
    """``generation_paused`` and ``sync_weights`` check their arguments first: a bad one neither pauses (and
    drains) the deployment nor resumes one paused before; the broker's first request is the ping sent after."""

    async def play(router: zmq.asyncio.Socket) -> None:
        client = AsyncRolloutClient(address=router.getsockopt_string(zmq.LAST_ENDPOINT),
                                    config=ProrlConfig(home=str(tmp_path)), request_timeout_s=2.0)
        try:
            first = asyncio.ensure_future(receive_request(router))
            with pytest.raises(ValueError, match=r"drain_timeout_s must be a number of seconds in \[0, 1e6\], got -1"):
                async with client.generation_paused(2, drain_timeout_s=-1):
                    pytest.fail("the block ran")
            with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got 0"):
                await client.sync_weights(tmp_path, 2, timeout_s=0)
            with pytest.raises(TypeError):
                await client.sync_weights(None, 2)  # type: ignore[arg-type]
            # A file where the model directory goes: each bridge said, after the drain, "<dir>/config.json: not a
            # model directory (no config.json)", a contradiction. Named here, before the drain.
            config = tmp_path / "config.json"
            config.write_text("{}")
            file_given = re.escape(f"checkpoint {config} is a file, not a model directory: give the directory that "
                                   f"holds config.json and the weights ({tmp_path}?)") + "$"
            with pytest.raises(CheckpointNotADirectory, match=r"^sync_weights: " + file_given) as refused:
                await client.sync_weights(config, 6)
            assert isinstance(refused.value, CheckpointNotFound) and isinstance(refused.value, NotADirectoryError)
            with pytest.raises(CheckpointNotADirectory, match=r"^update_weights: " + file_given):
                await client.update_weights(str(config), 6)
            ping = asyncio.ensure_future(client.ping())
            identity, header = await first
            assert header["op"] == P.Op.PING.value
            await router.send_multipart([identity, *P.encode(P.reply(header["rid"]), ())])
            await ping
        finally:
            await client.close()

    with_router(play)
