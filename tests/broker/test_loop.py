"""Nothing blocks the broker's loop for long: compaction in a thread, liveness judged on a drained inbox."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import zmq

from prorl_cli import protocol as P
from prorl_cli.broker.journal import Journal, end_record, job_record, packed_pieces
from prorl_cli.broker.server import Broker
from prorl_cli.broker.state import Node
from prorl_cli.config import ProrlConfig
from prorl_cli.protocol import JobSpec, JobState
from prorl_cli.security import client_keys


class GatedRecords(list):  # type: ignore[type-arg]
    """A snapshot whose iteration waits for ``gate``: proves the writer is not the caller's thread."""

    def __init__(self, items: list[dict[str, Any]], gate: threading.Event) -> None:
        super().__init__(items)
        self.gate = gate

    def __iter__(self) -> Iterator[dict[str, Any]]:
        assert self.gate.wait(30), "the gate was never opened"
        return super().__iter__()


def test_compaction_runs_in_a_thread_and_keeps_what_came_meanwhile(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "broker.journal", fsync=True, compact_bytes=1)
    for i in range(3):
        journal.append(job_record(JobSpec(job_id=f"old{i}", task="t"), b"\x80"))
    journal.flush()
    assert journal.wants_compaction
    gate = threading.Event()
    snapshot = [job_record(JobSpec(job_id=f"old{i}", task="t"), b"\x80") for i in range(3)]
    journal.compact_in_background(GatedRecords(snapshot, gate))  # returns while the writer waits
    assert journal.compacting and not journal.wants_compaction
    journal.append(job_record(JobSpec(job_id="new", task="t"), b"\x80"))
    done = P.pack_obj(P.JobResult(job_id="old0", task="t", state="done").to_wire())
    journal.append(end_record("old0", JobState.DONE, done))
    journal.flush()
    journal.poll()
    assert journal.compacting  # still gated: the old file is still the one written
    gate.set()
    while journal.compacting:
        time.sleep(0.01)
        journal.poll()
    jobs = journal.replay()
    assert sorted(jobs) == ["new", "old0", "old1", "old2"] and jobs["old0"].result == done
    journal.close()


def test_big_results_are_journaled_by_reference_and_replay_the_same(tmp_path: Path) -> None:
    """No copy of a result on the loop (a turn of 256 KB results would double the broker's memory for a
    moment): the record's pieces hold the result object itself, and the bytes are what msgpack writes."""
    result = P.pack_obj(P.JobResult(job_id="big", task="t", state="failed", output={"blob": os.urandom(300_000)}).to_wire())
    small = end_record("small", JobState.DONE, b"tiny")
    big = end_record("big", JobState.FAILED, result)
    packer = msgpack.Packer(use_bin_type=True)
    for record in (small, big, job_record(JobSpec(job_id="j", task="t"), bytes(1 << 16))):
        assert b"".join(packed_pieces(record, packer)) == msgpack.packb(record, use_bin_type=True)
    assert any(piece is result for piece in packed_pieces(big, packer))
    journal = Journal(tmp_path / "broker.journal")
    journal.append(job_record(JobSpec(job_id="big", task="t"), b"\x80"))
    journal.append(big)
    journal.flush()
    assert journal.replay()["big"].result == result
    journal.close()


def _broker(tmp_path: Path) -> Broker:
    config = ProrlConfig(home=str(tmp_path))
    config.broker.journal = False
    return Broker(config)


def test_liveness_is_judged_only_on_a_drained_inbox_and_stalls_are_credited(tmp_path: Path) -> None:
    broker = _broker(tmp_path)
    try:
        node = Node(node_id="n", identity=b"n", host="h", pid=1, credit=1, tasks={"t"})
        broker.nodes["n"] = node
        broker.node_by_identity[b"n"] = node
        now = time.monotonic()
        node.last_seen = now - 100
        broker._last_tick = now
        broker._drained = False  # heartbeats may be waiting unread
        broker._tick()
        assert node.alive
        # A loop that stalled 100 s: the silence was ours, not the node's.
        broker._drained = True
        broker._last_tick = time.monotonic() - 100
        broker._tick()
        assert node.alive
        node.last_seen = time.monotonic() - 100
        broker._tick()
        assert not node.alive
    finally:
        broker.close(0)


def test_unread_input_is_bounded_per_peer_and_waits_in_the_sender(tmp_path: Path) -> None:
    """A peer that sends faster than the loop reads is held back (libzmq stops reading its connection past
    ``broker.receive_window_messages``), so big results pile up in the sender, not in the broker; none is lost."""
    config = ProrlConfig(home=str(tmp_path))
    config.broker.journal = False
    config.broker.receive_window_messages = 4
    broker = Broker(config)  # its loop never runs: nothing is read until the end
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.SNDHWM, 1)
    if broker.curve_public_key:  # the broker's loop never runs, so it publishes no rendezvous file: its key from here
        peer.curve_serverkey = broker.curve_public_key.encode()
        peer.curve_publickey, peer.curve_secretkey = client_keys(config.deployment_dir)
    peer.connect(broker.address)
    offered, accepted = 1000, 0  # 250 MB of 256 KB messages, were nothing holding the sender back
    blob = bytes(256 * 1024)
    try:
        # A send that cannot go out within 2 s means the sender is held back: that is the event awaited.
        while accepted < offered and peer.poll(2000, zmq.POLLOUT):
            peer.send(blob, zmq.NOBLOCK)
            accepted += 1
        # The broker's window plus what the kernel's socket buffers hold: a small fraction of what was offered.
        assert accepted < offered // 4, accepted
        received = 0
        while received < accepted and broker.sock.poll(10_000):
            assert broker.sock.recv_multipart()[-1] == blob
            received += 1
        assert received == accepted
    finally:
        peer.close(0)
        broker.close(0)
