"""Scaling on Slurm: rollouts/s with 1, 2 and 4 node servers launched as Slurm array tasks.

The handler's time is waiting (the scripted ``test`` handler sleeping in RUN,
standing in for tool and model latency), so the host's cores are not the
limit; each node runs ``--n-run`` jobs at once. For each size this launches a
real deployment with ``prorl launch`` (broker on this machine, nodes as one
array), submits ``--jobs-per-node`` jobs per node, and takes it down with
``prorl down``. Printed per size: rollouts/s, the linear figure (k times the
1-node rate: the baseline), efficiency against it, time from ``prorl launch``
to every node registered, and from ``prorl down`` to an empty squeue.

    python benchmarks/scaling.py [--sizes 1 2 4] [--run-s 1.0] [--n-run 8] [--jobs-per-node 64]

Needs a Slurm controller (scripts/provision/50-slurm.sh starts one with
three fake nodes on this host).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from prorl_cli.client import RolloutClient
from prorl_cli.config import load_config
from prorl_cli.slurm.squeue import slurm_available


def prorl(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prorl_cli", "--home", str(home), *args],
                          capture_output=True, text=True, check=False)


def run_size(base: Path, k: int, args: argparse.Namespace) -> dict[str, float]:
    name = f"scale{k}"
    home = base / "home"
    config = base / f"prorl-{k}.yaml"
    config.write_text(yaml.safe_dump({
        "broker": {"heartbeat_interval_s": 0.5, "heartbeat_liveness": 6},
        "node": {"n_init": 4, "n_run": args.n_run, "n_eval": 4, "credit": args.n_run + 8, "handler_paths": ["prorl_cli.testing.handlers"]},
        "log_level": "WARNING",
    }))
    deploy = base / f"deploy-{k}.yaml"
    deploy.write_text(yaml.safe_dump({
        "deployment": name, "home": str(home), "config": str(config),
        "broker": {"where": "here", "bind_host": "127.0.0.1"},
        "nodes": {"count": k, "time": "30", "cpus_per_task": 1, "mem_gb": 0.5, "sandbox_runtime": "bwrap"},
    }))
    t0 = time.perf_counter()
    up = prorl(home, "launch", str(deploy), "--wait-s", "300")
    launch_s = time.perf_counter() - t0
    if up.returncode != 0:
        raise SystemExit(f"launch of {k} node(s) failed:\n{up.stderr}")
    try:
        n_jobs = args.jobs_per_node * k
        with RolloutClient(name, config=load_config(overrides={"home": str(home), "deployment": name})) as client:
            t1 = time.perf_counter()
            ids = client.submit("test", [{"sleep_s": {"run": args.run_s}}] * n_jobs, timeout_s=600)
            results = client.wait(ids, timeout_s=1200)
            elapsed = time.perf_counter() - t1
        bad = [r.state for r in results if r.state != "done"]
        if bad:
            raise SystemExit(f"{len(bad)} job(s) not done: {set(bad)}")
    finally:
        t2 = time.perf_counter()
        down = prorl(home, "down", name)
        down_s = time.perf_counter() - t2
        if down.returncode != 0:
            print(f"warning: down of {name} failed: {down.stderr}", file=sys.stderr)
    return {"rate": n_jobs / elapsed, "launch_s": launch_s, "down_s": down_s, "jobs": n_jobs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--run-s", type=float, default=1.0, help="Seconds each job waits in RUN.")
    ap.add_argument("--n-run", type=int, default=8, help="RUN pool size per node.")
    ap.add_argument("--jobs-per-node", type=int, default=64)
    args = ap.parse_args()
    if not slurm_available():
        raise SystemExit("no Slurm controller here (scripts/provision/50-slurm.sh starts one)")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"handler: test, {args.run_s} s waiting in RUN; n_run {args.n_run} per node; "
          f"ideal per node {args.n_run / args.run_s:.1f} rollouts/s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="prorl-scaling-") as tmp:
        for k in args.sizes:
            rows.append((k, run_size(Path(tmp), k, args)))
    one = next((r["rate"] for k, r in rows if k == 1), rows[0][1]["rate"] / rows[0][0])
    print(f"{'nodes':>5} {'jobs':>5} {'rollouts/s':>11} {'linear':>8} {'efficiency':>10} {'launch->registered s':>21} {'down->empty s':>14}")
    for k, r in rows:
        linear = one * k
        print(f"{k:>5} {r['jobs']:>5.0f} {r['rate']:>11.2f} {linear:>8.2f} {r['rate'] / linear:>10.0%} "
              f"{r['launch_s']:>21.1f} {r['down_s']:>14.1f}")


if __name__ == "__main__":
    main()
