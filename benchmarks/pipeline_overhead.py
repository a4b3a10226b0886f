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
    python benchmarks/pipeline_overhead.py --cpu [--baseline main] [--repeat 3] [--node-path-only]

Prints jobs/s and p50/p99 latency per side, and the ratio. ``--cpu``
instead measures CPU time (user + system, all threads) per no-op job, in
child processes, ``--repeat`` rounds: the node's own path alone (a real
NodeServer fed assignment frames in one process, no broker, no sockets),
and the whole stack streaming ``--jobs`` jobs after a warm-up, with the
broker's journal and without (broker, node and client CPU per job). With
``--baseline`` (a directory holding another prorl tree, or a git ref of
this repository) the rounds alternate between this tree and the baseline,
and the table shows min / median of each and the ratio of the medians.

Children import the prorl this script imports: the installed package, or
the tree ``PYTHONPATH`` names (to measure another tree with this one
script); the tree in use is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.embedded import LocalStack

REPO = Path(__file__).resolve().parent.parent

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
    return AsyncRolloutClient(stack.name, address=stack.address, config=stack.load_config())


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
    """CPU seconds (user + system) of a process, all its threads (this one by default).

    Read from ``/proc/PID/task/*/schedstat`` (nanoseconds) where there is one, else psutil
    (clock ticks: 10 ms steps, too coarse for a few thousand jobs).
    """
    pid = os.getpid() if pid is None else pid
    try:
        total_ns = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total_ns += int(f.read().split()[0])
        return total_ns / 1e9
    except OSError:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)


def stack_cpu_per_job(jobs: int, inflight: int, warmup: int, journal: bool) -> dict[str, float]:
    """Stream ``jobs`` no-op jobs after ``warmup`` ones; each process's CPU µs per job, and jobs/s."""
    with tempfile.TemporaryDirectory(prefix="prorl-bench-") as tmp:
        config = {"node": {"n_init": 8, "n_run": 32, "n_eval": 8, "handler_paths": ["prorl_cli.testing.handlers"]},
                  "broker": {"journal": journal}, "log_level": "WARNING"}
        with LocalStack(Path(tmp), "bench", config) as stack:
            broker = stack.start_broker()
            node = stack.start_node("node-0")
            asyncio.run(prorl_stream_style(stack, warmup, inflight))
            before = {"broker": cpu_s(broker.pid), "node": cpu_s(node.pid), "client": cpu_s()}
            elapsed, _ = asyncio.run(prorl_stream_style(stack, jobs, inflight))
            after = {"broker": cpu_s(broker.pid), "node": cpu_s(node.pid), "client": cpu_s()}
            stack.stop()
    out = {k: (after[k] - before[k]) / jobs * 1e6 for k in before}
    out["jobs_per_s"] = jobs / elapsed
    return out


#: Jobs per assignment message in the node-path measurement.
NODE_PATH_BATCH = 16


def node_path_cpu_per_job(jobs: int, inflight: int, warmup: int) -> float:
    """The node's own path in one process, without sockets: CPU µs per no-op job.

    A real :class:`NodeServer` (no broker) is handed ``assign`` frames of
    ``NODE_PATH_BATCH`` jobs each, as its connection's reader would hand them
    (header decoded, then ``on_message``), keeping ``inflight`` jobs on it;
    what it sends (stage updates, ``job_done`` with the results) is encoded to
    frames as its connection would and dropped. The frames coming in are made
    before the clock starts; everything the node does to them is counted.
    """
    import gc

    from prorl_cli import protocol as P
    from prorl_cli.config import config_from_dict
    from prorl_cli.node.server import NodeServer

    try:
        from prorl_cli.node.loop import run_checked
    except ImportError:  # older trees
        run_checked = asyncio.run  # type: ignore[assignment]

    total = warmup + jobs

    def assign(first: int, n: int) -> list[bytes]:
        specs = [P.JobSpec(job_id=f"j{first + i:08d}", task="noop").to_wire() for i in range(n)]
        # What a broker sends: where each timeline starts and the broker's events so far.
        timing = [{"since_submit_s": 0.001, "events": [["submitted", 0.0, 0.0, {"at": time.time()}], ["queued", 0.0001, 0.0009]]}
                  for _ in range(n)]
        return P.encode({"op": "assign", "jobs": specs, "timing": timing}, [P.pack_obj({}) for _ in range(n)])

    batches = [assign(b, min(NODE_PATH_BATCH, total - b)) for b in range(0, total, NODE_PATH_BATCH)]
    # Older trees send a frame per job, which their nodes take as they come.
    job_items = getattr(P, "job_items", lambda op, payload: payload)

    async def run() -> float:
        tmp = tempfile.mkdtemp(prefix="prorl-bench-node-")
        cfg = config_from_dict({"deployment": "bench", "home": tmp, "log_level": "WARNING",
                                "node": {"n_init": 8, "n_run": 32, "n_eval": 8, "handler_paths": ["prorl_cli.testing.handlers"]}})
        server = NodeServer(cfg, node_id="bench", address="tcp://127.0.0.1:1")
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        fed = inflight_now = done = 0
        mark: tuple[float, int] | None = None
        sent: list[list[bytes]] = []

        def feed() -> None:
            nonlocal fed, inflight_now
            while inflight_now + NODE_PATH_BATCH <= inflight and fed < len(batches):
                frames = batches[fed]
                fed += 1
                header = P.decode_header(frames[0])
                inflight_now += len(header["jobs"])
                server.on_message(header["op"], header, job_items(header["op"], frames[1:]))

        async def send(header: dict[str, Any], payload: Any = ()) -> None:
            nonlocal inflight_now, done, mark
            sent.append(P.encode(header, payload))  # what the connection hands to pyzmq
            if len(sent) > 256:
                sent.clear()
            if header["op"] != "job_done":
                return
            n = len(header["jobs"])
            inflight_now -= n
            done += n
            if len(server._unconfirmed) > 4096:
                server._unconfirmed.clear()  # what heartbeats trim once the broker confirms
            if mark is None and done >= warmup:
                mark = (time.process_time(), done)
            if done >= total:
                if not finished.done():
                    finished.set_result(None)
            else:
                loop.call_soon(feed)

        server.send = send  # type: ignore[method-assign]
        gc.collect()
        feed()
        await finished
        end = time.process_time()
        assert mark is not None
        return (end - mark[0]) / (done - mark[1]) * 1e6

    return run_checked(run())


