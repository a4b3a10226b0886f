"""Weight sync: in-place reload vs restarting the bridge, for the tiny model on the CPU.

A real broker and a real bridge (``prorl serve inference --engine
transformers``, or ``--engine vllm``: a vLLM child). Each round hands the
bridge new weights two ways, timed from the trainer's call until the bridge
serves again:

* reload: ``client.update_weights(checkpoint, policy_version=N)`` (the
  transformers bridge loads the state dict into its live model; the vLLM
  bridge calls vLLM's ``POST /collective_rpc`` ``prorl_reload_weights``);
* restart: SIGTERM the bridge, start a new one on the checkpoint, wait until
  it has registered and answered a first call (what ``examples/train_tiny_grpo.py``
  did before reload existed; the fallback for engines that cannot reload).

Both end with one greedy generate through the broker, so each includes the
first call's latency. Prints median and spread, and the ratio restart/reload.
Each greedy answer after a reload is also checked against the answer of a
bridge started fresh on the same checkpoint (``reload output == fresh``).

    python benchmarks/weight_sync.py                 # 5 rounds
    python benchmarks/weight_sync.py --rounds 2      # a quick look
    python benchmarks/weight_sync.py --engine vllm --rounds 2
    python benchmarks/weight_sync.py --bridges 2 --slurm --rounds 2

``--slurm`` measures a trainer's step boundary on a launched deployment
(``prorl launch`` on the Slurm here: a broker, one node task, ``--bridges``
inference tasks on the tiny model): the sync (pause with drain, every
bridge loads the checkpoint in place, resume, one greedy call answered)
against restarting the inference array (``scontrol requeue`` of every
inference task, made eligible at once as the supervisor does; each comes
back on ``inference.model``, is sent the current checkpoint by the broker
and loads it, as a restart on that checkpoint would; then one call
answered). Both alternate over the rounds.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--slurm", action="store_true", help="a launched deployment on this Slurm (a step boundary)")
    ap.add_argument("--bridges", type=int, default=2, help="--slurm: inference tasks (default 2)")
    args = ap.parse_args(argv)
    if args.slurm:
        return run_slurm(args)

    from prorl_cli.inference.tiny_model import make_tiny_model
    from prorl_cli.testing import Deployment

    with tempfile.TemporaryDirectory(prefix="prorl-weight-sync-") as tmp:
        root = Path(tmp)
        ckpts = [make_tiny_model(root / f"v{i}", seed=i) for i in range(2)]
        d = Deployment(root / "home", config={"inference": {"generate_timeout_s": 120.0}})
        try:
            d.start_broker()
            d.start_node("n1", "--handlers", str(REPO / "tests" / "inference" / "handlers"))
            greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
            engine_args = ["--engine", args.engine]
            if args.engine == "vllm":
                engine_args += ["--max-model-len", "256"]
            fresh: dict[int, list[int]] = {}  # checkpoint -> greedy answer of a bridge started on it
            after_reload: list[tuple[int, list[int]]] = []

            def first_call() -> list[int]:
                (res,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling=greedy), timeout_s=600)
                assert res.ok and "error" not in res.output, res
                return list(res.output["outputs"][0])

            def start(name: str, backend_id: str, ckpt: Path) -> None:
                d.spawn(name, "serve", "inference", *engine_args, "--model", str(ckpt), "--backend-id", backend_id)
                d.wait_for(lambda st: any(b.backend_id == backend_id and b.alive for b in st.backends), 900,
                           f"bridge {backend_id}", name)

            t0 = time.perf_counter()
            start("bridge-0", "b0", ckpts[0])
            fresh[0] = first_call()
            first_start_s = time.perf_counter() - t0
            print(f"first start: {first_start_s:.2f} s", flush=True)
            reload_s: list[float] = []
            restart_s: list[float] = []
            current = "bridge-0"
            version = 0
            # Round r restarts on checkpoint r % 2, then reloads the other one: every reload's
            # answer can be checked against a bridge that started fresh on its checkpoint.
            for r in range(1, args.rounds + 1):
                version += 1
                t0 = time.perf_counter()
                d.kill(current, signal.SIGTERM)
                current = f"bridge-{r}"
                start(current, f"b{r}", ckpts[r % 2])
                fresh[r % 2] = first_call()
                restart_s.append(time.perf_counter() - t0)
                version += 1
                t0 = time.perf_counter()
                done = d.client.update_weights(ckpts[(r + 1) % 2], policy_version=version, timeout_s=600)
                after_reload.append(((r + 1) % 2, first_call()))
                reload_s.append(time.perf_counter() - t0)
                assert done.updated, done
                print(f"round {r}: reload {reload_s[-1]:.2f} s, restart {restart_s[-1]:.2f} s", flush=True)
        finally:
            d.close()
    med_reload, med_restart = statistics.median(reload_s), statistics.median(restart_s)
    checked = [out == fresh[ck] for ck, out in after_reload if ck in fresh]
    print(f"\nengine: {args.engine}; reload output == fresh: {sum(checked)}/{len(checked)} answers")
    print(f"machine: {platform.machine()}, {platform.python_version()}, {platform.node()}")
    print(f"reload  (update_weights + first call): median {med_reload:.2f} s, min {min(reload_s):.2f}, max {max(reload_s):.2f}")
    print(f"restart (new bridge + first call):     median {med_restart:.2f} s, min {min(restart_s):.2f}, max {max(restart_s):.2f}")
    print(f"first start (bridge + first call):     {first_start_s:.2f} s")
    print(f"restart / reload: {med_restart / med_reload:.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"engine": args.engine, "reload_s": reload_s, "restart_s": restart_s,
                                               "first_start_s": first_start_s,
                                               "reload_matches_fresh": checked}, indent=1))
    return 0 if all(checked) else 1


def run_slurm(args: argparse.Namespace) -> int:
    """A step boundary on a launched deployment: in-place sync vs restarting the inference array."""
    import os
    import subprocess

    import yaml

    from prorl_cli.client import RolloutClient
    from prorl_cli.config import load_config
    from prorl_cli.inference.tiny_model import make_tiny_model
    from prorl_cli.slurm import squeue
    from prorl_cli.slurm.record import LaunchRecord

    name = "wsync"
    with tempfile.TemporaryDirectory(prefix="prorl-weight-sync-slurm-") as tmp:
        root = Path(tmp)
        ckpts = [make_tiny_model(root / f"v{i}", seed=i) for i in range(2)]
        home = root / "home"
        config = root / "prorl.yaml"
        config.write_text(yaml.safe_dump({
            "broker": {"heartbeat_interval_s": 0.5, "heartbeat_liveness": 6},
            "node": {"n_init": 2, "n_run": 4, "n_eval": 2, "handler_paths": [str(REPO / "tests" / "inference" / "handlers")]},
            "inference": {"tokenizer": str(ckpts[0]), "generate_timeout_s": 300.0},
        }))
        deploy = root / "deploy.yaml"
        deploy.write_text(yaml.safe_dump({
            "deployment": name, "home": str(home), "config": str(config), "rendezvous_wait_s": 600,
            "broker": {"time": "60", "cpus_per_task": 1, "mem_gb": 0.5},
            "nodes": {"count": 1, "time": "60", "cpus_per_task": 1, "mem_gb": 1},
            "inference": {"count": args.bridges, "time": "60", "cpus_per_task": 1, "mem_gb": 1, "gpus_per_task": 1,
                          "engine": args.engine, "model": str(ckpts[0]),
                          **({"max_model_len": 256} if args.engine == "vllm" else {})},
        }))
        env = {**os.environ, "PRORL_HOME": str(home)}
        prorl = [sys.executable, "-m", "prorl_cli"]
        t0 = time.perf_counter()
        up = subprocess.run([*prorl, "launch", str(deploy), "--wait-s", "900"], env=env, capture_output=True, text=True,
                            check=False)
        if up.returncode != 0:
            print(up.stdout[-3000:], up.stderr[-3000:])
            subprocess.run([*prorl, "down", name], env=env, check=False)
            return 1
        launch_s = time.perf_counter() - t0
        record = LaunchRecord.load(home / name)
        assert record is not None
        client = RolloutClient(name, config=load_config(overrides={"home": str(home), "deployment": name}))
        greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        sync_s: list[float] = []
        parts: dict[str, list[float]] = {"drain": [], "reload": [], "resume": [], "first call": []}
        restart_s: list[float] = []

        def first_call() -> None:
            (res,) = client.wait(client.submit("calls", [{"calls": 1}], sampling=greedy), timeout_s=600)
            assert res.ok and "error" not in res.output, res

        def serving(version: int) -> bool:
            bridges = [b for b in client.list_backends() if b.kind == "bridge" and b.alive and not b.loading]
            return len(bridges) == args.bridges and all(b.policy_version == version for b in bridges)

        try:
            first_call()
            for version in range(1, args.rounds + 1):
                r = version
                marks = [time.perf_counter()]
                client.pause_generation(policy_version=version, wait=True, timeout_s=300)
                marks.append(time.perf_counter())
                done = client.update_weights(str(ckpts[version % 2]), policy_version=version, timeout_s=600)
                assert len(done.updated) == args.bridges, done
                marks.append(time.perf_counter())
                client.resume_generation(policy_version=version)
                marks.append(time.perf_counter())
                first_call()
                marks.append(time.perf_counter())
                for key, a, b in zip(parts, marks, marks[1:], strict=False):
                    parts[key].append(b - a)
                sync_s.append(marks[-1] - marks[0])

                t0 = time.perf_counter()
                jobs = [m.job_id for m in record.members if m.role == "inference"]
                for job in jobs:
                    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True)
                deadline = time.monotonic() + 900
                while any(b.kind == "bridge" and b.alive for b in client.list_backends()):  # they leave first
                    time.sleep(0.1)
                while not serving(version):
                    for job in jobs:
                        squeue.release_requeued(job)  # as the supervisor does, without its 5 s poll
                    if time.monotonic() > deadline:
                        raise TimeoutError("the requeued inference tasks did not come back")
                    time.sleep(0.2)
                first_call()
                restart_s.append(time.perf_counter() - t0)
                print(f"round {r}: step-boundary sync {sync_s[-1]:.2f} s, array restart {restart_s[-1]:.2f} s", flush=True)
        finally:
            client.close()
            subprocess.run([*prorl, "down", name], env=env, capture_output=True, check=False)
            squeue.cancel(t.job_id for t in squeue.active(record.job_ids))
    med_sync, med_restart = statistics.median(sync_s), statistics.median(restart_s)
    load = os.getloadavg()
    print(f"\nslurm: {args.bridges} bridges ({args.engine}, tiny model), launch {launch_s:.1f} s; "
          f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {load[0]:.1f}")
    print(f"step-boundary sync (drain + reload all + resume + first call): median {med_sync:.2f} s, "
          f"min {min(sync_s):.2f}, max {max(sync_s):.2f}")
    print("  of which " + ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in parts.items()))
    print(f"restart of the inference array (+ first call): median {med_restart:.2f} s, "
          f"min {min(restart_s):.2f}, max {max(restart_s):.2f}")
    print(f"restart / sync: {med_restart / med_sync:.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"slurm": True, "bridges": args.bridges, "engine": args.engine,
                                         "sync_s": sync_s, "parts_s": parts, "restart_s": restart_s,
                                         "launch_s": launch_s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
