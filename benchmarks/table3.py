"""The ProRL Agent paper's Table 3, replayed on simulated GPUs through real prorl processes.

One seeded SWE-like workload (``handlers/sim_agent.py``: 10-40 turns per
rollout, prompts growing by each observation to tens of thousands of tokens,
log-normal tool time) runs as DAPO steps: each step submits ``--groups``
groups of ``--n`` rollouts, and stops (cancelling the rest) as soon as
``--target`` groups are informative (rewards not all equal). The deployment
is a real broker, one node with enough RUN slots for a whole step, and 4
bridges with the simulated H100/8B engine (``prorl serve inference --engine
sim``), all child processes on this machine. Configurations, one fresh
deployment each, the same workload each:

* ``full``: prorl as shipped (least-loaded sticky routing, cancel propagation);
* ``round_robin``: ``broker.routing_policy: round_robin`` (no stickiness);
* ``ever_assigned``: ``broker.routing_policy: ever_assigned`` (the paper's server routing);
* ``no_cleanup``: no stale-job cleanup: the trainer's early termination stops
  waiting but cancels nothing (the paper's setting: the rest of the step's
  jobs run on into the next step, their results ignored), and
  ``broker.cancel_propagation: false``, so nothing stops their model calls;
* ``tmux``: every tool action takes ``--tmux-delay-s`` longer (tmux-style polling).

Time runs ``--speedup`` times faster than on the simulated GPU (tool waits too),
so a run takes a few minutes on 2 cores; rates are reported in GPU time
(wall rate / speedup). Printed per configuration: instances/s (rollouts
finished per second), busy fraction and prefix-cache hit rate of the
backends, and the ratio to ``full``, beside the paper's figures.

    python benchmarks/table3.py [--steps 3] [--groups 32] [--n 4] [--target 4] [--speedup 40] [--only full,tmux]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prorl_cli.embedded import LocalStack  # noqa: E402
from prorl_cli.exceptions import ConfigError  # noqa: E402

BACKENDS = 4
CONFIGS: dict[str, dict[str, Any]] = {
    "full": {},
    "round_robin": {"broker": {"routing_policy": "round_robin"}},
    "ever_assigned": {"broker": {"routing_policy": "ever_assigned"}},
    "no_cleanup": {"broker": {"cancel_propagation": False}},
    "tmux": {},
}
# The paper's Table 3 (instances/s, GPU utilisation; tmux: seconds per action).
PAPER = {
    "full": (0.37, 0.78),
    "round_robin": (0.30, 0.65),  # the paper's "without load balancing"
    "ever_assigned": (None, None),
    "no_cleanup": (0.25, 0.42),
    "tmux": (None, None),  # the paper reports 0.78 s vs 0.42 s per action, not throughput
}


@dataclass
class Outcome:
    config: str
    wall_s: float
    finished: int
    cancelled: int
    steps: int
    instances_per_s: float  # GPU time
    busy_fraction: float
    prefix_hit_rate: float
    aborted_calls: int
    skipped: str | None = None


def workload(seed: int, steps: int, groups: int, n: int, tool_median_s: float, speedup: float,
             action_delay_s: float) -> list[list[list[dict[str, Any]]]]:
    """Steps of groups of rollout instances; each rollout pinned by its own seed."""
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        step = []
        for g in range(groups):
            # Task difficulty: some always solved, some never (uninformative), most in between.
            p_solve = rng.choice([0.0, 0.0, 1.0, 0.2, 0.4, 0.5, 0.6, 0.8])
            step.append([{
                "rollout_seed": f"{seed}:{s}:{g}:{i}", "turns": [10, 40], "prompt_tokens": 2000,
                "output_tokens": {"median": 150, "sigma": 0.6, "max": 1024},
                "observation_tokens": {"median": 500, "sigma": 1.0, "max": 6000},
                "tool_s": {"median": tool_median_s, "sigma": 1.0, "max": 60.0},
                "action_delay_s": action_delay_s, "time_scale": speedup, "p_solve": p_solve,
            } for i in range(n)])
        out.append(step)
    return out


def config_supported(extra: dict[str, Any]) -> str | None:
    """None when this prorl accepts the configuration's keys, else why not."""
    from prorl_cli.config import load_config

    path = Path(tempfile.mkstemp(suffix=".yaml")[1])
    try:
        import yaml

        path.write_text(yaml.safe_dump(extra))
        load_config(path)
    except ConfigError as e:
        return str(e)
    finally:
        path.unlink()
    return None


def backend_totals(stack: LocalStack) -> dict[str, float]:
    totals: dict[str, float] = {}
    for b in stack.client.status().backends:
        for k, v in (b.get("stats") or {}).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return totals


#: Configurations whose trainer cancels the rest of a step on early termination.
TRAINER_CANCELS = {name: name != "no_cleanup" for name in CONFIGS}


