#!/usr/bin/env python3
"""Soak: a real broker (journal on), real nodes and a client, for a bounded time on loopback, through
injected stage failures, stage and job timeouts, and cancels of queued and running jobs.

Each job's kind is drawn at submit and fixes the one result it must get:

- ``ok``: sleeps in RUN, then ``done`` with its echo;
- ``raise``: the test handler raises in INIT, RUN or EVAL: ``failed``, ``critical_error`` naming the stage,
  an error whose message names the scripted failure;
- ``stage_timeout``: RUN sleeps past its ``stage_timeouts_s.run`` cap; ``job_timeout``: EVAL hangs past the
  job's ``timeout_s``: ``timed_out`` with a ``StageTimeout`` naming the stage;
- ``cancel_queued``: cancelled right after its submit, while the queue is deep;
  ``cancel_running``: hangs in RUN and is cancelled a little later: ``cancelled`` (or, if it ended first,
  the terminal state the cancel's reply reported).

Every job must get exactly one well-formed result. Broker and node RSS and open file descriptors are sampled
to a CSV; the summary gives start, max, end and the slope over the last 2/3 of the run. The client forgets
each result it took, so what stays in the broker's memory is bounded by what is in flight. The last line
is a JSON summary; the short CI version is ``tests/chaos/test_soak.py``.

    python scripts/chaos/soak.py --duration-s 1800 --out runs/soak     # 30 minutes, ~72,000 jobs at 40/s
    python scripts/chaos/soak.py --duration-s 40 --in-flight 120
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

from prorl_cli import protocol as P
from prorl_cli.testing import Deployment, bare_dealer

KINDS = ("ok", "raise", "stage_timeout", "job_timeout", "cancel_queued", "cancel_running")
WEIGHTS = (0.70, 0.08, 0.05, 0.05, 0.06, 0.06)
STAGES = ("init", "run", "eval")


@dataclass
class Job:
    kind: str
    echo: int
    stage: str = ""
    cancel_at: float | None = None  # monotonic time to cancel a running one
    cancel_reply_state: str | None = None
    results: list[dict[str, Any]] = field(default_factory=list)


def make_job(rng: random.Random, i: int, now: float) -> tuple[Job, dict[str, Any], dict[str, Any]]:
    """Draw a job's kind; return it with its JobSpec fields (beyond id/task) and its instance."""
    kind = rng.choices(KINDS, WEIGHTS)[0]
    job = Job(kind, i)
    spec: dict[str, Any] = {"timeout_s": 30.0, "max_attempts": 3}
    inst: dict[str, Any] = {"echo": i, "sleep_s": {"run": rng.uniform(0.02, 0.3)}}
    if kind == "raise":
        job.stage = rng.choice(STAGES)
        inst["raise_in"] = job.stage
    elif kind == "stage_timeout":
        job.stage = "run"
        inst["sleep_s"] = {"run": 5.0}
        spec["stage_timeouts_s"] = {"run": 0.2}
    elif kind == "job_timeout":
        job.stage = "eval"
        inst["hang_in"] = "eval"
        spec["timeout_s"] = 0.5
    elif kind == "cancel_running":
        inst["hang_in"] = "run"
        job.cancel_at = now + rng.uniform(1.0, 3.0)
    return job, spec, inst


def check(job_id: str, job: Job) -> str | None:
    """Why this job's results are not what its kind must give, or None when they are."""
    if len(job.results) != 1:
        return f"{len(job.results)} results"
    r = job.results[0]
    for key in ("job_id", "state", "attempt", "error", "critical_error", "stage_s"):
        if key not in r:
            return f"no {key!r} in the result"
    if r["job_id"] != job_id:
        return f"job_id {r['job_id']!r}"
    state, err = r["state"], r.get("error") or {}
    if job.kind == "ok":
        out = r.get("output") or {}
        return None if state == "done" and out.get("echo") == job.echo else f"ok: {state} {out.get('echo')!r}"
    if job.kind == "raise":
        ok = (state == "failed" and r["critical_error"] == job.stage and err.get("stage") == job.stage
              and f"scripted failure in {job.stage}" in str(err.get("message")))
        return None if ok else f"raise in {job.stage}: {state} {r['critical_error']} {err}"
    if job.kind in ("stage_timeout", "job_timeout"):
        ok = (state == "timed_out" and r["critical_error"] == job.stage and err.get("type") == "StageTimeout"
              and job.stage in str(err.get("message")))
        return None if ok else f"{job.kind}: {state} {r['critical_error']} {err}"
    # Cancels: cancelled, or the terminal state the cancel's reply said the job had already reached.
    if job.cancel_reply_state is None:
        return "never cancelled"
    expected = job.cancel_reply_state
    return None if state == expected else f"{job.kind}: {state}, cancel reply said {expected}"