def child(args: argparse.Namespace) -> None:
    """One measurement round in this tree; prints a JSON line."""
    out: dict[str, Any] = {"node_path": node_path_cpu_per_job(args.node_path_jobs, args.inflight, args.warmup)}
    if not args.node_path_only:
        for journal in args.journal:
            out[f"journal_{journal}"] = stack_cpu_per_job(args.jobs, args.inflight, args.warmup, journal == "on")
    print("RESULT " + json.dumps(out), flush=True)


def baseline_tree(spec: str, tmp: Path) -> Path:
    """``spec``: a directory holding a prorl tree, or a git ref of this repository (extracted under ``tmp``)."""
    path = Path(spec)
    if path.is_dir():
        return path.resolve()
    dest = tmp / "baseline"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", spec], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def compare(args: argparse.Namespace) -> None:
    """Alternate rounds of this tree and the baseline (children importing each); print min/median per figure."""
    import statistics

    with tempfile.TemporaryDirectory(prefix="prorl-bench-base-") as tmp:
        import prorl_cli

        # The prorl this script imported (the installed package, or the tree PYTHONPATH names).
        trees = {"this tree": Path(prorl_cli.__file__).resolve().parent.parent}
        if args.baseline:
            trees[f"baseline ({args.baseline})"] = baseline_tree(args.baseline, Path(tmp))
        for name, tree in trees.items():
            print(f"{name}: {tree}")
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
        argv = [sys.executable, str(Path(__file__).resolve()), "--cpu-child", "--jobs", str(args.jobs),
                "--node-path-jobs", str(args.node_path_jobs), "--warmup", str(args.warmup), "--inflight", str(args.inflight),
                "--journal", ",".join(args.journal)] + (["--node-path-only"] if args.node_path_only else [])
        for r in range(args.repeat):
            for name, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": str(tree)}
                proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    raise SystemExit(f"{name}, round {r + 1} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                rounds[name].append(json.loads(line[len("RESULT "):]))
                print(f"  round {r + 1}, {name}: node path {rounds[name][-1]['node_path']:.1f} us/job, "
                      f"load average {os.getloadavg()[0]:.1f}", flush=True)

    def fig(name: str, key: str, sub: str | None) -> list[float]:
        return [rd[key][sub] if sub else rd[key] for rd in rounds[name]]

    rows = [("node path alone (no sockets), node CPU", "node_path", None)]
    for journal in args.journal:
        rows += [(f"streamed, journal {journal}, {proc} CPU", f"journal_{journal}", proc) for proc in ("node", "broker", "client")]
        rows.append((f"streamed, journal {journal}, jobs/s", f"journal_{journal}", "jobs_per_s"))
    if args.node_path_only:
        rows = rows[:1]
    print(f"\n{args.repeat} rounds each, alternating; min / median (CPU in µs per no-op job):")
    names = list(trees)
    print(f"{'':44}" + "".join(f"{n[:28]:>30}" for n in names) + ("   median ratio" if len(names) > 1 else ""))
    for label, key, sub in rows:
        cells = [(min(fig(n, key, sub)), statistics.median(fig(n, key, sub))) for n in names]
        line = f"{label:44}" + "".join(f"{lo:>17.1f} / {med:>10.1f}" for lo, med in cells)
        if len(names) > 1:
            line += f"   {cells[0][1] / cells[1][1]:6.2f}x"
        print(line)


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
    ap.add_argument("--baseline", help="with --cpu: also measure this tree (a directory, or a git ref of this repository), "
                    "alternating rounds with this one")
    ap.add_argument("--repeat", type=int, default=3, help="with --cpu: rounds per tree")
    ap.add_argument("--node-path-jobs", type=int, default=20000, help="with --cpu: jobs of the node-path measurement")
    ap.add_argument("--node-path-only", action="store_true", help="with --cpu: only the node path (no broker, no sockets)")
    ap.add_argument("--journal", type=lambda v: v.split(","), default=["on", "off"],
                    help="with --cpu: the broker's journal settings to run (on,off)")
    ap.add_argument("--cpu-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpu_child:
        child(args)
        return
    import prorl_cli

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}")
    print(f"prorl from {Path(prorl_cli.__file__).parent.parent}; load average {os.getloadavg()[0]:.2f}")
    print(f"{args.jobs} no-op jobs, {args.inflight} in flight\n")
    if args.cpu:
        compare(args)
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
