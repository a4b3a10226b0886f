#!/usr/bin/env python3
"""Load one real broker: simulated nodes and inference bridges (real protocol, one process), 16,384 jobs in flight.

The nodes register, heartbeat, take assignments, report a stage, make
``--generates-per-job`` generate calls for each job one after another
(answered by the simulated bridges, routed by the broker), hold the job for
a while after the last reply and send a result of ``--result-kb``. A client
keeps ``--jobs`` jobs in flight for ``--duration-s`` seconds and, as a DAPO
trainer does, cancels ``--cancel-fraction`` of them soon after submitting
them, while their nodes keep calling the model until they see the broker's
cancel. Then it drains and asks ``status``.

Prints broker RSS over time against its configured retention, and the
counts that must hold: false node and bridge deaths 0, every job's result
exactly once (a cancelled job's ``cancelled`` result is its one result),
every generate call answered, no call of a job the client saw cancelled
ever routed to a bridge, and no routing state left after the drain (live
jobs on backends, calls in flight, held calls: all 0). The last line is a
JSON summary (the short CI version in ``tests/chaos`` reads it).

    python scripts/chaos/load_broker.py                      # 16,384 in flight, 256 KB results, 10 min
    python scripts/chaos/load_broker.py --jobs 1024 --duration-s 30
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

from prorl_cli import protocol as P
from prorl_cli.embedded import LocalStack
from prorl_cli.testing import bare_dealer

TASK = "load"
HOST = "sim"
SIDECAR_PERIOD_S = 0.25
#: Broker address -> its deployment folder (where the CURVE keys every simulated peer presents are).
KEYS: dict[str, Path] = {}
#: The prompt of every simulated call (small: the load is in routing, not in bytes) and the bridge's answer.
PROMPT = P.pack_tokens(list(range(1, 33)))
OUTPUT_IDS = [7, 8, 9, 10]
REPLY_FRAMES = [P.pack_tokens(OUTPUT_IDS), P.pack_floats([-0.5] * len(OUTPUT_IDS))]
SAMPLING = P.SamplingParams(max_tokens=len(OUTPUT_IDS)).to_wire()


@dataclass
class GenerateCounts:
    """What the simulated nodes saw of their generate calls."""

    sent: int = 0
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # error code -> count
    #: Errors for jobs the client never asked to cancel: the broker dropped a live job's call.
    errors_uncancelled: int = 0
    #: Calls sent after the job had ended at the broker, as the sender knows for sure: the broker had confirmed
    #: its cancel to the client, or answered one of the job's calls ``unknown_job``. They reach the broker after.
    after_cancel: int = 0
    #: Of those, calls not refused at once (answered by a bridge, or dropped after routing): routed although
    #: the job had ended (a call routed for a finished job leaks routing state). Must be 0.
    after_cancel_routed: int = 0
    #: Calls the broker refused because their job was not running (it had ended when they arrived): never routed.
    refused_not_running: int = 0
    malformed: int = 0


@dataclass
class CancelBook:
    """The client's cancels: which jobs it asked to cancel, and which the broker confirmed cancelled."""

    requested: set[str] = field(default_factory=set)
    confirmed: set[str] = field(default_factory=set)


@dataclass
class Call:
    job_id: str
    attempt: int
    index: int  # 1-based: the job's k-th call
    after_cancel: bool


