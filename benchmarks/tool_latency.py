"""Tool latency: prorl's PTY bash over a Unix socket, against TCP and a tmux-polling shell.

One run measures, on this machine:

1. the round trip of a trivial bash command (``true``, ``echo x``) through
   prorl's tool server over its Unix domain socket;
2. the same server over TCP loopback;
3. a tmux-based shell that sends keys and polls ``capture-pane`` for a
   prompt marker, the way earlier agent runtimes drove bash (polled as fast
   as tmux answers: the best case for the baseline);
4. the same round trip into a real Apptainer and bubblewrap sandbox;

and prints p50/p99 and the ratios; then sandbox start-to-ready times
(Apptainer with a SIF and with a sandbox directory, bubblewrap, local).

    python benchmarks/tool_latency.py [--n 500] [--starts 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from prorl_cli.sandbox import SandboxConfig, SandboxManager
from prorl_cli.sandbox.client import ToolClient
from prorl_cli.sandbox.runtime import TOOLSERVER_PATH

REPO = Path(__file__).resolve().parent.parent

IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))
COMMANDS = ("true", "echo x")
log = logging.getLogger("bench")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def fmt_ms(values: list[float]) -> str:
    return f"p50 {pct(values, 0.5) * 1e3:8.3f} ms   p99 {pct(values, 0.99) * 1e3:8.3f} ms"


async def time_calls(call: Callable[[str], Awaitable[object]], n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for cmd in COMMANDS:
        for _ in range(20):  # warm-up
            await call(cmd)
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            await call(cmd)
            samples.append(time.perf_counter() - t)
        out[cmd] = samples
    return out


async def bench_server(n: int, tcp: bool) -> dict[str, list[float]]:
    """The tool server as a plain child process (no sandbox): transport cost only."""
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-"))
    args = ["--tcp", "127.0.0.1:0"] if tcp else ["--socket", str(tmp / "ts.sock")]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(TOOLSERVER_PATH), *args, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        ready = (await proc.stdout.readline()).decode().split()
        if tcp:
            host, port = ready[1].rsplit(":", 1)
            client = await ToolClient.connect_tcp(host, int(port))
        else:
            client = await ToolClient.connect_unix(str(tmp / "ts.sock"))

        async def call(cmd: str) -> object:
            return await client.call("bash", 30.0, command=cmd, timeout_s=10.0)

        result = await time_calls(call, n)
        await client.close()
        return result
    finally:
        proc.terminate()
        await proc.wait()
        shutil.rmtree(tmp)


def bench_tmux(n: int) -> dict[str, list[float]]:
    """send-keys, then poll capture-pane until this command's marker shows (no sleep between polls)."""
    session = f"prorl-bench-{os.getpid()}"
    env = {**os.environ, "PS1": "$ "}
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50",
                    "bash --norc --noprofile"], check=True, env=env)
    out: dict[str, list[float]] = {}
    try:
        counter = 0

        def call(cmd: str) -> None:
            nonlocal counter
            counter += 1
            marker = f"__DONE_{counter}__"
            subprocess.run(["tmux", "send-keys", "-t", session, f"{cmd}; echo {marker[:2]}''{marker[2:]}", "Enter"],
                           check=True)
            while marker not in subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                               capture_output=True, text=True, check=True).stdout:
                pass

        for cmd in COMMANDS:
            for _ in range(5):
                call(cmd)
            samples = []
            for _ in range(n):
                t = time.perf_counter()
                call(cmd)
                samples.append(time.perf_counter() - t)
            out[cmd] = samples
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    return out


async def bench_sandbox(runtime: str, image: str, n: int) -> dict[str, list[float]]:
    state = Path(tempfile.mkdtemp(prefix="prorl-bench-state-"))
    manager = SandboxManager(SandboxConfig(runtime=runtime, image=image), state, log)  # type: ignore[arg-type]
    sb = await manager.start("bench")
    try:
        async def call(cmd: str) -> object:
            return await sb.bash(cmd)

        return await time_calls(call, n)
    finally:
        await manager.stop_all()
        shutil.rmtree(state)


async def start_times(runtime: str, image: str, n: int) -> list[float]:
    state = Path(tempfile.mkdtemp(prefix="prorl-bench-state-"))
    manager = SandboxManager(SandboxConfig(runtime=runtime, image=image), state, log)  # type: ignore[arg-type]
    times = []
    try:
        for i in range(n):
            t = time.perf_counter()
            sb = await manager.start(f"s{i}")
            await sb.bash("true")
            times.append(time.perf_counter() - t)
            await sb.stop()
    finally:
        await manager.stop_all()
        shutil.rmtree(state)
    return times


