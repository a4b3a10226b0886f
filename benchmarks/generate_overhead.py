"""Added latency of prorl's generate path against calling vLLM's HTTP API directly.

One run starts vLLM on the CPU (the tiny model, or ``--model DIR``; or uses
``--url`` of a running server), a broker, a node and a bridge (real
processes), and runs a job whose handler (defined below) alternates, from
the same worker process and event loop:

* ``ctx.generate``: worker → broker → bridge → vLLM → bridge → broker → worker
* a direct ``POST /v1/completions`` with the same token ids from that worker
* a ``ping`` to the broker from a client in that worker (worker → broker →
  worker: one of the two ZeroMQ round trips the bridge path makes)

and prints p50/p99 of each and of the difference, with the added time split
into the two broker round trips (node ↔ broker, priced by the ping; broker
↔ bridge, about the same) and the rest (the bridge's own work and its HTTP
client against the worker's). Then it stops the bridge, registers the same
vLLM as a plain HTTP backend (``add_llm_server``: the broker routes, the
worker calls vLLM itself, one broker round trip) and measures again.
``--max-tokens 1`` (the default) makes the model's own time as small as it
gets, so the figure is the transport overhead.

``--engine echo`` replaces vLLM by a bridge whose engine answers at once
(one token, no HTTP): what is left is prorl's own path, without vLLM's
time and noise (no direct call then; "added" is the whole call).

``--baseline-tree DIR`` (say ``/work/main``, or ``git archive`` of an older
commit) runs that tree's broker, node and bridge and this one's side by
side in the same run (against the same vLLM), alternates batches of
``--calls`` between them ``--rounds`` times, and prints the p50 added by
each and their ratio: batches seconds apart see the same machine load.

    python benchmarks/generate_overhead.py [--calls 300] [--max-tokens 1] [--model DIR | --url URL]
    python benchmarks/generate_overhead.py --baseline-tree /work/main [--rounds 6 --calls 100] [--url URL]
    python benchmarks/generate_overhead.py --engine echo --baseline-tree /work/main
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prorl_cli.inference.contract import Engine, Generation
from prorl_cli.node.handler import AgentHandler, JobContext
from prorl_cli.protocol import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


class GenerateOverheadHandler(AgentHandler):
    """Benchmark handler: times ``ctx.generate`` and a direct HTTP call, alternately."""

    name = "generate_overhead"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> None:
        from prorl_cli.client import AsyncRolloutClient
        from prorl_cli.inference.openai_engine import OpenAIEngine

        inst = ctx.instance
        direct = OpenAIEngine(inst["url"]) if inst["url"] else None
        if direct is not None:
            await direct.start()
        prompt = list(range(10, 10 + int(inst["prompt_len"])))
        sampling = SamplingParams(max_tokens=int(inst["max_tokens"]), temperature=0.0)
        via, raw, ping = [], [], []
        async with AsyncRolloutClient(inst["deployment"], address=inst["address"]) as client:
            for i in range(int(inst["warmup"]) + int(inst["calls"])):
                t0 = time.perf_counter()
                await ctx.generate(prompt, sampling)
                t1 = time.perf_counter()
                if direct is not None:
                    await direct.generate(prompt, sampling)
                t2 = time.perf_counter()
                await client.ping()
                t3 = time.perf_counter()
                if i >= int(inst["warmup"]):
                    via.append(t1 - t0)
                    raw.append(t2 - t1)
                    ping.append(t3 - t2)
        if direct is not None:
            await direct.close()
        ctx.output.update(via_s=via, direct_s=raw, ping_s=ping)

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 1.0


class EchoEngine(Engine):
    """Answers every call at once with one token: the bridge path without a model (``--engine echo``)."""

    model = "echo"
    max_model_len = 1 << 16

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        return Generation([7], [-0.5], "length", None)


async def serve_echo_bridge(address: str, deployment_dir: str) -> None:
    """The ``--engine echo`` bridge (a child process): the real :class:`InferenceBridge` over :class:`EchoEngine`."""
    from prorl_cli.inference.bridge import InferenceBridge

    bridge = InferenceBridge(EchoEngine(), address=address, backend_id="b1", host=socket.gethostname(),
                             deployment_dir=Path(deployment_dir))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, bridge.stop)
    await bridge.serve()


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


ROLES = ("broker", "n1", "bridge")


def per_call(cpu: list[float]) -> float:
    """CPU seconds per call from ``[seconds, calls, seconds, calls, ...]`` (rounds pooled)."""
    return sum(cpu[0::2]) / max(1.0, sum(cpu[1::2]))


def _cpu_s(d: Any) -> dict[str, float]:
    """CPU seconds (user + system, all threads) each of the deployment's processes has used so far."""
    import psutil

    out = {}
    for name in ROLES:
        proc = d.procs.get(name)
        if proc is not None and proc.poll() is None:
            t = psutil.Process(proc.pid).cpu_times()
            out[name] = t.user + t.system
    return out


