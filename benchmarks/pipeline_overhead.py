"""Pipeline overhead: no-op jobs through prorl's broker path vs. the paper's blocking HTTP /process.

Both sides run in this one invocation on this machine, with the same number
of jobs in flight:

* prorl: client -> broker -> node (INIT/RUN/EVAL pools, no-op handler) -> broker -> client,
  every hop a real ZeroMQ socket between real processes. Two client styles:
  ``process`` (one awaited call per job, like the paper's HTTP client) and
  ``stream`` (refill the window with one batched submit per turn, results streamed).
* HTTP: one aiohttp server process implementing the paper's design — POST /process
  enqueues the job through three asyncio queues with worker pools and holds the
  connection until EVAL is done — and an aiohttp client keeping the same number of
  requests in flight.

    python benchmarks/pipeline_overhead.py [--jobs 5000] [--inflight 64]
    python benchmarks/pipeline_overhead.py --cpu [--jobs 30000]

Prints jobs/s and p50/p99 latency per side, and the ratio. ``--cpu``
instead streams ``--jobs`` no-op jobs after a warm-up, with the broker's
journal and without, and prints the CPU time (user + system) that the
broker, the node and the client spent per job.

Children import prorl from ``PYTHONPATH`` when it is set (to compare two
trees with this one script), else from this checkout; the tree in use is
printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if not os.environ.get("PYTHONPATH"):
    # The broker and node are `python -m prorl_cli` children: make them import this checkout too.
    os.environ["PYTHONPATH"] = str(REPO)
    sys.path.insert(0, str(REPO))

from prorl_cli.client import AsyncRolloutClient  # noqa: E402
from prorl_cli.config import load_config  # noqa: E402
from prorl_cli.embedded import LocalStack  # noqa: E402

HTTP_SERVER = r'''
import asyncio, sys
from aiohttp import web

N_INIT, N_RUN, N_EVAL = 8, 32, 8

async def worker(inq, outq):
    while True:
        job = await inq.get()
        # the no-op stage
        if outq is None:
            job["done"].set()
        else:
            outq.put_nowait(job)

async def process(request):
    body = await request.json()
    job = {"id": body["job_id"], "instance": body["instance"], "done": asyncio.Event()}
    request.app["init"].put_nowait(job)
    await job["done"].wait()
    return web.json_response({"job_id": job["id"], "state": "done", "reward": 1.0, "output": {}})

async def start(app):
    app["init"], app["run"], app["eval"] = asyncio.Queue(), asyncio.Queue(), asyncio.Queue()
    app["workers"] = (
        [asyncio.create_task(worker(app["init"], app["run"])) for _ in range(N_INIT)]
        + [asyncio.create_task(worker(app["run"], app["eval"])) for _ in range(N_RUN)]
        + [asyncio.create_task(worker(app["eval"], None)) for _ in range(N_EVAL)]
    )

app = web.Application()
app.on_startup.append(start)
app.router.add_post("/process", process)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=lambda *a: print("ready", flush=True), access_log=None)
'''


def bench_client(stack: LocalStack) -> AsyncRolloutClient:
    """A client of the stack's broker with the deployment's config (its CURVE keys: the broker authenticates on loopback too)."""
    return AsyncRolloutClient(stack.name, address=stack.address, config=load_config(stack.config_path))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(name: str, n: int, elapsed_s: float, lat_s: list[float]) -> float:
    rate = n / elapsed_s
    print(f"{name:<38} {rate:9.0f} jobs/s   p50 {pct(lat_s, 0.5) * 1e3:7.2f} ms   p99 {pct(lat_s, 0.99) * 1e3:7.2f} ms")
    return rate


async def prorl_process_style(stack: LocalStack, jobs: int, inflight: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    async with bench_client(stack) as client:
        await client.process("noop", {})  # warm up
        remaining = jobs
        forget = getattr(client, "forget_local", None)  # older trees' clients lack it

        async def loop() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                r = await client.process("noop", {})
                assert r.state == "done"
                lat.append(time.perf_counter() - t0)
                if forget is not None:
                    forget([r.job_id])

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(inflight)))
        return time.perf_counter() - t0, lat


async def prorl_stream_style(stack: LocalStack, jobs: int, inflight: int) -> tuple[float, list[float]]:
    """Keep ``inflight`` jobs in the pipeline: each batch of results is replaced by one batched
    submit, sent without waiting for its reply (the reply is checked when it comes)."""
    lat: list[float] = []
    async with bench_client(stack) as client:
        started: dict[str, float] = {}
        submits: list[asyncio.Task[list[str]]] = []
        submitted = 0

        def top_up(k: int) -> None:
            nonlocal submitted
            k = min(k, jobs - submitted)
            if k <= 0:
                return
            specs = client.make_specs("noop", k)
            now = time.perf_counter()
            for s in specs:
                started[s.job_id] = now
            submits.append(asyncio.create_task(client.submit_specs(specs, [{}] * k)))
            submitted += k

        stream = client.results()
        # Older trees' clients have neither; the run works without them.
        ready = getattr(stream, "ready", None)
        forget = getattr(client, "forget_local", None)
        t0 = time.perf_counter()
        top_up(inflight)
        done = 0
        async for result in stream:
            arrived = [result]
            if ready is not None:
                arrived += ready()  # take every result already delivered in this loop turn
            now = time.perf_counter()
            for r in arrived:
                assert r.state == "done"
                lat.append(now - started.pop(r.job_id))
            if forget is not None:
                forget(r.job_id for r in arrived)
            done += len(arrived)
            if done >= jobs:
                break
            top_up(len(arrived))
        elapsed = time.perf_counter() - t0
        await stream.aclose()
        await asyncio.gather(*submits)
        return elapsed, lat


async def http_style(port: int, jobs: int, inflight: int) -> tuple[float, list[float]]:
    import aiohttp

    lat: list[float] = []
    url = f"http://127.0.0.1:{port}/process"
    connector = aiohttp.TCPConnector(limit=inflight)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.post(url, json={"job_id": "warm", "instance": {}}) as resp:
            await resp.json()
        remaining = jobs
        counter = 0

        async def loop() -> None:
            nonlocal remaining, counter
            while remaining > 0:
                remaining -= 1
                counter += 1
                t0 = time.perf_counter()
                async with session.post(url, json={"job_id": f"j{counter}", "instance": {}}) as resp:
                    body = await resp.json()
                assert body["state"] == "done"
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(inflight)))
        return time.perf_counter() - t0, lat


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def cpu_per_job(jobs: int, inflight: int, warmup: int) -> None:
    """Stream ``jobs`` no-op jobs after ``warmup`` ones; print each process's CPU time per job."""
    for journal in (True, False):
        with tempfile.TemporaryDirectory(prefix="prorl-bench-") as tmp:
            config = {"node": {"n_init": 8, "n_run": 32, "n_eval": 8, "handler_paths": ["prorl_cli.testing.handlers"]}, "broker": {"journal": journal},
                      "log_level": "WARNING"}
            with LocalStack(Path(tmp), "bench", config) as stack:
                broker = stack.start_broker()
                node = stack.start_node("node-0")
                asyncio.run(prorl_stream_style(stack, warmup, inflight))
                before = {"broker": cpu_s(broker.pid), "node": cpu_s(node.pid), "client": cpu_s()}
                elapsed, lat = asyncio.run(prorl_stream_style(stack, jobs, inflight))
                after = {"broker": cpu_s(broker.pid), "node": cpu_s(node.pid), "client": cpu_s()}
                stack.stop()
        per_job = "   ".join(f"{k} {(after[k] - before[k]) / jobs * 1e6:5.1f} us" for k in before)
        print(f"streamed, journal {'on ' if journal else 'off'}: {jobs / elapsed:7.0f} jobs/s   CPU per job: {per_job}",
              flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=5000)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--cpu", action="store_true", help="measure CPU time per job of each process (streamed)")
    ap.add_argument("--warmup", type=int, default=2000, help="jobs streamed before measuring (with --cpu)")
    args = ap.parse_args()
    import prorl_cli

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}")
    print(f"prorl from {Path(prorl_cli.__file__).parent.parent}; load average {os.getloadavg()[0]:.2f}")
    print(f"{args.jobs} no-op jobs, {args.inflight} in flight\n")
    if args.cpu:
        cpu_per_job(args.jobs, args.inflight, args.warmup)
        return

    # Baseline: the paper's blocking HTTP design, one server process.
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", HTTP_SERVER, str(port)], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        http_elapsed, http_lat = asyncio.run(http_style(port, args.jobs, args.inflight))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)

    # prorl: broker + one node as separate processes; with the broker's journal (the default) and without.
    runs: dict[bool, tuple[float, list[float], float, list[float]]] = {}
    for journal in (True, False):
        with tempfile.TemporaryDirectory(prefix="prorl-bench-") as tmp:
            config = {"node": {"n_init": 8, "n_run": 32, "n_eval": 8, "handler_paths": ["prorl_cli.testing.handlers"]}, "broker": {"journal": journal},
                      "log_level": "WARNING"}
            with LocalStack(Path(tmp), "bench", config) as stack:
                stack.start_broker()
                stack.start_node("node-0")
                proc_elapsed, proc_lat = asyncio.run(prorl_process_style(stack, args.jobs, args.inflight))
                stream_elapsed, stream_lat = asyncio.run(prorl_stream_style(stack, args.jobs, args.inflight))
                stack.stop()
            runs[journal] = (proc_elapsed, proc_lat, stream_elapsed, stream_lat)

    http_rate = report("HTTP /process (aiohttp)", args.jobs, http_elapsed, http_lat)
    proc_elapsed, proc_lat, stream_elapsed, stream_lat = runs[True]
    proc_rate = report("prorl, process() per job", args.jobs, proc_elapsed, proc_lat)
    stream_rate = report("prorl, streamed window", args.jobs, stream_elapsed, stream_lat)
    proc_elapsed, proc_lat, stream_elapsed, stream_lat = runs[False]
    report("prorl, process() per job, no journal", args.jobs, proc_elapsed, proc_lat)
    bare_rate = report("prorl, streamed window, no journal", args.jobs, stream_elapsed, stream_lat)
    print(f"\nratio prorl/HTTP: process() {proc_rate / http_rate:.2f}x, streamed {stream_rate / http_rate:.2f}x")
    print(f"journal cost: streamed {stream_rate / bare_rate:.2f}x of the throughput without it")


if __name__ == "__main__":
    main()
