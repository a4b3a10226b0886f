"""Logs: JSON lines under PRORL_LOG_FORMAT=json, and a rejected peer logged once per minute, not per frame."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zmq

from tests.harness import Deployment, bare_dealer


def test_broker_logs_json_lines_and_each_bad_peer_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRORL_LOG_FORMAT", "json")
    d = Deployment(tmp_path / "home")
    ctx = zmq.Context()
    try:
        d.start_broker()
        noisy, other = bare_dealer(d.address, d.deployment_dir, ctx=ctx), bare_dealer(d.address, d.deployment_dir, ctx=ctx)
        for _ in range(5):
            noisy.send_multipart([b"not msgpack at all"])
        other.send_multipart([b"\xc1"])
        for sock, n in ((noisy, 5), (other, 1)):  # every bad frame is still answered
            for _ in range(n):
                assert sock.poll(10_000), "no error reply"
                assert b"bad_frame" in sock.recv_multipart()[0]
        d.client.status()  # the broker has handled everything before this
        text = (d.logs / "broker.log").read_text()
        records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        others = [line for line in text.splitlines() if line.strip() and not line.startswith("{")]
        assert all(line.startswith("broker of ") for line in others), others  # the console banner, not a log record
        assert any(r["message"].startswith("broker of deployment") for r in records)
        assert all({"ts", "level", "logger", "role", "pid", "message"} <= r.keys() for r in records)
        rejected = [r for r in records if r["message"].startswith("rejected a message from peer")]
        assert len(rejected) == 2, rejected  # one per peer, however many frames it sent
        assert all(r["role"] == "broker" and r["level"] == "WARNING" and "bad_frame" in r["message"] for r in rejected)
    finally:
        ctx.destroy(linger=0)
        d.close()