def _proc_sample(proc: psutil.Process) -> tuple[float, int]:
    try:
        return proc.memory_info().rss / 2**20, proc.num_fds()
    except psutil.Error:
        return float("nan"), -1


def _stats(ts: list[float], ys: list[float]) -> dict[str, float]:
    """start, max, end, the value at the start of the last 2/3 (past warm-up: sockets opened lazily) and the
    least-squares slope per hour over that last 2/3 of the samples."""
    pts = [(t, y) for t, y in zip(ts, ys, strict=True) if y == y and y >= 0]
    if not pts:
        return {}
    tail = pts[len(pts) // 3:]
    slope = 0.0
    if len(tail) >= 2:
        mt = sum(t for t, _ in tail) / len(tail)
        my = sum(y for _, y in tail) / len(tail)
        var = sum((t - mt) ** 2 for t, _ in tail)
        slope = sum((t - mt) * (y - my) for t, y in tail) / var * 3600 if var else 0.0
    return {"start": round(pts[0][1], 1), "max": round(max(y for _, y in pts), 1), "end": round(pts[-1][1], 1),
            "warm": round(tail[0][1], 1), "slope_per_h_last_2_3": round(slope, 2)}


class Soak:
    def __init__(self, d: Deployment, args: argparse.Namespace, node_ids: list[str]) -> None:
        self.d, self.args, self.node_ids = d, args, node_ids
        self.rng = random.Random(args.seed)
        self.jobs: dict[str, Job] = {}
        self.pending: set[str] = set()
        self.to_forget: list[str] = []
        self.refused: list[dict[str, Any]] = []
        self.sock: zmq.Socket[bytes] = bare_dealer(d.address, d.deployment_dir)
        self.rid = 0
        self.cancel_rids: dict[str, list[str]] = {}

    def send(self, header: dict[str, Any], payload: list[bytes] | None = None) -> str:
        self.rid += 1
        rid = f"r{self.rid}"
        self.sock.send_multipart(P.encode({**header, "rid": rid}, payload or []))
        return rid

    def submit(self, n: int) -> None:
        now = time.monotonic()
        specs, frames, cancel_now = [], [], []
        drawn = [make_job(self.rng, len(self.jobs) + k, now) for k in range(n)]
        # The ones to cancel while queued go last, behind more jobs than the nodes have credit for.
        drawn.sort(key=lambda x: x[0].kind == "cancel_queued")
        for job, spec, inst in drawn:
            job_id = f"s{job.echo}"
            self.jobs[job_id] = job
            self.pending.add(job_id)
            specs.append({"job_id": job_id, "task": "test", **spec})
            frames.append(P.pack_obj(inst))
            if job.kind == "cancel_queued":
                cancel_now.append(job_id)
        self.send({"op": "submit", "jobs": specs}, frames)
        if cancel_now:
            self.cancel(cancel_now)

    def cancel(self, ids: list[str]) -> None:
        self.cancel_rids[self.send({"op": "cancel", "job_ids": ids})] = ids

    def pump(self, timeout_ms: int) -> None:
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            frames = self.sock.recv_multipart()
            h = msgpack.unpackb(frames[0], raw=False)
            if h.get("op") == "result":
                for info, frame in zip(h["jobs"], P.job_items(P.Op.RESULT, frames[1:]), strict=True):
                    job_id = info["job_id"]
                    job = self.jobs.get(job_id)
                    if job is None:
                        self.refused.append({"unknown_result": job_id})
                        continue
                    job.results.append(P.unpack_obj(frame))
                    self.pending.discard(job_id)
                    self.to_forget.append(job_id)
            elif h.get("op") == "reply":
                if not h.get("ok"):
                    self.refused.append(h)
                ids = self.cancel_rids.pop(str(h.get("rid")), None)
                if ids is not None and h.get("ok"):
                    for job_id, state in (h.get("states") or {}).items():
                        if job_id in self.jobs:
                            self.jobs[job_id].cancel_reply_state = state

    def due_cancels(self, now: float) -> None:
        due = [j for j in self.pending if (c := self.jobs[j].cancel_at) is not None and c <= now]
        for j in due:
            self.jobs[j].cancel_at = None
        if due:
            self.cancel(due)

    def run(self) -> dict[str, Any]:
        args = self.args
        pids = {"broker": self.d.procs["broker"].pid, **{n: self.d.procs[n].pid for n in self.node_ids}}
        procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        csv_file = open(args.out / "soak.csv", "w", newline="")  # noqa: SIM115 (closed below)
        writer = csv.writer(csv_file)
        names = list(procs)
        writer.writerow(writer_header(names))
        series: dict[str, list[float]] = {f"{n}_{k}": [] for n in names for k in ("rss_mb", "fds")}
        ts: list[float] = []
        t0 = time.monotonic()
        next_sample = t0
        deadline = t0 + args.duration_s
        while True:
            now = time.monotonic()
            submitting = now < deadline and (args.max_jobs <= 0 or len(self.jobs) < args.max_jobs)
            if not submitting and not self.pending:
                break
            if now > deadline + args.drain_s:
                break
            room = args.in_flight - len(self.pending)
            if args.rate > 0:  # paced: a light load for a long run, in bursts deeper than the nodes' credit
                room = min(room, int(args.rate * (now - t0)) + args.burst - len(self.jobs))
            if submitting and room >= args.burst:
                self.submit(args.burst)
            self.pump(20)
            self.due_cancels(time.monotonic())
            if len(self.to_forget) >= 200 or (not submitting and self.to_forget):
                self.send({"op": "forget", "job_ids": self.to_forget})
                self.to_forget = []
            if now >= next_sample:
                next_sample = now + args.sample_s
                row: list[Any] = [round(now - t0, 1), len(self.jobs), len(self.jobs) - len(self.pending)]
                ts.append(now - t0)
                for n in names:
                    rss, fds = _proc_sample(procs[n])
                    row += [round(rss, 1), fds]
                    series[f"{n}_rss_mb"].append(rss)
                    series[f"{n}_fds"].append(fds)
                writer.writerow(row)
                csv_file.flush()
                if args.verbose:
                    print(json.dumps(dict(zip(writer_header(names), row, strict=True))), flush=True)
        elapsed_s = time.monotonic() - t0
        self.pump(500)
        csv_file.close()
        bad = {j: why for j, job in self.jobs.items() if (why := check(j, job)) is not None}
        by_kind = {k: sum(1 for j in self.jobs.values() if j.kind == k) for k in KINDS}
        states: dict[str, int] = {}
        for job in self.jobs.values():
            for r in job.results:
                states[r["state"]] = states.get(r["state"], 0) + 1
        cancel_outcomes: dict[str, int] = {}
        for job in self.jobs.values():
            if job.kind.startswith("cancel") and job.cancel_reply_state and job.results:
                # A result with no node: cancelled while queued; with one: cancelled once placed.
                where = "on_node" if job.results[0].get("node_id") else "queued"
                key = f"{job.kind}:{job.cancel_reply_state}:{where}"
                cancel_outcomes[key] = cancel_outcomes.get(key, 0) + 1
        alive = {n: p.is_running() and p.status() != psutil.STATUS_ZOMBIE for n, p in procs.items()}
        return {
            "jobs": len(self.jobs), "results": sum(len(j.results) for j in self.jobs.values()),
            "elapsed_s": round(elapsed_s, 1), "jobs_per_s": round(len(self.jobs) / elapsed_s, 1),
            "kinds": by_kind, "states": states, "cancel_outcomes": cancel_outcomes,
            "malformed": len(bad), "malformed_examples": dict(list(bad.items())[:10]),
            "refused": len(self.refused), "refused_examples": self.refused[:5], "alive": alive,
            **{k: _stats(ts, v) for k, v in series.items()},
            "samples": len(ts), "csv": str(args.out / "soak.csv"),
        }


def writer_header(names: list[str]) -> list[str]:
    return ["t_s", "submitted", "finished", *[f"{n}_{k}" for n in names for k in ("rss_mb", "fds")]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=1800.0, help="submit for this long, then drain")
    ap.add_argument("--max-jobs", type=int, default=0, help="stop submitting after this many jobs (0: no limit)")
    ap.add_argument("--drain-s", type=float, default=60.0, help="wait at most this long for the last results")
    ap.add_argument("--in-flight", type=int, default=600, help="at most this many jobs submitted and not finished")
    ap.add_argument("--burst", type=int, default=200, help="jobs per submit (more than the nodes' total credit)")
    ap.add_argument("--rate", type=float, default=40.0, help="submit at most this many jobs a second (0: no pacing)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--credit", type=int, default=48, help="per node; below --in-flight keeps a queue to cancel from")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="folder for soak.csv (default: a temporary one)")
    ap.add_argument("--verbose", action="store_true", help="print each sample as a JSON line")
    args = ap.parse_args(argv)
    args.out = (args.out or Path(tempfile.mkdtemp(prefix="prorl-soak-out-"))).resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    home = Path(tempfile.mkdtemp(prefix="prorl-soak-")) / "home"
    d = Deployment(home, "soak", config={
        "broker": {"journal": True},
        "node": {"n_init": 16, "n_run": 48, "n_eval": 16, "credit": args.credit},
        "log_level": "WARNING",
    })
    try:
        d.start_broker()
        node_ids = [f"n{i}" for i in range(args.nodes)]
        for n in node_ids:
            d.start_node(n)
        summary = Soak(d, args, node_ids).run()
        summary["broker_log_tail"] = d.log("broker")[-1500:] if summary["malformed"] else ""
    finally:
        d.close()
    print(json.dumps(summary), flush=True)
    ok = summary["malformed"] == 0 and summary["refused"] == 0 and all(summary["alive"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
