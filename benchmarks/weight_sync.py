"""Weight sync: in-place reload vs restarting the bridge, for the tiny model on the CPU.

A real broker and a real transformers bridge (``prorl serve inference
--engine transformers``). Each round hands the bridge new weights two ways,
timed from the trainer's call until the bridge serves again:

* reload: ``client.update_weights(checkpoint, policy_version=N)`` (the bridge
  loads the state dict into its live model);
* restart: SIGTERM the bridge, start a new one on the checkpoint, wait until
  it has registered and answered a first call (what ``examples/train_tiny_grpo.py``
  did before reload existed; the fallback for engines that cannot reload).

Both end with one greedy generate through the broker, so each includes the
first call's latency. Prints median and spread, and the ratio restart/reload.

    python benchmarks/weight_sync.py                 # 5 rounds
    python benchmarks/weight_sync.py --rounds 2      # a quick look
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
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)

    from prorl_cli.inference.tiny_model import make_tiny_model
    from tests.harness import Deployment

    with tempfile.TemporaryDirectory(prefix="prorl-weight-sync-") as tmp:
        root = Path(tmp)
        ckpts = [make_tiny_model(root / f"v{i}", seed=i) for i in range(2)]
        d = Deployment(root / "home", config={"inference": {"generate_timeout_s": 120.0}})
        try:
            d.start_broker()
            d.start_node("n1", "--handlers", str(REPO / "tests" / "inference" / "handlers"))
            greedy = {"max_tokens": 4, "temperature": 0.0}

            def first_call() -> None:
                (res,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling=greedy), timeout_s=300)
                assert res.ok and "error" not in res.output, res

            def start(name: str, backend_id: str, ckpt: Path) -> None:
                d.spawn(name, "serve", "inference", "--engine", "transformers", "--model", str(ckpt), "--backend-id", backend_id)
                d.wait_for(lambda st: any(b.backend_id == backend_id and b.alive for b in st.backends), 300,
                           f"bridge {backend_id}", name)

            start("bridge-0", "b0", ckpts[0])
            first_call()
            reload_s: list[float] = []
            restart_s: list[float] = []
            current = "bridge-0"
            version = 0
            for r in range(args.rounds):
                version += 1
                t0 = time.perf_counter()
                done = d.client.update_weights(ckpts[version % 2], policy_version=version)
                first_call()
                reload_s.append(time.perf_counter() - t0)
                assert done.updated, done
                version += 1
                t0 = time.perf_counter()
                d.kill(current, signal.SIGTERM)
                current = f"bridge-{r + 1}"
                start(current, f"b{r + 1}", ckpts[version % 2])
                first_call()
                restart_s.append(time.perf_counter() - t0)
                print(f"round {r + 1}: reload {reload_s[-1]:.2f} s, restart {restart_s[-1]:.2f} s", flush=True)
        finally:
            d.close()
    med_reload, med_restart = statistics.median(reload_s), statistics.median(restart_s)
    print(f"\nmachine: {platform.machine()}, {platform.python_version()}, {platform.node()}")
    print(f"reload  (update_weights + first call): median {med_reload:.2f} s, min {min(reload_s):.2f}, max {max(reload_s):.2f}")
    print(f"restart (new bridge + first call):     median {med_restart:.2f} s, min {min(restart_s):.2f}, max {max(restart_s):.2f}")
    print(f"restart / reload: {med_restart / med_reload:.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"reload_s": reload_s, "restart_s": restart_s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