class SimNode:
    """A node server's protocol, without running anything: held jobs, their generate calls, results."""

    def __init__(self, ctx: zmq.Context[Any], address: str, node_id: str, credit: int) -> None:
        self.node_id, self.credit = node_id, credit
        self.sock = bare_dealer(address, KEYS.get(address), unbounded=True, ctx=ctx)
        self.held: dict[str, int] = {}  # job id -> attempt
        self.calls: dict[int, Call] = {}  # rid -> the call it waits for
        self.ended: set[str] = set()  # jobs the broker answered a call of with ``unknown_job``: ended there
        self._rids = itertools.count(1)
        self.registrations = 0
        self.token = secrets.token_hex(8)
        self.register()

    def register(self) -> None:
        self.registrations += 1
        running = [{"job_id": j, "attempt": a, "stage": "run"} for j, a in self.held.items()]
        self.sock.send_multipart(P.encode({"op": "register", "rid": next(self._rids), "node_id": self.node_id,
                                           "host": HOST, "pid": 1, "credit": self.credit, "tasks": [TASK],
                                           "running": running, "liveness_token": self.token}))

    def generate(self, job_id: str, attempt: int, index: int, counts: GenerateCounts, cancels: CancelBook) -> None:
        """One model call, with the header fields a real node sends (``NodeInference.generate`` + the connection)."""
        rid = next(self._rids)
        after_cancel = job_id in cancels.confirmed or job_id in self.ended
        self.calls[rid] = Call(job_id, attempt, index, after_cancel)
        counts.sent += 1
        counts.after_cancel += after_cancel
        self.sock.send_multipart(P.encode({"op": "generate", "job_id": job_id, "sampling": SAMPLING, "rid": rid,
                                           "host": HOST}, [PROMPT]))

    def cancel(self, job_ids: list[str]) -> None:
        """The broker's ``cancel_job``: stop the jobs (their calls given up on), report them cancelled."""
        cancelled = set(job_ids)
        gone = [(j, self.held.pop(j)) for j in job_ids if j in self.held]
        self.ended -= cancelled
        for rid, call in list(self.calls.items()):
            if call.job_id in cancelled:
                self.sock.send_multipart(P.encode({"op": "generate_cancel", "rid": rid, "job_id": call.job_id}))
        if gone:
            frames = [P.pack_obj(P.JobResult(job_id=j, task=TASK, state="cancelled", attempt=a,
                                             node_id=self.node_id).to_wire()) for j, a in gone]
            self.sock.send_multipart(P.encode(
                {"op": "job_done", "jobs": [{"job_id": j, "attempt": a, "state": "cancelled"} for j, a in gone]}, frames))


class SimBridge:
    """An inference bridge's protocol: register as a backend, heartbeat, answer every forwarded generate.

    Each call is answered after a latency drawn from ``latency_s`` (an engine
    at work); a ``generate_cancel`` before then stops it without an answer, as
    the real bridge cancels the call's task.
    """

    def __init__(self, ctx: zmq.Context[Any], address: str, backend_id: str, latency_s: tuple[float, float],
                 rng: random.Random) -> None:
        self.backend_id = backend_id
        self.latency_s, self.rng = latency_s, rng
        self.sock = bare_dealer(address, KEYS.get(address), unbounded=True, ctx=ctx)
        self.registered = threading.Event()
        self.registrations = 0
        self.working: dict[int, float] = {}  # the broker's call id -> when its answer is due
        self.due: list[tuple[float, int]] = []  # (when, call id); cancelled calls are skipped when they come up
        self.served = 0
        self.stopped = 0  # calls stopped by the broker's generate_cancel before their answer
        self.cancels_late = 0  # generate_cancel for a call already answered
        self.register()

    def register(self) -> None:
        self.registrations += 1
        self.sock.send_multipart(P.encode({"op": "register_backend", "rid": self.registrations,
                                           "backend_id": self.backend_id, "host": HOST, "model": "sim",
                                           "max_model_len": 4096, "capacity": 1024}))

    def heartbeat(self) -> None:
        self.sock.send_multipart(P.encode({"op": "heartbeat", "backend_id": self.backend_id,
                                           "inflight": len(self.working)}))

    def answer_due(self, now: float) -> None:
        while self.due and self.due[0][0] <= now:
            _, call_id = heapq.heappop(self.due)
            if self.working.pop(call_id, None) is None:
                continue  # stopped meanwhile
            # As InferenceBridge._serve_generate answers: ids (int32) and logprobs (float32), a finish reason.
            self.served += 1
            self.sock.send_multipart(P.encode({"op": "generate_reply", "rid": call_id, "finish_reason": "length"},
                                              REPLY_FRAMES))

    def on_message(self, frames: list[bytes]) -> None:
        h = msgpack.unpackb(frames[0], raw=False)
        op = h.get("op")
        if op == "generate":
            when = time.monotonic() + self.rng.uniform(*self.latency_s)
            self.working[h["rid"]] = when
            heapq.heappush(self.due, (when, h["rid"]))
        elif op == "generate_cancel":
            if self.working.pop(h.get("rid"), None) is not None:
                self.stopped += 1
            else:
                self.cancels_late += 1
        elif op == "reply":
            if h.get("ok"):
                self.registered.set()
            elif h["error"]["code"] == "unknown_peer":
                self.register()


