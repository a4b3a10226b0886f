"""Property-based fuzz of the broker: malformed messages from registered and unregistered peers, an honest
client alongside. The broker stays up, every honest job completes exactly once, its memory stays flat.
The long version: ``scripts/chaos/fuzz_broker.py``."""

from __future__ import annotations

import random
from pathlib import Path

import psutil
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prorl_cli.testing.fuzzing import HonestClient, Peer, malformed
from tests.harness import Deployment

EXAMPLES = 400


def test_fuzzed_broker_stays_up_and_honest_jobs_finish_once(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "fuzz", config={"broker": {"journal": True}})
    try:
        broker = d.start_broker()
        d.start_node("n1")
        honest = HonestClient(d.address, "honest")
        honest.submit(40, {"sleep_s": {"run": 0.05}, "echo": "honest"})
        peers = [Peer(d.address), Peer(d.address, register_as="fz-a"), Peer(d.address, register_as="fz-b")]
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
