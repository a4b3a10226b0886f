#!/usr/bin/env python3
"""Chaos: a broker with its journal, 3 nodes, 2,000 jobs; a node ``kill -9``-ed every ~10 s and replaced, the
broker killed twice and restarted (on the same port, then on a new one). Counts lost, duplicated and
conflicting results, and processes of the deployment left over after it is closed.

``--runtime none`` (the default) runs the scripted test handler, no sandboxes. ``--runtime local|bwrap|apptainer``
runs ``scripts/chaos/sandbox_handler.py`` instead: every job starts a sandbox in that runtime (images from
``/var/cache/prorl-test``, or ``PRORL_TEST_IMAGES``) and makes one tool call in it, so each node kill leaves
live sandboxes behind. Orphans counted after the run: processes with the deployment's ``PRORL_HOME``, any
member left of a sandbox session seen during the run (runtime parent, squashfuse, fuse-overlayfs, tool server,
shell) once they had 30 s to exit, processes naming the sandboxes' local folder, and sandbox records or
session folders left on disk.

The client is a bare socket that re-watches its unfinished jobs after each broker restart (the library
client's own restart handling is tested elsewhere), so every result pushed is counted as it arrives.
The last line is a JSON summary. The short CI version: ``tests/chaos/test_chaos_run.py``.

    python scripts/chaos/chaos_run.py                       # 2,000 jobs
    python scripts/chaos/chaos_run.py --jobs 200 --node-kill-every-s 5
    python scripts/chaos/chaos_run.py --runtime apptainer --jobs 500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import psutil
import yaml
import zmq

from prorl_cli import protocol as P
from prorl_cli.sandbox.runtime import session_members, stat_fields, wait_gone
from prorl_cli.testing import Deployment, bare_dealer, fixed_port

IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))
# The image each sandbox runtime starts (unused by ``local``).
RUNTIME_IMAGES = {"local": "", "bwrap": str(IMAGES / "python-rootfs"), "apptainer": str(IMAGES / "python.sif")}
SANDBOX_HANDLER = Path(__file__).resolve().parent / "sandbox_handler.py"


class Client:
    """Submits, and records every result pushed: job id -> [(state, attempt, echo)]."""

    def __init__(self) -> None:
        self.sock: zmq.Socket[bytes] | None = None
        self.results: dict[str, list[tuple[str, int, Any]]] = {}
        self.ids: list[str] = []
        self.refused: list[dict[str, Any]] = []
        self.unknown_after_restart: list[str] = []

    def connect(self, address: str, deployment_dir: Path) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = bare_dealer(address, deployment_dir)

    def send(self, header: dict[str, Any], payload: list[bytes] | None = None) -> None:
        assert self.sock is not None
        self.sock.send_multipart(P.encode(header, payload or []))

    def submit(self, instances: list[dict[str, Any]], task: str) -> None:
        ids = [f"c{len(self.ids) + i}" for i in range(len(instances))]
        jobs = [{"job_id": j, "task": task, "max_attempts": 50, "timeout_s": 300.0} for j in ids]
        self.send({"op": "submit", "rid": f"s-{ids[0]}", "jobs": jobs}, [P.pack_obj(x) for x in instances])
        self.ids += ids

    def rewatch(self) -> None:
        pending = [j for j in self.ids if j not in self.results]
        self.send({"op": "watch", "rid": "rewatch", "job_ids": pending})

    def pump(self, timeout_ms: int = 0) -> None:
        assert self.sock is not None
        while self.sock.poll(timeout_ms):
            frames = self.sock.recv_multipart()
            h = msgpack.unpackb(frames[0], raw=False)
            if h.get("op") == "result":
                for info, frame in zip(h["jobs"], P.job_items(P.Op.RESULT, frames[1:]), strict=True):
                    r = P.unpack_obj(frame)
                    echo = (r.get("output") or {}).get("echo") if isinstance(r.get("output"), dict) else None
                    self.results.setdefault(info["job_id"], []).append((info["state"], r.get("attempt", 0), echo))
            elif h.get("op") == "reply":
                if not h.get("ok"):
                    self.refused.append(h)
                elif h.get("rid") == "rewatch":
                    self.unknown_after_restart += h.get("unknown", [])
            timeout_ms = 0


class SandboxWatch:
    """Remembers every sandbox session the nodes record (``<deployment>/nodes/*/sandboxes/*.json``)."""

    def __init__(self, deployment_dir: Path) -> None:
        self.deployment_dir = deployment_dir
        self.sessions: dict[int, str] = {}  # session id (the sandbox's leader pid) -> sandbox id

    def scan(self) -> None:
        for path in self.deployment_dir.glob("nodes/*/sandboxes/*.json"):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being written or removed right now
            if isinstance(rec.get("pid"), int):
                self.sessions.setdefault(rec["pid"], path.stem)

    def left(self) -> list[int]:
        """Live members of every session seen. Zombies are dead: killed sandbox processes whose parent died are
        reparented to pid 1, which reaps them when it gets to it (lazily on some container inits)."""
        members = {pid for sid in self.sessions for pid in session_members(sid)}
        return sorted(pid for pid in members if (stat_fields(pid) or ["X"])[0] not in ("Z", "X"))


def _leftovers(home: Path, local_dir: Path | None, watch: SandboxWatch | None) -> list[str]:
    found: dict[int, str] = {}
    for pid in watch.left() if watch else []:
        found[pid] = "in a sandbox session"
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid == os.getpid():
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            if local_dir is not None and str(local_dir) in cmdline:
                found[proc.pid] = "names the sandbox folder"
            elif proc.environ().get("PRORL_HOME") == str(home):
                found[proc.pid] = "has the deployment's PRORL_HOME"
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    out = []
    for pid, why in sorted(found.items()):
        try:
            proc = psutil.Process(pid)
            out.append(f"{pid} ({why}, {proc.status()}, ppid {proc.ppid()}) {' '.join(proc.cmdline())}")
        except psutil.Error as e:
            out.append(f"{pid} ({why}; {type(e).__name__})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--node-kill-every-s", type=float, default=10.0)
    ap.add_argument("--broker-kills-at", type=float, nargs=2, default=(0.3, 0.6),
                    help="kill the broker when these fractions of the results are in (same port, then a new one)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runtime", choices=["none", *RUNTIME_IMAGES], default="none",
                    help="none: the test handler, no sandboxes; else a sandbox per job in this runtime")
    ap.add_argument("--hold-s", type=float, nargs=2, default=(0.1, 0.6), help="how long each job runs (range)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)

    home = Path(tempfile.mkdtemp(prefix="prorl-chaos-")) / "home"
    config: dict[str, Any] = {
        # Heartbeats and pool sizes: prorl_cli.testing.DEFAULT_TEST_CONFIG, merged in by Deployment.
        "broker": {"port": fixed_port()},
        "node": {"credit": 12},
    }
    local_dir: Path | None = None
    node_args: tuple[str, ...] = ()
    task = "test"
    if args.runtime != "none":
        image = RUNTIME_IMAGES[args.runtime]
        if image and not Path(image).exists():
            print(f"the {args.runtime} runtime's test image {image} is missing "
                  "(scripts/provision/45-test-images.sh)", file=sys.stderr)
            return 2
        local_dir = Path(tempfile.mkdtemp(prefix="prorl-chaos-sb-"))
        config["sandbox"] = {"runtime": args.runtime, "image": image, "local_dir": str(local_dir)}
        node_args, task = ("--handlers", str(SANDBOX_HANDLER)), "chaos_sandbox"
    d = Deployment(home, "chaos", config=config)
    watch = SandboxWatch(d.deployment_dir) if local_dir is not None else None
    client = Client()
    node_kills = broker_kills = 0
    gen = 0
    try:
        d.start_broker()
        alive = []
        for _ in range(args.nodes):
            gen += 1
            d.start_node(f"n{gen}", *node_args)
            alive.append(f"n{gen}")
        client.connect(d.address, d.deployment_dir)
        for start in range(0, args.jobs, 100):
            batch = range(start, min(args.jobs, start + 100))
            if task == "test":
                client.submit([{"sleep_s": {"run": rng.uniform(*args.hold_s)}, "echo": i} for i in batch], task)
            else:
                client.submit([{"hold_s": rng.uniform(*args.hold_s), "echo": i} for i in batch], task)
        t0 = time.monotonic()
        next_node_kill = t0 + args.node_kill_every_s
        kills_at = sorted(args.broker_kills_at)
        while len(client.results) < args.jobs and time.monotonic() - t0 < args.timeout_s:
            client.pump(100)
            if watch is not None:
                watch.scan()
            now = time.monotonic()
            if now >= next_node_kill:
                victim = alive.pop(rng.randrange(len(alive)))
                d.kill(victim, signal.SIGKILL)
                gen += 1
                d.start_node(f"n{gen}", *node_args, wait=False)
                alive.append(f"n{gen}")
                node_kills += 1
                next_node_kill = now + args.node_kill_every_s
            if kills_at and len(client.results) >= kills_at[0] * args.jobs:
                kills_at.pop(0)
                d.kill("broker", signal.SIGKILL)
                broker_kills += 1
                if broker_kills == 2:
                    d.config_path.write_text(yaml.safe_dump({**d.config, "broker": {**d.config["broker"], "port": fixed_port()}}))
                d.start_broker()
                client.connect(d.address, d.deployment_dir)
                client.rewatch()
        elapsed_s = time.monotonic() - t0
        client.pump(500)
        lost = [j for j in client.ids if j not in client.results]
        duplicated = [j for j, rs in client.results.items() if len(rs) > 1]
        conflicting = [j for j, rs in client.results.items() if len({(s, e) for s, _, e in rs}) > 1]
        wrong = [j for j, rs in client.results.items() if rs[0][0] != "done" or rs[0][2] != int(j[1:])]
        broker_log = d.log("broker")
    finally:
        if watch is not None:
            watch.scan()
        d.close()
    time.sleep(1.0)
    # A killed sandbox's FUSE helpers may take a moment to unmount and exit: wait for them (without polling),
    # and report how many were still there at first.
    slow = watch.left() if watch else []
    wait_gone(slow, 30.0)
    leftovers = _leftovers(home, local_dir, watch)
    left_on_disk = [str(p) for p in d.deployment_dir.glob("nodes/*/sandboxes/*.json")]
    if local_dir is not None:
        left_on_disk += [str(p) for p in local_dir.iterdir()]
    summary = {
        "runtime": args.runtime, "sandboxes_seen": len(watch.sessions) if watch else 0,
        "jobs": args.jobs, "nodes": args.nodes, "node_kills": node_kills, "broker_kills": broker_kills,
        "elapsed_s": round(elapsed_s, 1), "lost": len(lost), "duplicated": len(duplicated),
        "conflicting": len(conflicting), "not_done_or_wrong": len(wrong), "refused": len(client.refused),
        "unknown_after_restart": len(client.unknown_after_restart), "orphan_processes": len(leftovers),
        "sandbox_processes_alive_1s_after_close": len(slow),
        "left_on_disk": len(left_on_disk),
    }
    if left_on_disk:
        print("left on disk:", *left_on_disk[:20], sep="\n  ", file=sys.stderr)
    if leftovers:
        print("left over:", *leftovers, sep="\n  ", file=sys.stderr)
    if lost or wrong:
        print("lost:", lost[:20], "wrong:", wrong[:20], "\nbroker log tail:\n", broker_log[-3000:], file=sys.stderr)
    print(json.dumps(summary), flush=True)
    bad = (summary["lost"] or summary["duplicated"] or summary["conflicting"] or summary["not_done_or_wrong"]
           or leftovers or left_on_disk)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