def sidecar(ctx: zmq.Context[Any], address: str, nodes: list[SimNode], bridges: list[SimBridge],
            stop: threading.Event) -> None:
    """Every node's liveness from its own connection, and the bridges, in a thread of their own.

    As real nodes' liveness comes from a sidecar thread and real bridges run
    their own process, a busy simulator loop must not look like a dead peer,
    so the deaths counted are the broker's doing.
    """
    socks = [bare_dealer(address, KEYS.get(address), unbounded=True, ctx=ctx) for _ in nodes]
    poller = zmq.Poller()
    by_sock = {b.sock: b for b in bridges}
    for b in bridges:
        poller.register(b.sock, zmq.POLLIN)
    next_beat = 0.0
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + SIDECAR_PERIOD_S
            for s, n in zip(socks, nodes, strict=True):
                s.send_multipart(P.encode({"op": "heartbeat", "node_id": n.node_id, "liveness_token": n.token}))
            for b in bridges:
                b.heartbeat()
        for b in bridges:
            b.answer_due(now)
        wake = min([next_beat, *(b.due[0][0] for b in bridges if b.due)])
        for sock, _ in poller.poll(max(1, int((wake - time.monotonic()) * 1000))):
            for _ in range(1000):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                by_sock[sock].on_message(frames)
    for s in socks:
        s.close(0)


