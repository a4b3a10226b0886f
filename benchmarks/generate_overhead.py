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

    python benchmarks/generate_overhead.py [--calls 300] [--max-tokens 1] [--model DIR | --url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("PYTHONPATH"):
    # The broker, node and bridge are `python -m prorl_cli` children: make them import this checkout too.
    os.environ["PYTHONPATH"] = str(ROOT)
    sys.path.insert(0, str(ROOT))

from prorl_cli.node.handler import AgentHandler, JobContext  # noqa: E402
from prorl_cli.protocol import SamplingParams  # noqa: E402


class GenerateOverheadHandler(AgentHandler):
    """Benchmark handler: times ``ctx.generate`` and a direct HTTP call, alternately."""

    name = "generate_overhead"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> None:
        from prorl_cli.client import AsyncRolloutClient
        from prorl_cli.inference.openai_engine import OpenAIEngine

        inst = ctx.instance
        direct = OpenAIEngine(inst["url"])
        await direct.start()
        prompt = list(range(10, 10 + int(inst["prompt_len"])))
        sampling = SamplingParams(max_tokens=int(inst["max_tokens"]), temperature=0.0)
        via, raw, ping = [], [], []
        async with AsyncRolloutClient(inst["deployment"], address=inst["address"]) as client:
            for i in range(int(inst["warmup"]) + int(inst["calls"])):
                t0 = time.perf_counter()
                await ctx.generate(prompt, sampling)
                t1 = time.perf_counter()
                await direct.generate(prompt, sampling)
                t2 = time.perf_counter()
                await client.ping()
                t3 = time.perf_counter()
                if i >= int(inst["warmup"]):
                    via.append(t1 - t0)
                    raw.append(t2 - t1)
                    ping.append(t3 - t2)
        await direct.close()
        ctx.output.update(via_s=via, direct_s=raw, ping_s=ping)

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 1.0


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def measure(d: Any, inst: dict[str, Any], path: str) -> None:
    """Run the benchmark job once and print its table."""
    res = d.client.process("generate_overhead", inst, timeout_s=3600)
    if not res.ok:
        sys.exit(f"benchmark job failed: {res.error}\n{d.log('n1')}")
    via, raw, ping = res.output["via_s"], res.output["direct_s"], res.output["ping_s"]
    added = [v - r for v, r in zip(via, raw, strict=True)]
    rest = [a - 2 * p for a, p in zip(added, ping, strict=True)]
    print(f"\n  {path}")
    print(f"  {'path':<44}{'p50 ms':>10}{'p99 ms':>10}")
    for name, vals in (("direct HTTP to vLLM", raw), ("through prorl", via),
                       ("added by prorl (paired difference)", added),
                       ("  broker ping round trip from the worker", ping),
                       ("  added - 2 x ping", rest)):
        print(f"  {name:<44}{1000 * pct(vals, 50):>10.2f}{1000 * pct(vals, 99):>10.2f}")
    print(f"  ratio of p50s: {pct(via, 50) / pct(raw, 50):.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--model", help="local model dir for vLLM (default: a tiny model made now)")
    ap.add_argument("--url", help="use a running OpenAI-compatible vLLM server instead of starting one")
    args = ap.parse_args()

    from prorl_cli.testing import Deployment

    work = Path(tempfile.mkdtemp(prefix="prorl-bench-generate-"))
    server = None
    url = args.url
    if url is None:
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
    d = Deployment(work / "home", name="bench")
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(Path(__file__).resolve()))
        d.spawn("bridge", "serve", "inference", "--attach", url, "--backend-id", "b1")
        d.wait_for(lambda st: any(b.backend_id == "b1" for b in st.backends), 120, "bridge", "bridge")
        inst = {"url": url, "deployment": "bench", "address": d.address, "calls": args.calls, "warmup": args.warmup,
                "max_tokens": args.max_tokens, "prompt_len": args.prompt_len}
        import prorl_cli

        print(f"prorl from {Path(prorl_cli.__file__).parent.parent}; load average {os.getloadavg()[0]:.2f}")
        print(f"generate overhead: {args.calls} calls, prompt {args.prompt_len} tokens, max_tokens {args.max_tokens}, "
              f"tiny model on vLLM (CPU), one worker, calls in sequence")
        measure(d, inst, "bridge (worker -> broker -> bridge -> vLLM)")
        # The same vLLM as a plain HTTP backend (add_llm_server): the broker routes, the worker calls vLLM itself.
        d.kill("bridge", signal.SIGTERM)  # it unregisters on the way out
        d.wait_for(lambda st: not st.backends, 60, "the bridge to unregister", "bridge")
        d.client.add_backend(url)
        measure(d, inst, "HTTP backend (broker routes, worker -> vLLM)")
    finally:
        d.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
