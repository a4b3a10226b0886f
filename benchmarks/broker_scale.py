"""One broker at cluster scale: simulated nodes and bridges speaking the real protocol.

A real broker (``prorl serve broker``, a child process) serves lightweight
peers that a few load-generator processes run, each a single-threaded
ZeroMQ poll loop with one DEALER socket per simulated peer:

* nodes (``--nodes``, 64 by default) register with ``slots`` credit each and
  run every job they are assigned as ``--calls`` generate calls (20) whose
  prompts grow to ``--max-prompt-tokens`` (8k), separated by a think time
  (exponential; its mean paces the whole load at ``--rate`` calls/s
  offered), then report ``job_done`` with a small result;
* bridges (``--bridges``, 8) answer each generate at once with 64 ids and
  log-probs;
* one client keeps the job count constant: it submits a replacement for
  every result it receives.

Per level of jobs in flight (1k, 4k, 16k, 64k by default; nodes x slots)
and offered rate (``--rates``), after every slot is filled, it measures for
``--duration-s``: the broker's CPU (cores, all its threads), messages/s
through the broker, p50/p99/p999 of job dispatch (submit -> assign at the
node) and of generate routing per hop (node -> broker -> bridge "in", and
bridge -> broker -> node "back": send times travel in the token frames),
the load generators' own CPU, and the broker's RSS. It prints a table and
saves a PNG of CPU and p99 against jobs in flight (matplotlib, the
``bench`` extra).

``--pin`` gives the broker a core of its own: every thread of the broker
process (its loop, ZeroMQ's I/O thread, the CURVE authenticator) runs on
``--broker-cpu`` and the load generators (and this script) on the other
cores, as ``taskset`` would; whatever else the machine runs still shares
both (``--nice -10`` then gives the broker and the generators most of their
cores against other work). A generator process at 100 % of its core queues what it receives,
so the hop latencies then measure the generators, not the broker: the
table shows their CPU next to the figures.

    python benchmarks/broker_scale.py                       # 1k, 4k, 16k, 64k in flight
    python benchmarks/broker_scale.py --levels 1024 16384 --duration-s 20
    python benchmarks/broker_scale.py --levels 1024 --duration-s 5 --calls 4   # a quick look
    python benchmarks/broker_scale.py --levels 16384 --rates 2000 8000 --pin   # routing p99, broker on a core of its own
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import os
import platform
import random
import struct
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from prorl_cli import protocol as P
from prorl_cli.embedded import LocalStack
from prorl_cli.security import secure_peer

REPO = Path(__file__).resolve().parent.parent

TASK = "sim"
OUTPUT_TOKENS = 64
_TS = struct.Struct("<q")  # monotonic ns, in the first 8 bytes of a token frame


def _frame_with_ts(n_tokens: int) -> bytes:
    body = bytearray(4 * n_tokens)
    _TS.pack_into(body, 0, time.monotonic_ns())
    return bytes(body)


def _ts_of(frame: bytes) -> int:
    return int(_TS.unpack_from(frame, 0)[0])


def _header(op: str, **fields: Any) -> bytes:
    return msgpack.packb({"v": P.PROTOCOL_VERSION, "op": op, **fields}, use_bin_type=True)


@dataclass
class GenConfig:
    address: str
    deployment_dir: str  # its CURVE keys (a ``curve: off`` broker has none to give)
    index: int
    nodes: list[str]
    slots: int
    bridges: list[str]
    client_jobs: int  # jobs this process's client keeps in flight (0: no client here)
    calls: int
    max_prompt_tokens: int
    think_mean_s: float
    heartbeat_interval_s: float
    seed: int
    cpus: list[int] | None = None  # run on these cores (``--pin``)
    nice: int = 0  # scheduling priority (``--nice``)


@dataclass
class Stats:
    """What one generator process saw while measuring."""

    dispatch_ms: list[float] = field(default_factory=list)
    fill_dispatch_ms: list[float] = field(default_factory=list)  # the first jobs, submitted in one burst
    route_in_ms: list[float] = field(default_factory=list)
    route_back_ms: list[float] = field(default_factory=list)
    messages: int = 0
    calls: int = 0
    jobs_done: int = 0
    errors: int = 0
    error_sample: str = ""


class Generator:
    """Nodes, bridges and (maybe) the client of one load-generator process."""

    def __init__(self, cfg: GenConfig, measuring: Any, stopping: Any) -> None:
        self.cfg = cfg
        self.measuring = measuring
        self.stopping = stopping
        self.rng = random.Random(cfg.seed)
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.kind: dict[zmq.Socket[bytes], tuple[str, str]] = {}
        self.node_sock: dict[str, zmq.Socket[bytes]] = {}
        self.bridge_sock: dict[str, zmq.Socket[bytes]] = {}
        for name in cfg.nodes:
            self.node_sock[name] = self._socket(("node", name))
        for name in cfg.bridges:
            self.bridge_sock[name] = self._socket(("bridge", name))
        self.client = self._socket(("client", "c")) if cfg.client_jobs else None
        self.timers: list[tuple[float, int, str, str]] = []  # (due, seq, node, job_id): the job's next call
        self._seq = 0
        self.jobs: dict[str, int] = {}  # job id -> calls made
        self.rids: dict[int, tuple[str, float]] = {}  # node rid -> (job id, send time)
        self._rid = 0
        self.done_out: dict[str, list[str]] = {}
        self.stage_out: dict[str, list[str]] = {}
        self.stats = Stats()
        self.submitted = 0
        self.result_blob = P.pack_obj(P.JobResult(job_id="x", task=TASK, state="done", reward=1.0,
                                                  output={"pad": "x" * 200}).to_wire())

    def _socket(self, kind: tuple[str, str]) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        secure_peer(sock, Path(self.cfg.deployment_dir))
        sock.connect(self.cfg.address)
        self.poller.register(sock, zmq.POLLIN)
        self.kind[sock] = kind
        return sock

    def send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        sock.send_multipart(frames, copy=False)
        self.stats.messages += 1

    # ------------------------------------------------------------ start

    def register(self) -> None:
        for name, sock in self.node_sock.items():
            self.send(sock, [_header("register", rid=1, node_id=name, host="sim", pid=os.getpid(),
                                     credit=self.cfg.slots, tasks=[TASK])])
        for name, sock in self.bridge_sock.items():
            self.send(sock, [_header("register_backend", rid=1, backend_id=name, host="sim", model="sim",
                                     max_model_len=1 << 20, capacity=1 << 16)])

    def submit(self, n: int, fill: bool = False) -> None:
        """Submit ``n`` jobs; ``fill``: the first burst, whose jobs start at a random call (a steady state at once)."""
        if self.client is None or n <= 0:
            return
        specs, instances = [], []
        # A msgpack instance, as a real client sends: the submit time and whether it is the first burst.
        stamp = msgpack.packb({"t": time.monotonic_ns(), "fill": fill})
        for _ in range(n):
            specs.append(P.JobSpec(job_id=uuid.uuid4().hex, task=TASK, timeout_s=3600.0).to_wire())
            instances.append(stamp)
        self.submitted += n
        self._rid += 1
        self.send(self.client, P.encode({"op": "submit", "rid": self._rid, "jobs": specs}, instances))

    # ------------------------------------------------------------ loop

    def run(self) -> Stats:
        self.register()
        time.sleep(0.5)  # let the registrations land before the first submit names the task
        for start in range(0, self.cfg.client_jobs, 2048):
            self.submit(min(2048, self.cfg.client_jobs - start), fill=True)
        next_hb = time.monotonic()
        measuring = False
        while not self.stopping.is_set():
            now = time.monotonic()
            if not measuring and self.measuring.is_set():
                measuring = True
                self.stats = Stats(fill_dispatch_ms=self.stats.fill_dispatch_ms)
            if now >= next_hb:
                next_hb = now + self.cfg.heartbeat_interval_s
                for name, sock in self.node_sock.items():
                    self.send(sock, [_header("heartbeat", node_id=name, stages={})])
                for name, sock in self.bridge_sock.items():
                    self.send(sock, [_header("heartbeat", backend_id=name)])
            while self.timers and self.timers[0][0] <= now:
                _, _, node, job_id = heapq.heappop(self.timers)
                self._call(node, job_id)
            timeout_ms = 50
            if self.timers:
                timeout_ms = max(0, min(timeout_ms, int((self.timers[0][0] - now) * 1000)))
            for sock, _ in self.poller.poll(timeout_ms):
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.stats.messages += 1
                    self._on_message(sock, frames)
            self._flush()
        return self.stats

    def _think_s(self) -> float:
        return self.rng.expovariate(1.0 / self.cfg.think_mean_s) if self.cfg.think_mean_s > 0 else 0.0

    def _schedule(self, node: str, job_id: str) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (time.monotonic() + self._think_s(), self._seq, node, job_id))

    def _call(self, node: str, job_id: str) -> None:
        made = self.jobs.get(job_id)
        if made is None:
            return
        self.jobs[job_id] = made + 1
        n_tokens = max(2, self.cfg.max_prompt_tokens * (made + 1) // self.cfg.calls)
        self._rid += 1
        self.rids[self._rid] = (job_id, time.monotonic())
        self.send(self.node_sock[node], [_header("generate", rid=self._rid, job_id=job_id, sampling={"max_tokens": OUTPUT_TOKENS}),
                                         _frame_with_ts(n_tokens)])

    def _on_message(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        kind, name = self.kind[sock]
        h = msgpack.unpackb(frames[0], raw=False)
        op = h.get("op")
        if op == "heartbeat":
            return
        now_ns = time.monotonic_ns()
        if kind == "bridge":
            if op == "generate":
                self.stats.route_in_ms.append((now_ns - _ts_of(frames[1])) / 1e6)
                self.send(sock, [_header("generate_reply", rid=h["rid"], finish_reason="stop"),
                                 _frame_with_ts(OUTPUT_TOKENS), bytes(4 * OUTPUT_TOKENS)])
            elif op == "reply" and not h.get("ok"):
                self._error(h)
            return
        if kind == "client":
            if op == "result":
                n = len(h["jobs"])
                self.stats.jobs_done += n
                self.submit(n)
            elif op == "reply" and not h.get("ok"):
                self._error(h)
            return
        # a node
        if op == "assign":
            for spec, instance in zip(h["jobs"], P.job_items(P.Op.ASSIGN, frames[1:]), strict=True):
                inst = msgpack.unpackb(instance)
                fill = inst["fill"]
                (self.stats.fill_dispatch_ms if fill else self.stats.dispatch_ms).append((now_ns - inst["t"]) / 1e6)
                self.jobs[spec["job_id"]] = self.rng.randrange(self.cfg.calls) if fill else 0
                self.stage_out.setdefault(name, []).append(spec["job_id"])
                self._schedule(name, spec["job_id"])
        elif op == "reply":
            if h.get("rid") == 1 and "heartbeat_interval_s" in h:
                return  # registered
            sent = self.rids.pop(h.get("rid"), None)
            if sent is None:
                return
            job_id, _ = sent
            if not h.get("ok"):
                self._error(h)
                self.jobs.pop(job_id, None)
                self.done_out.setdefault(name, []).append(job_id)
                return
            self.stats.calls += 1
            self.stats.route_back_ms.append((now_ns - _ts_of(frames[1])) / 1e6)
            if self.jobs.get(job_id, 0) >= self.cfg.calls:
                self.jobs.pop(job_id, None)
                self.done_out.setdefault(name, []).append(job_id)
            else:
                self._schedule(name, job_id)
        elif op == "cancel_job":
            for job_id in h.get("job_ids", []):
                self.jobs.pop(job_id, None)

    def _error(self, h: dict[str, Any]) -> None:
        self.stats.errors += 1
        if not self.stats.error_sample:
            self.stats.error_sample = str(h.get("error"))

    def _flush(self) -> None:
        """One job_stage and one job_done per node per loop turn, as a real node batches them."""
        for node, job_ids in self.stage_out.items():
            updates = [{"job_id": j, "attempt": 1, "stage": "run"} for j in job_ids]
            self.send(self.node_sock[node], [_header("job_stage", updates=updates)])
        self.stage_out.clear()
        for node, job_ids in self.done_out.items():
            infos = [{"job_id": j, "attempt": 1, "state": "done"} for j in job_ids]
            self.send(self.node_sock[node], P.encode({"op": "job_done", "jobs": infos}, [self.result_blob] * len(job_ids)))
        self.done_out.clear()


def _generator_main(cfg: GenConfig, measuring: Any, stopping: Any, out: Any) -> None:
    if cfg.cpus is not None:
        os.sched_setaffinity(0, cfg.cpus)  # before ZeroMQ starts its I/O thread, which inherits it
    if cfg.nice:
        os.setpriority(os.PRIO_PROCESS, 0, cfg.nice)
    stats = Generator(cfg, measuring, stopping).run()
    out.put((cfg.index, stats.__dict__))


# ---------------------------------------------------------------------- one level


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def pin_process(pid: int, cpus: list[int]) -> int:
    """Move every thread of ``pid`` onto ``cpus`` (``taskset -a -p``); returns how many threads moved."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        os.sched_setaffinity(tid, cpus)
    return len(tids)