def measure(d: Any, inst: dict[str, Any]) -> dict[str, list[float]]:
    """Run the benchmark job once; its samples (seconds), and each process's CPU per call (``cpu_<role>``)."""
    before = _cpu_s(d)
    res = d.client.process("generate_overhead", inst, timeout_s=3600)
    after = _cpu_s(d)
    if not res.ok:
        sys.exit(f"benchmark job failed: {res.error}\n{d.log('n1')}")
    via, raw, ping = res.output["via_s"], res.output["direct_s"], res.output["ping_s"]
    n = int(inst["calls"]) + int(inst["warmup"])
    # CPU per loop iteration of the job (one generate, one ping, one direct call), job start and end included;
    # kept as (seconds, iterations) so that rounds add up before dividing (the OS counts CPU in 10 ms ticks).
    cpu = {f"cpu_{k}": [after[k] - before[k], n] for k in before if k in after}
    return {"direct": raw, "via": via, "ping": ping, "added": [v - r for v, r in zip(via, raw, strict=True)], **cpu}


def print_table(path: str, s: dict[str, list[float]]) -> None:
    rest = [a - 2 * p for a, p in zip(s["added"], s["ping"], strict=True)]
    print(f"\n  {path}")
    print(f"  {'path':<44}{'p50 ms':>10}{'p99 ms':>10}")
    cpu = ", ".join(f"{r} {1e6 * per_call(s[f'cpu_{r}']):.0f}" for r in ROLES if s.get(f"cpu_{r}"))
    print(f"  CPU per call (us, one generate + one ping + one direct call): {cpu}")
    for name, vals in (("direct HTTP to vLLM", s["direct"]), ("through prorl", s["via"]),
                       ("added by prorl (paired difference)", s["added"]),
                       ("  broker ping round trip from the worker", s["ping"]),
                       ("  added - 2 x ping", rest)):
        print(f"  {name:<44}{1000 * pct(vals, 50):>10.2f}{1000 * pct(vals, 99):>10.2f}")
    if pct(s["direct"], 50) > 0:
        print(f"  ratio of p50s: {pct(s['via'], 50) / pct(s['direct'], 50):.2f}x", flush=True)


def _deployment(work: Path, tree: Path | None) -> Any:
    """A deployment whose children import prorl from ``tree`` (default: the prorl this script imports)."""
    from prorl_cli.testing import Deployment

    class TreeDeployment(Deployment):
        def env(self) -> dict[str, str]:
            env = super().env()
            if tree is not None:
                env["PYTHONPATH"] = str(tree)
            return env

    return TreeDeployment(work / "home", name="bench")


def set_nice(pid: int, nice: int) -> None:
    """Every thread of ``pid`` at ``nice``, and its session's autogroup too (``--nice``).

    With ``kernel.sched_autogroup_enabled`` (the default) the scheduler first
    shares the cores between sessions, and each child here runs in a session
    of its own: a process's own nice value alone gains nothing against other
    sessions' work.
    """
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    autogroup = Path(f"/proc/{pid}/autogroup")
    if autogroup.exists():
        autogroup.write_text(str(nice))


