"""``prorl plan``'s accuracy: its prediction against a real deployment of simulated GPUs, in one run.

Per ``--in-flight`` value, a real local deployment (broker, one node,
``--bridges`` bridges with the simulated H100/8B engine, ``prorl serve
inference --engine sim``, all child processes on this machine, as
``benchmarks/table3.py`` starts them) runs the ``sim_agent`` task (SWE-like:
growing prompts, log-normal tool time) in a closed loop: ``in_flight`` jobs
submitted, a finished one replaced at once, until ``--rollouts`` have ended.
Measured, over the completions after the first quarter, from the engines' own
GPU-time figures (their heartbeat stats: ``busy_s``, ``elapsed_s``): rollouts
per GPU-second held (window x bridges, GPU time = wall time x ``--speedup``)
and the GPU busy share; then the jobs still running finish. Every result goes
to a JSONL (as ``prorl results --out``); the planner (:mod:`prorl_cli.planning`) reads them back with the
same shape (bridges, slots, in flight, KV admission) and predicts the same
figures. Printed: measured, predicted, and their ratio (the goal: within 10%).

    python benchmarks/plan_accuracy.py [--bridges 2] [--in-flight 8,24] [--rollouts 240] [--speedup 10]
        [--out-dir DIR]

The tool waits absorb this machine's hops (``sim_agent``'s ``absorb_hops``),
so the engines see the modelled tool time between a job's calls; what is left
of the hops (their share a tool wait could not absorb) is this machine's, not
the model's, and shows in the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_cli.embedded import LocalStack
from prorl_cli.inference.sim_engine import SimProfile
from prorl_cli.planning import ClusterShape, Workload, make_plan

#: Per-group difficulty, as benchmarks/table3.py draws it: some always solved, some never, most in between.
P_SOLVE = [0.0, 0.0, 1.0, 0.2, 0.4, 0.5, 0.6, 0.8]


@dataclass
class Measured:
    in_flight: int
    rollouts: int
    window_gpu_s: float
    rollouts_per_gpu_s: float
    busy_share: float
    prefix_hit_rate: float
    wall_s: float


def instance(group: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "seed": args.seed, "turns": [args.min_turns, args.max_turns], "prompt_tokens": 2000,
        "output_tokens": {"median": 150, "sigma": 0.6, "max": 1024},
        "observation_tokens": {"median": 500, "sigma": 1.0, "max": 6000},
        "tool_s": {"median": args.tool_median_s, "sigma": 1.0, "max": 60.0},
        "time_scale": args.speedup, "absorb_hops": True,
        "p_solve": random.Random(f"{args.seed}:{group}").choice(P_SOLVE),
    }


def totals(stack: LocalStack) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in stack.client.status().backends:
        for k, v in b.stats.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def run_deployment(in_flight: int, args: argparse.Namespace, home: Path, results_path: Path) -> Measured:
    n_run = in_flight * 2
    config = {
        "broker": {"heartbeat_interval_s": 0.25, "heartbeat_liveness": 40, "journal": False},
        "node": {"n_init": 32, "n_run": n_run, "n_eval": 32, "stop_grace_s": 3.0,
                 "handler_paths": ["prorl_cli.testing.handlers"]},
        "jobs": {"timeout_s": 3600.0},
        "inference": {"generate_timeout_s": 3600.0, "sim_speedup": args.speedup, "capacity": 256},
        "log_level": "WARNING",
    }
    warmup = args.rollouts // 4
    with LocalStack(home / f"if{in_flight}", "pa", config) as stack:
        stack.start_broker()
        stack.start_node("node-0")
        for i in range(args.bridges):
            stack.spawn(f"sim-{i}", "serve", "inference", "--engine", "sim", "--backend-id", f"sim-{i}")
        stack.wait_for(lambda st: sum(b.alive for b in st.backends) == args.bridges, 60.0,
                       "the sim bridges to register", "sim-0")
        time.sleep(0.6)  # a first heartbeat with stats from every bridge
        client = stack.client
        submitted = 0

        def submit_one() -> str:
            nonlocal submitted
            k = submitted
            submitted += 1
            group = k // args.group_size
            job_id = f"pa-{k}"
            client.submit("sim_agent", [instance(group, args)], job_ids=[job_id], group_id=f"pa-g{group}",
                          timeout_s=3600.0)
            return job_id

        started = time.monotonic()
        done = 0
        before: dict[str, float] = {}
        t_a = started
        t_b = started
        after: dict[str, float] = {}
        with results_path.open("w") as out, client.results([]) as stream:
            stream.add([submit_one() for _ in range(in_flight)])
            for result in stream:
                out.write(json.dumps(result.to_wire()) + "\n")
                done += 1
                if done == warmup:
                    t_a, before = time.monotonic(), totals(stack)
                if done < args.rollouts:
                    stream.add([submit_one()])
                elif done == args.rollouts:
                    t_b = time.monotonic()
                    time.sleep(0.6)  # the bridges' next heartbeat covers the window's end
                    after = totals(stack)
                # Then the jobs still running finish (not measured): the file holds every rollout submitted,
                # not only the shorter ones that ended first.
        stack.stop()
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # GPU-seconds held in the window, by the engines' own clocks (their elapsed_s; the wall window x speedup
    # x bridges when a heartbeat was missing).
    held_gpu_s = d.get("elapsed_s") or (t_b - t_a) * args.speedup * args.bridges
    return Measured(
        in_flight=in_flight, rollouts=args.rollouts - warmup, window_gpu_s=round(held_gpu_s / args.bridges, 1),
        rollouts_per_gpu_s=(args.rollouts - warmup) / held_gpu_s,
        busy_share=d["busy_s"] / d["elapsed_s"] if d.get("elapsed_s") else 0.0,
        prefix_hit_rate=d["cached_tokens"] / d["prompt_tokens"] if d.get("prompt_tokens") else 0.0,
        wall_s=round(time.monotonic() - started, 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bridges", type=int, default=2)
    ap.add_argument("--in-flight", default="8,24", help="comma-separated; one deployment each")
    ap.add_argument("--rollouts", type=int, default=240, help="rollouts per deployment (the first quarter: warm-up)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--min-turns", type=int, default=5)
    ap.add_argument("--max-turns", type=int, default=15)
    ap.add_argument("--tool-median-s", type=float, default=1.0, help="median tool time per action (GPU time)")
    ap.add_argument("--speedup", type=float, default=10.0, help="simulated time runs this many times faster")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, help="keep the results JSONL files here")
    args = ap.parse_args()
    in_flights = [int(x) for x in args.in_flight.split(",") if x]
    profile = SimProfile.load("h100-8b")
    rows = []
    with tempfile.TemporaryDirectory(prefix="prorl-plan-accuracy-") as tmp:
        out_dir = args.out_dir or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        for n in in_flights:
            results_path = out_dir / f"results-if{n}.jsonl"
            print(f"deployment: {args.bridges} sim bridges, {n} in flight, {args.rollouts} rollouts ...", flush=True)
            m = run_deployment(n, args, Path(tmp), results_path)
            planned = time.monotonic()
            work = Workload.from_results(results_path, time_scale=args.speedup)
            plan = make_plan(work, profile, ClusterShape(bridges=args.bridges, nodes=1, slots=n * 2),
                             group_size=args.group_size, in_flight=[n], rollouts=args.rollouts * 2)
            p = plan.sweep[0]
            rows.append((m, p, time.monotonic() - planned))
    print(f"\nprorl plan vs a real deployment: {args.bridges} simulated H100/8B bridges, sim_agent "
          f"{args.min_turns}-{args.max_turns} turns, time x{args.speedup:g}; per GPU-second (GPU time)")
    print(f"{'in flight':>9}{'measured r/GPU-s':>18}{'predicted':>11}{'ratio':>7}{'busy meas.':>11}{'pred.':>7}"
          f"{'hits meas.':>11}{'pred.':>7}{'deploy s':>9}{'plan s':>7}")
    for m, p, plan_s in rows:
        pred = p.rollouts_per_s / args.bridges
        print(f"{m.in_flight:>9}{m.rollouts_per_gpu_s:>18.5f}{pred:>11.5f}{pred / m.rollouts_per_gpu_s:>7.3f}"
              f"{m.busy_share:>11.1%}{p.gpu_busy_share:>7.1%}{m.prefix_hit_rate:>11.1%}{p.prefix_hit_rate:>7.1%}"
              f"{m.wall_s:>9.0f}{plan_s:>7.1f}")
    worst = max(abs(p.rollouts_per_s / args.bridges / m.rollouts_per_gpu_s - 1) for m, p, _ in rows)
    print(f"worst |predicted/measured - 1| = {worst:.1%} (goal: within 10%)")


if __name__ == "__main__":
    main()