def run_config(name: str, args: argparse.Namespace, home: Path) -> Outcome:
    extra = CONFIGS[name]
    why = config_supported(extra)
    if why:
        return Outcome(name, 0, 0, 0, 0, 0, 0, 0, 0, skipped=why)
    delay = args.tmux_delay_s if name == "tmux" else 0.0
    steps = workload(args.seed, args.steps, args.groups, args.n, args.tool_median_s, args.speedup, delay)
    per_step = args.groups * args.n
    config = {
        "broker": {"heartbeat_interval_s": 0.5, "journal": False, **extra.get("broker", {})},
        # Room for a step and the stale jobs of earlier ones (no_cleanup); more wait in the broker's queue.
        "node": {"n_init": 16, "n_run": per_step * 2, "n_eval": 16, "stop_grace_s": 3.0},
        "jobs": {"timeout_s": 3600.0},
        "inference": {"generate_timeout_s": 3600.0, "sim_speedup": args.speedup, "capacity": 256},
        "log_level": "WARNING",
    }
    with LocalStack(home / name, "t3", config) as stack:
        stack.start_broker()
        stack.start_node("node-0")
        for i in range(BACKENDS):
            bid = f"sim-{i}"
            stack.spawn(bid, "serve", "inference", "--engine", "sim", "--backend-id", bid)
        stack.wait_for(lambda st: sum(b["alive"] for b in st.backends) == BACKENDS, 60.0,
                       "the sim bridges to register", "sim-0")
        client = stack.client
        time.sleep(1.2)  # a first heartbeat with stats from every bridge
        before = backend_totals(stack)
        started = time.monotonic()
        finished = cancelled = 0
        for k, step in enumerate(steps):
            step_started = time.monotonic()
            flat = [inst for group in step for inst in group]
            ids = client.submit("sim_agent", flat, n=1, timeout_s=3600.0)
            group_of = {jid: i // args.n for i, jid in enumerate(ids)}
            rewards: dict[int, list[float]] = {}
            informative = 0
            remaining = set(ids)
            for res in client.as_completed(ids, timeout_s=3600.0):
                remaining.discard(res.job_id)
                if res.state != "done":
                    continue
                finished += 1
                g = group_of[res.job_id]
                rewards.setdefault(g, []).append(float(res.reward or 0.0))
                if len(rewards[g]) == args.n and len(set(rewards[g])) > 1:
                    informative += 1
                    if informative >= args.target:
                        break
            cancel_s = 0.0
            if remaining and TRAINER_CANCELS[name]:  # DAPO early termination: the step has what it needs
                t = time.monotonic()
                client.cancel(sorted(remaining))
                cancel_s = time.monotonic() - t
                cancelled += len(remaining)
            if args.verbose:
                print(f"  {name} step {k}: {time.monotonic() - step_started:.1f} s, {len(remaining)} left running, "
                      f"cancel {cancel_s:.2f} s", flush=True)
        wall_s = time.monotonic() - started
        time.sleep(1.2)  # the bridges' next heartbeat covers the end of the run
        after = backend_totals(stack)
        stack.stop()
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return Outcome(
        config=name, wall_s=round(wall_s, 1), finished=finished, cancelled=cancelled, steps=len(steps),
        instances_per_s=round(finished / wall_s / args.speedup, 4),
        busy_fraction=round(d.get("busy_s", 0) / d["elapsed_s"], 3) if d.get("elapsed_s") else 0.0,
        prefix_hit_rate=round(d.get("cached_tokens", 0) / d["prompt_tokens"], 3) if d.get("prompt_tokens") else 0.0,
        aborted_calls=int(d.get("aborted", 0)),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--target", type=int, default=4, help="informative groups that end a step")
    ap.add_argument("--speedup", type=float, default=40.0, help="simulated time runs this many times faster")
    ap.add_argument("--tool-median-s", type=float, default=1.0, help="median tool time per action (GPU time)")
    ap.add_argument("--tmux-delay-s", type=float, default=0.36,
                    help="extra per action in the tmux configuration (the paper: 0.78 s vs 0.42 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations")
    ap.add_argument("--json", type=Path, help="also write the outcomes here")
    ap.add_argument("--verbose", action="store_true", help="print each step's time")
    args = ap.parse_args()
    names = [c for c in args.only.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="prorl-table3-") as tmp:
        for name in names:
            print(f"running {name} ...", flush=True)
            outcomes.append(run_config(name, args, Path(tmp)))
    full = next((o for o in outcomes if o.config == "full" and not o.skipped), None)
    print(f"\nTable 3 replay: {BACKENDS} simulated H100/8B backends, {args.steps} DAPO steps of {args.groups}x{args.n} "
          f"rollouts (stop at {args.target} informative groups), time x{args.speedup:g}")
    print(f"{'config':<14}{'inst/s':>8}{'ratio':>7}{'busy':>7}{'ratio':>7}{'prefix hit':>11}{'aborted':>9}"
          f"{'done':>6}{'wall s':>8}   paper inst/s, util")
    for o in outcomes:
        paper = PAPER[o.config]
        paper_s = f"{paper[0]}, {paper[1]:.0%}" if paper[0] is not None and paper[1] is not None else "-"
        if o.skipped:
            print(f"{o.config:<14}skipped: {o.skipped}")
            continue
        r_i = f"{o.instances_per_s / full.instances_per_s:.2f}" if full and full.instances_per_s else "-"
        r_b = f"{o.busy_fraction / full.busy_fraction:.2f}" if full and full.busy_fraction else "-"
        print(f"{o.config:<14}{o.instances_per_s:>8.3f}{r_i:>7}{o.busy_fraction:>7.0%}{r_b:>7}{o.prefix_hit_rate:>11.0%}"
              f"{o.aborted_calls:>9}{o.finished:>6}{o.wall_s:>8.1f}   {paper_s}")
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))


if __name__ == "__main__":
    main()