def backend_id(b: Any) -> str:
    """A status row's backend id: typed rows here, plain dicts in a baseline tree from before typed status."""
    return b["backend_id"] if isinstance(b, dict) else b.backend_id


def start_stack(d: Any, url: str | None, nice: int = 0) -> dict[str, Any]:
    """Broker, node and bridge (vLLM attached, or the echo engine); the benchmark job's instance."""
    d.start_broker()
    d.start_node("n1", "--handlers", str(Path(__file__).resolve()))
    if url is None:
        with open(d.logs / "bridge.log", "ab") as log:
            d.procs["bridge"] = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--serve-echo-bridge", d.address, str(d.deployment_dir)],
                env=d.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    else:
        d.spawn("bridge", "serve", "inference", "--attach", url, "--backend-id", "b1")
    d.wait_for(lambda st: any(backend_id(b) == "b1" for b in st.backends), 120, "bridge", "bridge")
    if nice:
        for proc in d.procs.values():
            set_nice(proc.pid, nice)
    return {"url": url, "deployment": "bench", "address": d.address}


def to_http_backend(d: Any, url: str) -> None:
    """Replace the bridge by the same vLLM as a plain HTTP backend (add_llm_server): the worker calls vLLM itself."""
    d.kill("bridge", signal.SIGTERM)  # it unregisters on the way out
    d.wait_for(lambda st: not st.backends, 60, "the bridge to unregister", "bridge")
    d.client.add_backend(url)


PATHS = {"bridge": "bridge (worker -> broker -> bridge -> engine)", "http": "HTTP backend (broker routes, worker -> vLLM)"}


def run_one(args: argparse.Namespace, url: str | None, work: Path) -> None:
    """One deployment of the prorl this script imports: the bridge path, then (with vLLM) the HTTP-backend path."""
    d = _deployment(work, None)
    try:
        inst = {**start_stack(d, url, args.nice), "calls": args.calls, "warmup": args.warmup, "max_tokens": args.max_tokens,
                "prompt_len": args.prompt_len}
        print_table(PATHS["bridge"], measure(d, inst))
        if url is not None:
            to_http_backend(d, url)
            print_table(PATHS["http"], measure(d, inst))
    finally:
        d.close()


