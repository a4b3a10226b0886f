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
    args = ap.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