@dataclass
class Book:
    """The client's side of the run: what it submitted, got back and cancelled."""

    submitted: int = 0
    in_flight: int = 0
    results: dict[str, int] = field(default_factory=dict)  # job id -> results received
    states: Counter[str] = field(default_factory=Counter)  # final state -> jobs
    cancels: CancelBook = field(default_factory=CancelBook)
    cancel_due: list[tuple[float, str]] = field(default_factory=list)  # (when, job id)
    re_registrations: int = 0
    refused: int = 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=16_384, help="jobs kept in flight")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--bridges", type=int, default=8, help="simulated inference bridges")
    ap.add_argument("--generates-per-job", type=int, default=2, help="generate calls each job makes, one after another")
    ap.add_argument("--generate-s", type=float, nargs=2, default=(0.05, 0.5),
                    help="how long a simulated bridge takes to answer a generate call (range)")
    ap.add_argument("--cancel-fraction", type=float, default=0.1,
                    help="fraction of jobs the client cancels soon after submitting them (DAPO's over-provisioned groups)")
    ap.add_argument("--cancel-delay-s", type=float, nargs=2, default=(0.0, 0.5),
                    help="how long after its submit a job picked for cancelling is cancelled (range)")
    ap.add_argument("--result-kb", type=int, default=256)
    ap.add_argument("--duration-s", type=float, default=600.0, help="how long to keep the jobs in flight")
    ap.add_argument("--hold-s", type=float, nargs=2, default=(60.0, 120.0),
                    help="how long a node holds a job after its last generate reply (range)")
    ap.add_argument("--retention-mb", type=int, default=512, help="broker.result_retention_mb")
    ap.add_argument("--forget", action="store_true", help="forget each result once taken (op forget)")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=None, help="seed of the holds, the cancel picks and their delays")
    ap.add_argument("--keep-home", action="store_true",
                    help="keep the run folder (broker log, journal) after a run that passed; a failed run's is always kept")
    ap.add_argument("--linger-s", type=float, default=0.0,
                    help="keep the drained broker up this long before closing (to inspect it, e.g. with gdb)")
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.nodes < 1 or args.bridges < 1 or args.generates_per_job < 0:
        ap.error("--jobs, --nodes and --bridges must be at least 1, --generates-per-job at least 0")
    if not 0.0 <= args.cancel_fraction <= 1.0:
        ap.error(f"--cancel-fraction must be between 0 and 1, got {args.cancel_fraction}")
    rng = random.Random(args.seed)

    home = Path(tempfile.mkdtemp(prefix="prorl-load-"))
    ok = False
    stack = LocalStack(home, "load", {"broker": {"result_retention_mb": args.retention_mb}})
    ctx: zmq.Context[Any] = zmq.Context.instance()
    try:
        broker = stack.start_broker()
        address = stack.address
        KEYS[address] = stack.deployment_dir
        credit = -(-args.jobs // args.nodes)
        nodes = [SimNode(ctx, address, f"sim{i}", credit) for i in range(args.nodes)]
        # The bridges' own generator: they live in the sidecar thread.
        bridge_rng = random.Random(rng.random())
        bridges = [SimBridge(ctx, address, f"simbridge{i}", args.generate_s, bridge_rng) for i in range(args.bridges)]
        stop = threading.Event()
        side = threading.Thread(target=sidecar, args=(ctx, address, nodes, bridges, stop), daemon=True)
        side.start()
        for b in bridges:
            if not b.registered.wait(30):
                raise SystemExit(f"bridge {b.backend_id} got no register_backend reply in 30 s")
        by_sock = {n.sock: n for n in nodes}
        client = bare_dealer(address, KEYS.get(address), unbounded=True, ctx=ctx)
        monitor = bare_dealer(address, KEYS.get(address), unbounded=True, ctx=ctx)
        poller = zmq.Poller()
        for s in [*by_sock, client, monitor]:
            poller.register(s, zmq.POLLIN)
        blob = random.randbytes(args.result_kb * 1024)
        due: list[tuple[float, str, str, int]] = []  # (when, node id, job id, attempt): results to send
        book = Book()
        gen = GenerateCounts()
        samples: list[dict[str, Any]] = []
        proc = psutil.Process(broker.pid)
        rss0 = proc.memory_info().rss
        t0 = time.monotonic()
        next_sample = t0
        rids = itertools.count(1)

        def submit(n: int) -> None:
            now = time.monotonic()
            for start in range(0, n, 1024):
                k = min(1024, n - start)
                job_ids = [f"j{book.submitted + i}" for i in range(k)]
                jobs = [{"job_id": j, "task": TASK, "max_attempts": 50} for j in job_ids]
                for job_id in job_ids:
                    if rng.random() < args.cancel_fraction:
                        heapq.heappush(book.cancel_due, (now + rng.uniform(*args.cancel_delay_s), job_id))
                client.send_multipart(P.encode({"op": "submit", "rid": next(rids), "jobs": jobs}, [P.pack_obj({})] * k))
                book.submitted += k
                book.in_flight += k

        def hold(node: SimNode, job_id: str, attempt: int) -> None:
            heapq.heappush(due, (time.monotonic() + rng.uniform(*args.hold_s), node.node_id, job_id, attempt))

        def next_call(node: SimNode, call: Call) -> None:
            """After a call's answer, the job's next call or its hold; only while the node still holds the job."""
            if node.held.get(call.job_id) != call.attempt:
                return
            if call.index < args.generates_per_job:
                node.generate(call.job_id, call.attempt, call.index + 1, gen, book.cancels)
            else:
                hold(node, call.job_id, call.attempt)

        def on_node(node: SimNode, h: dict[str, Any], frames: list[bytes]) -> None:
            op = h.get("op")
            if op == "assign":
                stages = []
                for spec in h["jobs"]:
                    node.held[spec["job_id"]] = spec["attempt"]
                    stages.append({"job_id": spec["job_id"], "attempt": spec["attempt"], "stage": "run"})
                node.sock.send_multipart(P.encode({"op": "job_stage", "updates": stages}))
                for spec in h["jobs"]:
                    if args.generates_per_job:
                        node.generate(spec["job_id"], spec["attempt"], 1, gen, book.cancels)
                    else:
                        hold(node, spec["job_id"], spec["attempt"])
            elif op == "cancel_job":
                node.cancel(h["job_ids"])
            elif op == "reply":
                call = node.calls.pop(h.get("rid"), None)  # type: ignore[arg-type]
                if call is None:
                    if not h.get("ok") and h["error"]["code"] == "unknown_peer":
                        book.re_registrations += 1
                        node.register()
                    return
                # The broker's refusal of a call whose job is not running (the wire has one code, unknown_job, for
                # this and for a routed call dropped when its job ended; the message tells them apart).
                refused = not h.get("ok") and h["error"]["code"] == "unknown_job" and "is not running" in h["error"]["message"]
                # A call sent once its job had ended there reached the broker after the end: it must be refused.
                gen.after_cancel_routed += call.after_cancel and not refused
                if h.get("ok"):
                    gen.ok += 1
                    if len(frames) != 3 or P.unpack_tokens(frames[1]) != OUTPUT_IDS:
                        gen.malformed += 1
                else:
                    code = h["error"]["code"]
                    gen.errors[code] += 1
                    gen.errors_uncancelled += call.job_id not in book.cancels.requested
                    gen.refused_not_running += refused
                    if code == "unknown_job" and node.held.get(call.job_id) == call.attempt:
                        node.ended.add(call.job_id)
                    if code == "unknown_peer":
                        book.re_registrations += 1
                        node.register()
                # A node that has not seen the cancel yet carries on with the job's next call.
                next_call(node, call)

        def on_client(h: dict[str, Any], running: bool) -> None:
            op = h.get("op")
            if op == "result":
                for info in h["jobs"]:
                    book.results[info["job_id"]] = book.results.get(info["job_id"], 0) + 1
                    book.states[info["state"]] += 1
                    book.in_flight -= 1
                if args.forget:
                    client.send_multipart(P.encode({"op": "forget", "rid": next(rids),
                                                    "job_ids": [i["job_id"] for i in h["jobs"]]}))
                if running:
                    submit(len(h["jobs"]))
            elif op == "reply" and h.get("ok") and "states" in h:
                book.cancels.confirmed.update(j for j, s in h["states"].items() if s == "cancelled")
            elif op == "reply" and not h.get("ok"):
                book.refused += 1
                print("client request refused:", h, file=sys.stderr)

        def on_monitor(h: dict[str, Any]) -> dict[str, Any]:
            st = h["status"]
            samples.append({
                "t_s": round(time.monotonic() - t0, 1), "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                "retained_mb": round(st.get("retained_bytes", 0) / 2**20, 1),
                "retained": st.get("retained_results", 0), "done": st["jobs"].get("done", 0),
                "cancelled": st["jobs"].get("cancelled", 0),
                "alive_nodes": sum(n["alive"] for n in st["nodes"]),
                "alive_bridges": sum(b["alive"] for b in st["backends"]),
                "generates_inflight": sum(b["inflight"] for b in st["backends"]),
                "held_generates": st.get("held_generates", 0),
            })
            print(json.dumps(samples[-1]), flush=True)
            return st

        def send_cancels(now: float) -> None:
            job_ids = []
            while book.cancel_due and book.cancel_due[0][0] <= now:
                _, job_id = heapq.heappop(book.cancel_due)
                if job_id not in book.results:  # a DAPO trainer cancels what it has not got back yet
                    job_ids.append(job_id)
            if job_ids:
                book.cancels.requested.update(job_ids)
                client.send_multipart(P.encode({"op": "cancel", "rid": next(rids), "job_ids": job_ids}))

        def send_due(now: float) -> None:
            """Finish what is due, one job_done per node."""
            out: dict[str, list[tuple[str, int]]] = {}
            while due and due[0][0] <= now:
                _, node_id, job_id, attempt = heapq.heappop(due)
                node = node_by_id[node_id]
                if node.held.get(job_id) == attempt:
                    del node.held[job_id]
                    node.ended.discard(job_id)
                    out.setdefault(node_id, []).append((job_id, attempt))
            for node_id, done in out.items():
                frames = [P.pack_obj(P.JobResult(job_id=j, task=TASK, state="done", attempt=a, node_id=node_id,
                                                 output=blob).to_wire()) for j, a in done]
                node_by_id[node_id].sock.send_multipart(P.encode(
                    {"op": "job_done", "jobs": [{"job_id": j, "attempt": a, "state": "done"} for j, a in done]}, frames))

        submit(args.jobs)
        node_by_id = {n.node_id: n for n in nodes}
        final: dict[str, Any] | None = None
        final_rid = -1
        drained_at: float | None = None
        while final is None:
            now = time.monotonic()
            running = now - t0 < args.duration_s
            if drained_at is None and not running and book.in_flight == 0 and not any(n.calls for n in nodes):
                # Drained: every result in and every generate call answered. Ask for the routing state left.
                drained_at = now
                final_rid = next(rids)
                monitor.send_multipart(P.encode({"op": "status", "rid": final_rid}))
            if now - t0 > args.duration_s + 4 * args.hold_s[1] + 60:
                print("drain timed out", file=sys.stderr)
                break
            if now >= next_sample and drained_at is None:
                monitor.send_multipart(P.encode({"op": "status", "rid": next(rids)}))
                next_sample = now + args.sample_s
            send_due(now)
            if running:
                send_cancels(now)
            heads = [due[0][0] if due else now + 0.05, book.cancel_due[0][0] if running and book.cancel_due else now + 0.05]
            timeout_ms = max(0, min(50, int((min(heads) - now) * 1000)))
            for sock, _ in poller.poll(timeout_ms):
                for _ in range(1000):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    h = msgpack.unpackb(frames[0], raw=False)
                    if sock is client:
                        on_client(h, running)
                    elif sock is monitor:
                        st = on_monitor(h)
                        if h.get("rid") == final_rid:
                            final = st
                    else:
                        on_node(by_sock[sock], h, frames)
        stop.set()
        side.join()
        # Who used the CPU: if the generator's share is near a whole core, it (not the broker) set the pace.
        broker_cpu = proc.cpu_times()
        own_cpu = psutil.Process().cpu_times()
        wall_s = time.monotonic() - t0
        log = (stack.logs / "broker.log").read_text(errors="replace")
        backends = final["backends"] if final else []
        dupes = sum(1 for c in book.results.values() if c > 1)
        summary = {
            "jobs_in_flight": args.jobs, "nodes": args.nodes, "bridges": args.bridges, "result_kb": args.result_kb,
            "duration_s": args.duration_s, "generates_per_job": args.generates_per_job,
            "cancel_fraction": args.cancel_fraction,
            "submitted": book.submitted, "results": len(book.results), "missing": book.submitted - len(book.results),
            "duplicated": dupes, "result_states": dict(book.states),
            "cancel_requested": len(book.cancels.requested), "cancelled": book.states.get("cancelled", 0),
            "false_node_deaths": log.count(" lost ("), "false_bridge_deaths": len(re.findall(r"backend \S+ lost: ", log)),
            "re_registrations": book.re_registrations,
            "bridge_re_registrations": sum(b.registrations - 1 for b in bridges),
            "generates": gen.sent, "generates_ok": gen.ok, "generate_errors": sum(gen.errors.values()),
            "generate_errors_by_code": dict(gen.errors), "generate_errors_uncancelled": gen.errors_uncancelled,
            "generates_unanswered": sum(len(n.calls) for n in nodes), "generates_malformed": gen.malformed,
            "generates_after_cancel": gen.after_cancel, "generates_after_cancel_routed": gen.after_cancel_routed,
            "generates_refused_not_running": gen.refused_not_running,
            "bridge_served": sum(b.served for b in bridges), "bridge_calls_stopped": sum(b.stopped for b in bridges),
            "bridge_cancels_late": sum(b.cancels_late for b in bridges),
            # Routing state after the drain, from the broker's status: all must be 0 (no leak).
            "routing_state_read": final is not None,
            "backend_jobs_after_drain": sum(b["jobs"] for b in backends),
            "backend_inflight_after_drain": sum(b["inflight"] for b in backends),
            "held_generates_after_drain": final.get("held_generates", 0) if final else None,
            "node_inflight_after_drain": sum(n["inflight"] for n in final["nodes"]) if final else None,
            "retained_end_mb": round(final.get("retained_bytes", 0) / 2**20, 1) if final else None,
            "rss_start_mb": round(rss0 / 2**20, 1), "rss_max_mb": max((s["rss_mb"] for s in samples), default=0.0),
            "rss_end_mb": round(proc.memory_info().rss / 2**20, 1), "retention_mb": args.retention_mb,
            "broker_alive": broker.poll() is None, "wall_s": round(wall_s, 1),
            "broker_cpu_s": round(broker_cpu.user + broker_cpu.system, 1),
            "generator_cpu_s": round(own_cpu.user + own_cpu.system, 1),
        }
        print(json.dumps(summary), flush=True)
        if args.linger_s > 0:
            print(f"broker pid {broker.pid} stays up {args.linger_s:.0f} s", file=sys.stderr, flush=True)
            time.sleep(args.linger_s)  # not synchronisation: a window for a person or tool to look
        ok = passed(summary)
        return 0 if ok else 1
    finally:
        stack.close()
        # The run folder holds the journal (hundreds of MB to GB with big results): kept only to look into a failure.
        if ok and not args.keep_home:
            shutil.rmtree(home, ignore_errors=True)
        else:
            print(f"run folder (broker log, journal): {home}", file=sys.stderr)


def passed(summary: dict[str, Any]) -> bool:
    """The figures that must hold; each one that fails is named on stderr."""
    must_be_zero = ["missing", "duplicated", "false_node_deaths", "false_bridge_deaths", "generates_unanswered",
                    "generates_malformed", "generate_errors_uncancelled", "generates_after_cancel_routed",
                    "backend_jobs_after_drain", "backend_inflight_after_drain", "held_generates_after_drain",
                    "node_inflight_after_drain"]
    failed = [k for k in must_be_zero if summary[k] != 0]
    failed += [k for k in ("broker_alive", "routing_state_read") if not summary[k]]
    for k in failed:
        print(f"FAILED: {k} = {summary[k]}", file=sys.stderr)
    return not failed


if __name__ == "__main__":
    sys.exit(main())