def set_nice(pid: int, nice: int) -> None:
    """Every thread of ``pid`` at ``nice``, and its session's autogroup too.

    With ``kernel.sched_autogroup_enabled`` (the default), the scheduler first
    shares a core between sessions and only then between the processes of
    one session by their nice values: a process's own nice alone gains
    nothing against other sessions' work.
    """
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), nice)  # Linux: a thread's own nice value
    autogroup = Path(f"/proc/{pid}/autogroup")
    if autogroup.exists():
        autogroup.write_text(str(nice))


def profile_summary(path: Path, top: int = 14) -> str:
    """The functions the broker spent its samples in (self time) from py-spy's collapsed stacks."""
    if not path.exists():
        return f"# no profile: py-spy wrote nothing to {path} (is py-spy installed, may it attach?)"
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        own[leaf] = own.get(leaf, 0) + int(count)
        total += int(count)
    rows = sorted(own.items(), key=lambda kv: -kv[1])[:top]
    return f"# broker profile ({total} samples, self time): " + "; ".join(f"{100 * n / total:.1f}% {f}" for f, n in rows)


def _cpu_s(proc: Any) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def run_level(args: argparse.Namespace, inflight: int, workdir: Path, tree: Path | None = None,
              rate: float | None = None) -> dict[str, Any]:
    """One level; ``tree``: run the broker from that source tree instead of this one (a before/after baseline)."""
    import psutil

    rate = args.rates[0] if rate is None else rate
    broker_cpus = gen_cpus = None
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2 or args.broker_cpu not in cores:
            raise SystemExit(f"--pin needs two cores with {args.broker_cpu} among them; this process may use {cores}")
        broker_cpus, gen_cpus = [args.broker_cpu], [c for c in cores if c != args.broker_cpu]

    slots = max(1, inflight // args.nodes)
    inflight = slots * args.nodes
    hb_s = 1.0
    broker_cfg: dict[str, Any] = {"heartbeat_interval_s": hb_s, "heartbeat_liveness": 10, "journal": args.journal}
    if args.curve != "auto":
        broker_cfg["curve"] = args.curve  # only then: an older tree may not know "auto" means CURVE on loopback
    if args.policy != "least_loaded_sticky":
        broker_cfg["routing_policy"] = args.policy  # only then: an older tree does not know the key
    stack = LocalStack(workdir / f"level-{inflight}-{'base' if tree else 'this'}", "scale",
                       {"broker": broker_cfg, "log_level": "WARNING"})
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree or REPO)  # the broker child imports prorl_cli from here
    try:
        broker = stack.start_broker()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    bproc = psutil.Process(broker.pid)
    saved_affinity = os.sched_getaffinity(0)
    if args.nice:
        set_nice(broker.pid, args.nice)
        set_nice(os.getpid(), args.nice)  # the generators are children of this session
    if broker_cpus is not None and gen_cpus is not None:
        pin_process(broker.pid, broker_cpus)
        os.sched_setaffinity(0, gen_cpus)  # this script's status polls run with the generators
    think_mean_s = inflight / rate if rate > 0 else 0.0
    node_names = [f"n{i:03d}" for i in range(args.nodes)]
    bridge_names = [f"b{i:02d}" for i in range(args.bridges)]
    ctx = mp.get_context("spawn")
    measuring, stopping, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = []
    for g in range(args.generators):
        cfg = GenConfig(
            address=stack.address, deployment_dir=str(stack.deployment_dir), index=g, nodes=node_names[g::args.generators], slots=slots,
            bridges=bridge_names[g::args.generators], client_jobs=inflight if g == 0 else 0,
            calls=args.calls, max_prompt_tokens=args.max_prompt_tokens, think_mean_s=think_mean_s,
            heartbeat_interval_s=hb_s, seed=g, cpus=gen_cpus, nice=args.nice,
        )
        p = ctx.Process(target=_generator_main, args=(cfg, measuring, stopping, out), daemon=True)
        p.start()
        procs.append(p)
    try:
        fill_start = time.monotonic()
        client = stack.client
        while True:
            st = client.status()
            placed = sum(n.inflight for n in st.nodes)
            # Jobs finish and are replaced all the time: "filled" is the queue empty and (nearly) every slot busy.
            if st.queued == 0 and placed >= 0.97 * inflight:
                break
            if time.monotonic() - fill_start > args.fill_timeout_s:
                raise TimeoutError(f"only {placed} of {inflight} jobs placed after {args.fill_timeout_s} s")
            time.sleep(0.5)
        fill_s = time.monotonic() - fill_start
        time.sleep(args.warmup_s)
        if broker_cpus is not None:
            threads = pin_process(broker.pid, broker_cpus)  # again: threads started since (none expected)
            assert all(os.sched_getaffinity(int(t)) == set(broker_cpus) for t in os.listdir(f"/proc/{broker.pid}/task"))
        else:
            threads = len(bproc.threads())
        gprocs = [psutil.Process(p.pid) for p in procs]
        load0 = os.getloadavg()[0]
        cpu0, t0 = bproc.cpu_times(), time.monotonic()
        gcpu0 = [_cpu_s(g) for g in gprocs]
        measuring.set()
        spy = None
        if args.profile_dir is not None:
            # py-spy samples the broker through the window without stopping it (on the generators' cores when pinned).
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            spy_out = args.profile_dir / f"broker-{inflight}-{rate:g}-{'base' if tree else 'this'}.txt"
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(broker.pid), "--duration", str(int(args.duration_s)),
                                    "--rate", "200", "--nonblocking", "--format", "raw", "--output", str(spy_out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(args.duration_s)
        cpu1, t1 = bproc.cpu_times(), time.monotonic()
        if spy is not None:
            spy.wait(60)
            print(profile_summary(spy_out), flush=True)
        gcpu1 = [_cpu_s(g) for g in gprocs]
        load1 = os.getloadavg()[0]
        rss_mb = bproc.memory_info().rss / 2**20
        # Routing state against the jobs really running: a leak shows as more bound jobs than running ones.
        st = client.status()
        running = sum(n.inflight for n in st.nodes)
        bound = sum(b.jobs for b in st.backends)
        bridges_alive = sum(b.alive for b in st.backends)
        stopping.set()
        merged = Stats()
        for _ in procs:
            _, part = out.get(timeout=60)
            for k, v in part.items():
                cur = getattr(merged, k)
                setattr(merged, k, cur + v if not isinstance(cur, str) else (cur or v))
    finally:
        stopping.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        stack.close()
        os.sched_setaffinity(0, saved_affinity)
    wall = t1 - t0
    cores = ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / wall
    return {
        "inflight": inflight,
        "rate_offered": rate,
        "pinned": bool(args.pin),
        "broker_threads": threads,
        "load_avg": (load0 + load1) / 2,
        "generator_cores": [(b - a) / wall for a, b in zip(gcpu0, gcpu1, strict=True)],
        "fill_s": fill_s,
        "broker_cores": cores,
        "broker_rss_mb": rss_mb,
        "msgs_per_s": merged.messages / wall,
        "calls_per_s": merged.calls / wall,
        "jobs_per_s": merged.jobs_done / wall,
        "cpu_us_per_call": cores * 1e6 / (merged.calls / wall) if merged.calls else float("nan"),
        "fill_dispatch_p50_ms": pct(merged.fill_dispatch_ms, 0.5),
        "fill_dispatch_p99_ms": pct(merged.fill_dispatch_ms, 0.99),
        "dispatch_p50_ms": pct(merged.dispatch_ms, 0.5),
        "dispatch_p99_ms": pct(merged.dispatch_ms, 0.99),
        "route_in_p50_ms": pct(merged.route_in_ms, 0.5),
        "route_in_p99_ms": pct(merged.route_in_ms, 0.99),
        "route_in_p999_ms": pct(merged.route_in_ms, 0.999),
        "route_back_p50_ms": pct(merged.route_back_ms, 0.5),
        "route_back_p99_ms": pct(merged.route_back_ms, 0.99),
        "route_back_p999_ms": pct(merged.route_back_ms, 0.999),
        "jobs_running": running,
        "jobs_bound_to_backends": bound,
        "bridges_alive": bridges_alive,
        "errors": merged.errors,
        "error_sample": merged.error_sample,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["inflight"] for r in rows]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(xs, [r["broker_cores"] for r in rows], "o-", color="tab:blue", label="broker CPU (cores)")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("jobs in flight")
    ax1.set_ylabel("broker CPU (cores)", color="tab:blue")
    ax1.set_ylim(bottom=0)
    ax2 = ax1.twinx()
    ax2.plot(xs, [r["route_in_p99_ms"] for r in rows], "s--", color="tab:red", label="p99 generate node->bridge (ms)")
    ax2.plot(xs, [r["route_back_p99_ms"] for r in rows], "^--", color="tab:orange", label="p99 generate bridge->node (ms)")
    ax2.set_ylabel("p99 routing latency (ms)", color="tab:red")
    ax2.set_ylim(bottom=0)
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax1.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax1.legend(lines, labels, loc="upper left", fontsize=8)
    ax1.set_title("prorl broker at scale (simulated nodes and bridges, real broker)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _line(label: str, row: dict[str, Any]) -> str:
    gens = "+".join(f"{c:.2f}" for c in row["generator_cores"])
    return (
        f"{label:>8} in flight {row['inflight']:>6}, {row['rate_offered']:g} calls/s offered"
        f"{' (broker pinned to its own core)' if row['pinned'] else ''}, load average {row['load_avg']:.1f}: "
        f"broker {row['broker_cores']:.2f} cores ({row['broker_threads']} threads), {row['broker_rss_mb']:.0f} MB RSS, "
        f"generators {gens} cores | "
        f"{row['msgs_per_s']:.0f} msg/s, {row['calls_per_s']:.0f} calls/s ({row['cpu_us_per_call']:.0f} us CPU/call), "
        f"{row['jobs_per_s']:.1f} jobs/s | dispatch p50/p99 {row['dispatch_p50_ms']:.1f}/{row['dispatch_p99_ms']:.1f} ms | "
        f"generate in p50/p99/p999 {row['route_in_p50_ms']:.2f}/{row['route_in_p99_ms']:.2f}/{row['route_in_p999_ms']:.2f} ms, "
        f"back {row['route_back_p50_ms']:.2f}/{row['route_back_p99_ms']:.2f}/{row['route_back_p999_ms']:.2f} ms | "
        f"fill {row['fill_s']:.1f} s (dispatch p50/p99 {row['fill_dispatch_p50_ms']:.0f}/{row['fill_dispatch_p99_ms']:.0f} ms) | "
        f"{row['jobs_bound_to_backends']} jobs bound to {row['bridges_alive']} live bridges, {row['jobs_running']} running"
        + (f" | {row['errors']} errors, e.g. {row['error_sample']}" if row["errors"] else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[1024, 4096, 16384, 65536], help="jobs in flight per level")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--bridges", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20, help="generate calls per job")
    ap.add_argument("--max-prompt-tokens", type=int, default=8192, help="the last call's prompt length")
    ap.add_argument("--rates", "--rate", type=float, nargs="+", default=[2000.0],
                    help="generate calls/s offered, one run each (paces think times; 0: closed loop)")
    ap.add_argument("--pin", action="store_true",
                    help="the broker on --broker-cpu alone, the load generators on the other cores (taskset)")
    ap.add_argument("--broker-cpu", type=int, default=0)
    ap.add_argument("--nice", type=int, default=0,
                    help="run the broker and the generators at this nice value (say -10, as root: on a machine others "
                         "share, the pinned broker then gets most of its core instead of a share of it)")
    ap.add_argument("--profile-dir", type=Path, help="py-spy the broker through each window; collapsed stacks saved here")
    ap.add_argument("--duration-s", type=float, default=20.0, help="measured window per level")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--fill-timeout-s", type=float, default=300.0)
    ap.add_argument("--generators", type=int, default=2, help="load-generator processes")
    ap.add_argument("--policy", default="least_loaded_sticky")
    ap.add_argument("--curve", choices=["auto", "on", "off"], default="auto",
                    help="broker.curve (auto, the default: CURVE on loopback too; off: plain TCP, to measure CURVE's cost)")
    ap.add_argument("--journal", action="store_true", help="keep the broker's journal on (off: measure routing alone)")
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "broker_scale.png")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--baseline-tree", type=Path,
                    help="also run each level with the broker from this source tree (say `git archive` of an older commit), "
                         "before this tree's, in the same run")
    args = ap.parse_args()

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"pyzmq {zmq.__version__} / libzmq {zmq.zmq_version()}")
    print(f"# {args.nodes} nodes, {args.bridges} bridges, {args.calls} calls/job, prompts to {args.max_prompt_tokens} tokens, "
          f"{'/'.join(f'{r:g}' for r in args.rates)} calls/s offered, {args.generators} generator processes, "
          f"{args.duration_s:g} s per level" + (f", broker pinned to CPU {args.broker_cpu}" if args.pin else "")
          + (f", broker and generators at nice {args.nice}" if args.nice else ""))
    rows = []
    with tempfile.TemporaryDirectory(prefix="prorl-scale-") as tmp:
        for level in args.levels:
            for rate in args.rates:
                runs = [("baseline", args.baseline_tree)] if args.baseline_tree else []
                for label, tree in [*runs, ("prorl", None)]:
                    row = run_level(args, level, Path(tmp), tree, rate)
                    row["broker"] = label
                    if tree is None:
                        rows.append(row)
                    print(_line(label, row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if rows and args.plot and args.plot.name:
        try:
            plot([r for r in rows if r["rate_offered"] == args.rates[0]], args.plot)
            print(f"# plot: {args.plot}")
        except ImportError:
            print("# no plot: matplotlib is not installed (pip install 'prorl[bench]')")


if __name__ == "__main__":
    main()
