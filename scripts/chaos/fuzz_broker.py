#!/usr/bin/env python3
"""Fuzz a real broker with 10,000+ malformed frames from several peers while an honest client runs.

Prints the frames sent, the replies received, the honest jobs' outcomes and
the broker's RSS before and after. Exit status 0 only if the broker is alive,
every honest job finished exactly once with ``done``, and its log has no
traceback. The short version is ``tests/chaos/test_fuzz_broker.py``.

    python scripts/chaos/fuzz_broker.py --frames 10000 --peers 6 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import psutil

from prorl_cli.testing import Deployment
from prorl_cli.testing.fuzzing import HonestClient, Peer, malformed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=10_000, help="malformed messages to send")
    ap.add_argument("--peers", type=int, default=6, help="fuzzing peers (half of them registered as nodes)")
    ap.add_argument("--honest-jobs", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    d = Deployment(Path(tempfile.mkdtemp(prefix="prorl-fuzz-")) / "home", "fuzz")
    try:
        broker = d.start_broker()
        d.start_node("n1")
        proc = psutil.Process(broker.pid)
        honest = HonestClient(d.address, d.deployment_dir, "honest")
        peers = [Peer(d.address, d.deployment_dir, register_as=f"fz{i}" if i % 2 else None) for i in range(args.peers)]
        rss_before = proc.memory_info().rss
        replies = 0
        per_batch = max(1, args.frames // max(1, args.honest_jobs // 10))
        for n in range(args.frames):
            if n % per_batch == 0 and len(honest.ids) < args.honest_jobs:
                honest.submit(10, {"sleep_s": {"run": 0.02}, "echo": n})
            peer = rng.choice(peers)
            peer.send(malformed(rng, honest.ids) or [b""])
            if n % 50 == 0:
                replies += sum(p.drain() for p in peers)
                honest.pump()
        honest.wait_all(300)
        replies += sum(p.drain() for p in peers)
        rss_after = proc.memory_info().rss
        outcomes: dict[str, int] = {}
        for states in honest.results.values():
            key = ",".join(states)
            outcomes[key] = outcomes.get(key, 0) + 1
        log = d.log("broker")
        summary = {
            "frames": args.frames, "peers": args.peers, "replies": replies, "honest_submitted": len(honest.ids),
            "honest_outcomes": outcomes, "honest_missing": len(honest.ids) - len(honest.results),
            "broker_alive": broker.poll() is None, "tracebacks": log.count("Traceback"),
            "rss_before_mb": round(rss_before / 2**20, 1), "rss_after_mb": round(rss_after / 2**20, 1),
        }
        print(json.dumps(summary))
        ok = (summary["broker_alive"] and not summary["tracebacks"] and summary["honest_missing"] == 0
              and outcomes == {"done": len(honest.ids)})
        for p in peers:
            p.close()
        honest.close()
        return 0 if ok else 1
    finally:
        d.close()


if __name__ == "__main__":
    sys.exit(main())