def compare(args: argparse.Namespace, url: str | None, work: Path) -> None:
    """Both trees' deployments up at once; batches of calls alternate between them, ``--rounds`` times.

    Batches a few seconds apart see the same machine, so the ratio holds
    even while the load moves; whole runs minutes apart would not.
    """
    stacks = {"baseline": _deployment(work / "baseline", args.baseline_tree.resolve()), "prorl": _deployment(work / "prorl", ROOT)}
    samples: dict[tuple[str, str], dict[str, list[float]]] = {}
    try:
        insts = {label: {**start_stack(d, url, args.nice), "calls": args.calls, "warmup": args.warmup, "max_tokens": args.max_tokens,
                         "prompt_len": args.prompt_len} for label, d in stacks.items()}
        for path in PATHS if url is not None else ["bridge"]:
            if path == "http":
                assert url is not None
                for d in stacks.values():
                    to_http_backend(d, url)
            for r in range(args.rounds):
                for label, d in stacks.items() if r % 2 == 0 else reversed(stacks.items()):
                    s = measure(d, insts[label])
                    acc = samples.setdefault((label, path), {})
                    for k, v in s.items():
                        acc.setdefault(k, []).extend(v)
                    print(f"  round {r + 1:>2} {label:<9}{PATHS[path]:<48} added p50 {1000 * pct(s['added'], 50):6.2f} ms "
                          f"| ping p50 {1000 * pct(s['ping'], 50):5.2f} ms | load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for d in stacks.values():
            d.close()
    print(f"\n  {args.rounds} rounds x {args.calls} calls per tree and path, pooled; ms")
    print(f"  {'path':<48}{'':<10}{'added p50':>10}{'p99':>9}{'ping p50':>10}{'added-2ping':>13}"
          f"   CPU per call (us): broker, node, bridge")
    for path in PATHS:
        if ("prorl", path) not in samples:
            continue
        for label in stacks:
            s = samples[(label, path)]
            rest = [a - 2 * p for a, p in zip(s["added"], s["ping"], strict=True)]
            print(f"  {PATHS[path]:<48}{label:<10}{1000 * pct(s['added'], 50):>10.3f}{1000 * pct(s['added'], 99):>9.2f}"
                  f"{1000 * pct(s['ping'], 50):>10.3f}{1000 * pct(rest, 50):>13.3f}   "
                  + ", ".join(f"{1e6 * per_call(s[f'cpu_{r}']):.0f}" if s.get(f"cpu_{r}") else "-" for r in ROLES))
        b, p = samples[("baseline", path)]["added"], samples[("prorl", path)]["added"]
        cpu_ratio = "   ".join(
            f"{r} {per_call(samples[('prorl', path)][f'cpu_{r}']) / per_call(samples[('baseline', path)][f'cpu_{r}']):.2f}"
            for r in ROLES if samples[("baseline", path)].get(f"cpu_{r}") and samples[("prorl", path)].get(f"cpu_{r}"))
        print(f"  {'':<48}{'ratio':<10}{pct(p, 50) / pct(b, 50):>10.2f}{pct(p, 99) / pct(b, 99):>9.2f}   CPU: {cpu_ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--engine", choices=["vllm", "echo"], default="vllm",
                    help="vllm (default) or echo: a bridge engine that answers at once (prorl's own path alone)")
    ap.add_argument("--model", help="local model dir for vLLM (default: a tiny model made now)")
    ap.add_argument("--url", help="use a running OpenAI-compatible vLLM server instead of starting one")
    ap.add_argument("--baseline-tree", type=Path, help="also measure the prorl in this source tree, alternating, in this run")
    ap.add_argument("--rounds", type=int, default=6, help="with --baseline-tree: batches of --calls per tree, alternating")
    ap.add_argument("--nice", type=int, default=0,
                    help="run the broker, node and bridge at this nice value (say -10, as root: on a machine others share, "
                         "they then get the cores when they need them, as on a quiet machine)")
    ap.add_argument("--serve-echo-bridge", nargs=2, metavar=("ADDRESS", "DEPLOYMENT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_echo_bridge:
        asyncio.run(serve_echo_bridge(*args.serve_echo_bridge))
        return

    work = Path(tempfile.mkdtemp(prefix="prorl-bench-generate-"))
    server = None
    url = args.url
    if url is None and args.engine == "vllm":
        from prorl_cli.inference.vllm_server import VLLMServer

        model = args.model
        if model is None:
            from prorl_cli.inference.tiny_model import make_tiny_model

            model = str(make_tiny_model(work / "tiny"))
        server = VLLMServer(model, max_model_len=1024, log_path=work / "vllm.log")
        print("starting vLLM on the CPU (about a minute)...", flush=True)
        server.start()
        asyncio.run(server.wait_ready(900))
        url = server.url
        if args.nice and server.proc is not None:
            set_nice(server.proc.pid, args.nice)
    try:
        import prorl_cli

        engine = "an echo engine (no model)" if url is None else "tiny model on vLLM (CPU)"
        print(f"generate overhead: {args.calls} calls, prompt {args.prompt_len} tokens, max_tokens {args.max_tokens}, "
              f"{engine}, one worker, calls in sequence; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
        if args.baseline_tree:
            print(f"baseline: {args.baseline_tree.resolve()}; prorl: {ROOT}")
            compare(args, url, work)
            return
        print(f"prorl from {Path(prorl_cli.__file__).parent.parent}")
        run_one(args, url, work)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
