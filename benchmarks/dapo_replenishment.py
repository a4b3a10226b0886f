"""DAPO dynamic sampling: asynchronous replenishment vs. batch by batch, in one run.

A real deployment (broker + one node) runs ``dapo_sim``: simulated agentic
rollouts whose durations are heavy-tailed (Pareto) and whose prompts are
40% zero-variance (always right or always wrong). The same prompts and the
same worker budget (``--slots`` jobs at once) go through
:class:`prorl_cli.training.DapoSampler` twice:

- ``async``: up to ``slots`` jobs in flight, a new group submitted as soon as
  one finishes, groups still running at the end of a step carried over;
- ``sync``: batches of ``slots / group_size`` groups, each waited for in
  full (its slowest rollout), filtered, repeated until the target is met.

Prints informative groups per second and the worker idle fraction (1 -
mean running jobs / slots, sampled from the broker's status) for each, and
their ratio::

    python benchmarks/dapo_replenishment.py [--steps 4 --target-groups 8 --group-size 8 --slots 32]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.embedded import LocalStack
from prorl_cli.training.sampler import DapoSampler, SamplerConfig


@dataclass
class Run:
    mode: str
    groups: int
    wall_s: float
    idle_fraction: float
    filtered: int
    cancelled: int

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.wall_s


def prompts(n: int, seed: int, scale_s: float) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        u = rng.random()
        p = 0.0 if u < 0.2 else 1.0 if u < 0.4 else rng.uniform(0.2, 0.8)  # 40% zero-variance prompts
        out.append({"p": p, "scale_s": scale_s, "alpha": 1.5, "max_s": 30 * scale_s, "seed": seed * 1000 + i})
    return out


async def measure(stack: LocalStack, mode: str, args: argparse.Namespace) -> Run:
    cfg = SamplerConfig(
        group_size=args.group_size, target_groups=args.target_groups, max_in_flight=args.slots, mode=mode,
        sync_batch_groups=max(1, args.slots // args.group_size), run_id=f"bench-{mode}", max_staleness=1,
    )
    busy: list[float] = []
    async with AsyncRolloutClient(stack.name, address=stack.address, config=stack.load_config()) as client:
        sampler = DapoSampler(client, "dapo_sim", prompts(4000, args.seed, args.scale_s), cfg)
        stop = asyncio.Event()

        async def poll() -> None:
            while not stop.is_set():
                st = await client.status()
                busy.append(sum(n.inflight for n in st.nodes))
                await asyncio.sleep(0.05)

        poller = asyncio.create_task(poll())
        started = time.monotonic()
        groups = filtered = cancelled = 0
        for step in range(args.steps):
            batch = await sampler.step(policy_version=step)
            groups += len(batch.groups)
            filtered += batch.stats.filtered
            cancelled += batch.stats.cancelled_jobs
        wall_s = time.monotonic() - started
        stop.set()
        await poller
        await sampler.close()
    idle = 1.0 - (sum(busy) / len(busy)) / args.slots if busy else float("nan")
    return Run(mode, groups, wall_s, idle, filtered, cancelled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--target-groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--scale-s", type=float, default=0.1, help="rollout duration scale (Pareto alpha 1.5, capped at 30x)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = {"log_level": "WARNING", "node": {"n_init": args.slots, "n_run": args.slots, "n_eval": args.slots, "credit": args.slots,
                                            "handler_paths": ["prorl_cli.testing.handlers"]}}
        with LocalStack(Path(tmp), "dapo-bench", config) as stack:
            stack.start_broker()
            stack.start_node("n1")
            stack.wait_for(lambda st: any(n.alive for n in st.nodes), 60, "the node")
            runs = [asyncio.run(measure(stack, mode, args)) for mode in ("async", "sync")]
    print(f"{args.steps} steps x {args.target_groups} informative groups of {args.group_size}; {args.slots} worker slots; "
          f"durations {args.scale_s} s x Pareto(1.5); 40% zero-variance prompts")
    print(f"{'mode':<6} {'groups':>6} {'wall s':>8} {'groups/s':>9} {'idle':>6} {'filtered':>9} {'cancelled':>9}")
    for r in runs:
        print(f"{r.mode:<6} {r.groups:>6} {r.wall_s:>8.2f} {r.groups_per_s:>9.2f} {r.idle_fraction:>6.2f} {r.filtered:>9} {r.cancelled:>9}")
    print(f"async / sync informative groups per second: {runs[0].groups_per_s / runs[1].groups_per_s:.2f}x")


if __name__ == "__main__":
    main()