def start_times_as_user(user: str, runtime: str, image: str, n: int) -> list[float]:
    """The same measurement as an unprivileged user (rootless, as on a cluster)."""
    state = Path(tempfile.mkdtemp(prefix="prorl-bench-user-"))
    pw = pwd.getpwnam(user)
    os.chown(state, pw.pw_uid, pw.pw_gid)
    args = json.dumps({"config": {"runtime": runtime, "image": image}, "state_dir": str(state), "n": n})
    try:
        proc = subprocess.run(
            ["runuser", "-u", user, "--", "env", f"PYTHONPATH={REPO}", "/usr/bin/python3",
             "-m", "tests.sandbox.scenarios", "start_time", args],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )
    finally:
        shutil.rmtree(state)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-1000:])
    times: list[float] = json.loads(proc.stdout.strip().splitlines()[-1])["times_s"]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=500, help="calls per command and transport")
    parser.add_argument("--starts", type=int, default=5, help="sandbox starts per runtime")
    parser.add_argument("--user", default="prorl-test", help="unprivileged user for rootless start times (as root)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    print(f"# tool latency on {os.uname().nodename}: {os.cpu_count()} cores, python {sys.version.split()[0]}, "
          f"uid {os.getuid()}, n={args.n}")
    rows: dict[str, dict[str, list[float]]] = {}
    rows["prorl PTY bash, Unix socket"] = asyncio.run(bench_server(args.n, tcp=False))
    rows["prorl PTY bash, TCP loopback"] = asyncio.run(bench_server(args.n, tcp=True))
    if shutil.which("tmux"):
        rows["tmux send-keys + capture-pane polling"] = bench_tmux(max(50, args.n // 5))
    else:
        print("(tmux not installed: baseline skipped)")
    if shutil.which("apptainer") and (IMAGES / "python.sif").exists():
        rows["prorl, inside an Apptainer sandbox (SIF)"] = asyncio.run(
            bench_sandbox("apptainer", str(IMAGES / "python.sif"), args.n))
    if shutil.which("bwrap") and (IMAGES / "python-rootfs").exists():
        rows["prorl, inside a bubblewrap sandbox"] = asyncio.run(
            bench_sandbox("bwrap", str(IMAGES / "python-rootfs"), args.n))

    print("\n## round trip of a trivial bash command")
    for name, by_cmd in rows.items():
        for cmd, samples in by_cmd.items():
            print(f"{name:46s} {cmd!r:9s} {fmt_ms(samples)}")
    base = rows["prorl PTY bash, Unix socket"]
    print("\n## ratios (p50, against prorl over the Unix socket)")
    for name, by_cmd in rows.items():
        if by_cmd is base:
            continue
        for cmd in COMMANDS:
            ratio = pct(by_cmd[cmd], 0.5) / pct(base[cmd], 0.5)
            print(f"{name:46s} {cmd!r:9s} {ratio:7.1f}x")

    print(f"\n## sandbox start to first tool answer (seconds, {args.starts} starts each)")
    starts: list[tuple[str, str, str]] = [("local (no isolation)", "local", "")]
    if shutil.which("apptainer"):
        starts += [("apptainer SIF", "apptainer", str(IMAGES / "python.sif")),
                   ("apptainer sandbox dir", "apptainer", str(IMAGES / "python"))]
    if shutil.which("bwrap"):
        starts += [("bubblewrap rootfs", "bwrap", str(IMAGES / "python-rootfs")), ("bubblewrap host /usr", "bwrap", "host")]
    for label, runtime, image in starts:
        if image and image != "host" and not Path(image).exists():
            print(f"{label:28s} skipped: {image} missing")
            continue
        if os.getuid() == 0 and runtime != "local" and not (runtime == "apptainer" and image.endswith("/python")):
            # Root's SIF mounts use FUSE (fast); report that, and the rootless figure below.
            t = asyncio.run(start_times(runtime, image, args.starts))
            print(f"{label + ' (root)':40s} median {statistics.median(t):6.3f} s   max {max(t):6.3f} s")
        if os.getuid() == 0 and runtime != "local":
            try:
                pwd.getpwnam(args.user)
                t = start_times_as_user(args.user, runtime, image, args.starts)
                print(f"{label + ' (rootless)':40s} median {statistics.median(t):6.3f} s   max {max(t):6.3f} s")
            except (KeyError, RuntimeError) as e:
                print(f"{label + ' (rootless)':40s} skipped: {e}")
        elif os.getuid() != 0 or runtime == "local":
            t = asyncio.run(start_times(runtime, image, args.starts))
            print(f"{label:40s} median {statistics.median(t):6.3f} s   max {max(t):6.3f} s")


if __name__ == "__main__":
    main()
