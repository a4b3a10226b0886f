#!/usr/bin/env python3
"""Load one real broker: many simulated nodes (real protocol, one process), 16,384 jobs in flight, big results.

The nodes register, heartbeat, take assignments, report a stage, hold each
job for a while and send a result of ``--result-kb``. A client keeps
``--jobs`` jobs in flight for ``--duration-s`` seconds, then drains. Prints
broker RSS over time against its configured retention, and the counts that
must hold: false node deaths 0, every job's result exactly once. The last
line is a JSON summary (the short CI version in ``tests/chaos`` reads it).

    python scripts/chaos/load_broker.py                      # 16,384 in flight, 256 KB results, 10 min
    python scripts/chaos/load_broker.py --jobs 1024 --duration-s 30
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prorl_cli import protocol as P  # noqa: E402
from prorl_cli.embedded import LocalStack  # noqa: E402

TASK = "load"


class SimNode:
    def __init__(self, ctx: zmq.Context[Any], address: str, node_id: str, credit: int) -> None:
        self.node_id, self.credit = node_id, credit
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.held: dict[str, int] = {}  # job id -> attempt
        self.registrations = 0
        self.token = secrets.token_hex(8)
        self.register()

    def register(self) -> None:
        self.registrations += 1
        running = [{"job_id": j, "attempt": a, "stage": "run"} for j, a in self.held.items()]
        self.sock.send_multipart(P.encode({"op": "register", "rid": self.registrations, "node_id": self.node_id,
                                           "host": "sim", "pid": 1, "credit": self.credit, "tasks": [TASK],
                                           "running": running, "liveness_token": self.token}))


def heartbeat_sidecar(ctx: zmq.Context[Any], address: str, nodes: list[SimNode], stop: threading.Event) -> None:
    """Every node's liveness from its own connection and thread (as real nodes do): a busy simulator loop
    must not look like a dead node, so the deaths counted are the broker's doing."""
    socks = []
    for _ in nodes:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        socks.append(s)
    while not stop.wait(0.25):
        for s, n in zip(socks, nodes, strict=True):
            s.send_multipart(P.encode({"op": "heartbeat", "node_id": n.node_id, "liveness_token": n.token}))
    for s in socks:
        s.close(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=16_384, help="jobs kept in flight")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--result-kb", type=int, default=256)
    ap.add_argument("--duration-s", type=float, default=600.0, help="how long to keep the jobs in flight")
    ap.add_argument("--hold-s", type=float, nargs=2, default=(60.0, 120.0), help="how long a node holds a job (range)")
    ap.add_argument("--retention-mb", type=int, default=512, help="broker.result_retention_mb")
    ap.add_argument("--forget", action="store_true", help="forget each result once taken (op forget)")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--linger-s", type=float, default=0.0,
                    help="keep the drained broker up this long before closing (to inspect it, e.g. with gdb)")
    args = ap.parse_args(argv)

    home = Path(tempfile.mkdtemp(prefix="prorl-load-"))
    stack = LocalStack(home, "load", {"broker": {"result_retention_mb": args.retention_mb}})
    ctx: zmq.Context[Any] = zmq.Context.instance()
    try:
        broker = stack.start_broker()
        address = stack.address
        credit = -(-args.jobs // args.nodes)
        nodes = [SimNode(ctx, address, f"sim{i}", credit) for i in range(args.nodes)]
        stop = threading.Event()
        sidecar = threading.Thread(target=heartbeat_sidecar, args=(ctx, address, nodes, stop), daemon=True)
        sidecar.start()
        by_sock = {n.sock: n for n in nodes}
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.setsockopt(zmq.RCVHWM, 0)
        client.connect(address)
        monitor = ctx.socket(zmq.DEALER)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        poller = zmq.Poller()
        for s in [*by_sock, client, monitor]:
            poller.register(s, zmq.POLLIN)
        blob = random.randbytes(args.result_kb * 1024)
        due: list[tuple[float, str, str, int]] = []  # (when, node id, job id, attempt)
        results: dict[str, int] = {}
        submitted = 0
        in_flight = 0
        deaths = 0
        samples: list[dict[str, Any]] = []
        proc = psutil.Process(broker.pid)
        rss0 = proc.memory_info().rss
        t0 = time.monotonic()
        next_sample = t0
        rid = 0

        def submit(n: int) -> None:
            nonlocal submitted, in_flight
            for start in range(0, n, 1024):
                k = min(1024, n - start)
                jobs = [{"job_id": f"j{submitted + i}", "task": TASK, "max_attempts": 50} for i in range(k)]
                client.send_multipart(P.encode({"op": "submit", "rid": submitted, "jobs": jobs}, [P.pack_obj({})] * k))
                submitted += k
                in_flight += k

        submit(args.jobs)
        node_by_id = {n.node_id: n for n in nodes}
        while True:
            now = time.monotonic()
            running = now - t0 < args.duration_s
            if not running and in_flight == 0:
                break
            if now - t0 > args.duration_s + 4 * args.hold_s[1] + 60:
                print("drain timed out", file=sys.stderr)
                break
            if now >= next_sample:
                rid += 1
                monitor.send_multipart(P.encode({"op": "status", "rid": rid}))
                next_sample = now + args.sample_s
            # Finish what is due, one job_done per node.
            out: dict[str, list[tuple[str, int]]] = {}
            while due and due[0][0] <= now:
                _, node_id, job_id, attempt = heapq.heappop(due)
                node = node_by_id[node_id]
                if node.held.get(job_id) == attempt:
                    del node.held[job_id]
                    out.setdefault(node_id, []).append((job_id, attempt))
            for node_id, done in out.items():
                frames = [P.pack_obj(P.JobResult(job_id=j, task=TASK, state="done", attempt=a, node_id=node_id,
                                                 output=blob).to_wire()) for j, a in done]
                node_by_id[node_id].sock.send_multipart(P.encode(
                    {"op": "job_done", "jobs": [{"job_id": j, "attempt": a, "state": "done"} for j, a in done]}, frames))
            timeout_ms = 50 if not due else max(0, min(50, int((due[0][0] - now) * 1000)))
            for sock, _ in poller.poll(timeout_ms):
                for _ in range(1000):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    h = msgpack.unpackb(frames[0], raw=False)
                    op = h.get("op")
                    if sock is client:
                        if op == "result":
                            for info in h["jobs"]:
                                results[info["job_id"]] = results.get(info["job_id"], 0) + 1
                                in_flight -= 1
                            if args.forget:
                                client.send_multipart(P.encode({"op": "forget", "rid": "f",
                                                                "job_ids": [i["job_id"] for i in h["jobs"]]}))
                            if running:
                                submit(len(h["jobs"]))
                        elif op == "reply" and not h.get("ok"):
                            print("client request refused:", h, file=sys.stderr)
                    elif sock is monitor:
                        st = h["status"]
                        samples.append({
                            "t_s": round(time.monotonic() - t0, 1), "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                            "retained_mb": round(st.get("retained_bytes", 0) / 2**20, 1),
                            "retained": st.get("retained_results", 0), "done": st["jobs"].get("done", 0),
                            "alive_nodes": sum(n["alive"] for n in st["nodes"]),
                        })
                        print(json.dumps(samples[-1]), flush=True)
                    else:
                        node = by_sock[sock]
                        if op == "assign":
                            stages = []
                            for spec in h["jobs"]:
                                node.held[spec["job_id"]] = spec["attempt"]
                                heapq.heappush(due, (time.monotonic() + random.uniform(*args.hold_s), node.node_id,
                                                     spec["job_id"], spec["attempt"]))
                                stages.append({"job_id": spec["job_id"], "attempt": spec["attempt"], "stage": "run"})
                            sock.send_multipart(P.encode({"op": "job_stage", "updates": stages}))
                        elif op == "reply" and not h.get("ok") and h["error"]["code"] == "unknown_peer":
                            deaths += 1
                            node.register()
        stop.set()
        sidecar.join()
        # Who used the CPU: if the generator's share is near a whole core, it (not the broker) set the pace.
        broker_cpu = proc.cpu_times()
        own_cpu = psutil.Process().cpu_times()
        wall_s = time.monotonic() - t0
        log = (stack.logs / "broker.log").read_text(errors="replace")
        false_deaths = log.count(" lost (")
        dupes = sum(1 for c in results.values() if c > 1)
        summary = {
            "jobs_in_flight": args.jobs, "nodes": args.nodes, "result_kb": args.result_kb, "duration_s": args.duration_s,
            "submitted": submitted, "results": len(results), "missing": submitted - len(results), "duplicated": dupes,
            "false_node_deaths": false_deaths, "re_registrations": deaths, "rss_start_mb": round(rss0 / 2**20, 1),
            "rss_max_mb": max((s["rss_mb"] for s in samples), default=0.0),
            "rss_end_mb": round(proc.memory_info().rss / 2**20, 1), "retention_mb": args.retention_mb,
            "broker_alive": broker.poll() is None, "wall_s": round(wall_s, 1),
            "broker_cpu_s": round(broker_cpu.user + broker_cpu.system, 1),
            "generator_cpu_s": round(own_cpu.user + own_cpu.system, 1),
        }
        print(json.dumps(summary), flush=True)
        if args.linger_s > 0:
            print(f"broker pid {broker.pid} stays up {args.linger_s:.0f} s", file=sys.stderr, flush=True)
            time.sleep(args.linger_s)  # not synchronisation: a window for a person or tool to look
        ok = summary["missing"] == 0 and dupes == 0 and false_deaths == 0 and summary["broker_alive"]
        return 0 if ok else 1
    finally:
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
