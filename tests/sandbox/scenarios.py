"""Sandbox scenarios run as the unprivileged test user (rootless, as on a cluster).

``python3 -m tests.sandbox.scenarios NAME ARGS_JSON`` runs one scenario and
prints one JSON line of observations on stdout; the pytest side asserts on
them. Standard library and ``prorl_cli.sandbox`` only: the test user runs
the system python3, which has nothing else installed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import SandboxError, ToolError
from prorl_cli.sandbox import Sandbox, SandboxConfig, SandboxManager
from prorl_cli.sandbox.runtime import proc_start_ticks, session_members

log = logging.getLogger("scenario")


def manager(args: dict[str, Any]) -> SandboxManager:
    config = SandboxConfig(**args["config"])
    return SandboxManager(config, Path(args["state_dir"]), log)


def descendants(pid: int) -> dict[int, int | None]:
    """pid -> start ticks of ``pid`` and everything below it (host pid namespace)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        found[p] = proc_start_ticks(p)
        todo.extend(children.get(p, []))
    return found


def _state(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()[0]


def still_alive(procs: dict[int, int | None]) -> list[int]:
    """Those of ``procs`` still running (same pid and start time).

    Zombies do not count: they are dead and wait only for their parent to
    collect the exit status (for bubblewrap's pid-namespace init that is the
    host's init, which does so on its own schedule).
    """
    return [
        p for p, ticks in procs.items()
        if ticks is not None and proc_start_ticks(p) == ticks and _state(p) not in (None, "Z", "X")
    ]


async def _tools(sb: Sandbox) -> dict[str, Any]:
    out: dict[str, Any] = {}
    await sb.bash("cd /tmp && export PRORL_T=kept")
    out["persist"] = (await sb.bash("pwd; echo $PRORL_T")).output
    t = await sb.bash("echo started; sleep 100", timeout_s=1.5)
    out["sleep"] = {"timed_out": t.timed_out, "output": t.output, "restarted": t.shell_restarted}
    out["after_sleep"] = (await sb.bash("echo usable; pwd")).output
    reads = {}
    for name, command in (("cat", "cat"), ("python_input", "python3 -c 'input()'")):
        t = await sb.bash(f"cd /tmp && export PRORL_STDIN={name}; echo waiting; {command}", timeout_s=1.5)
        reads[name] = {"timed_out": t.timed_out, "restarted": t.shell_restarted,
                       "after": (await sb.bash("pwd; echo $PRORL_STDIN")).output}
    out["reads_stdin"] = reads
    big = await sb.bash("head -c 10000000 /dev/zero | tr '\\0' x", max_output_bytes=4096)
    out["big"] = {"truncated": big.truncated, "len": len(big.output), "total": big.output_bytes,
                  "has_note": "output truncated: 10000000 bytes" in big.output}
    rc = await sb.bash("exit 7")
    out["exit"] = {"code": rc.exit_code, "restarted": rc.shell_restarted,
                   "after": (await sb.bash("echo back")).output}
    await sb.edit("create", "/tmp/e.txt", file_text="alpha\nbeta\nalpha\n")
    errors = {}
    for name, old in (("zero", "gamma"), ("two", "alpha")):
        try:
            await sb.edit("str_replace", "/tmp/e.txt", old_str=old, new_str="x")
            errors[name] = None
        except ToolError as e:
            errors[name] = str(e)
    out["edit_errors"] = errors
    relative = {}
    for name, call in (("read", lambda: sb.read_file("relative.txt")), ("write", lambda: sb.write_file("rel.txt", b"x"))):
        try:
            await call()
            relative[name] = None
        except ToolError as e:
            relative[name] = str(e)
    out["relative_paths"] = relative
    await sb.edit("str_replace", "/tmp/e.txt", old_str="beta", new_str="BETA")
    await sb.edit("insert", "/tmp/e.txt", insert_line=1, new_str="inserted")
    out["view"] = (await sb.edit("view", "/tmp/e.txt", view_range=[1, 3])).output
    await sb.edit("undo", "/tmp/e.txt")
    out["after_undo"] = (await sb.read_file("/tmp/e.txt")).decode()
    # A Windows file: edits keep its CRLF line ends and change only their own lines; undo gives its bytes back.
    original = b"one\r\ntwo\r\nthree\r\n"
    await sb.write_file("/tmp/crlf.txt", original)
    await sb.edit("str_replace", "/tmp/crlf.txt", old_str="one\ntwo", new_str="one\nTWO")
    await sb.edit("insert", "/tmp/crlf.txt", insert_line=1, new_str="ins")
    crlf = {"edited": await sb.read_file("/tmp/crlf.txt"),
            "view": (await sb.edit("view", "/tmp/crlf.txt", view_range=[1, 2])).output}
    await sb.edit("undo", "/tmp/crlf.txt")
    await sb.edit("undo", "/tmp/crlf.txt")
    crlf["undone"] = await sb.read_file("/tmp/crlf.txt") == original
    out["crlf"] = {k: v.decode() if isinstance(v, bytes) else v for k, v in crlf.items()}
    await sb.python("x = 20")
    p = await sb.python("print('side'); x * 2 + 2")
    out["python"] = {"stdout": p.stdout, "result": p.result, "error": p.error}
    p = await sb.python("import sys; sys.stdout.write('text '); sys.stdout.flush(); sys.stdout.buffer.write(b'bytes \\xff'); 7")
    out["python_binary"] = {"stdout": p.stdout, "result": p.result, "error": p.error}
    p = await sb.python("1/0")
    out["python_error"] = p.error
    p = await sb.python("import time; time.sleep(60)", timeout_s=1.0)
    out["python_timeout"] = {"timed_out": p.timed_out, "after": (await sb.python("x")).result}
    data = bytes(range(256)) + random.Random(7).randbytes(1 << 20)
    await sb.write_file("/tmp/blob.bin", data)
    back = await sb.read_file("/tmp/blob.bin")
    out["roundtrip"] = back == data
    out["shell_sees_size"] = (await sb.bash("wc -c < /tmp/blob.bin")).output.strip()
    return out


async def scenario_tools(args: dict[str, Any]) -> dict[str, Any]:
    m = manager(args)
    sb = await m.start("tools")
    try:
        return await _tools(sb)
    finally:
        await m.stop_all()


async def scenario_isolation(args: dict[str, Any]) -> dict[str, Any]:
    m = manager(args)
    a, b = await m.start("a"), await m.start("b")
    try:
        out: dict[str, Any] = {}
        out["sys_class_net"] = (await a.bash("ls /sys/class/net")).output.split()
        out["proc_net_dev"] = [
            line.split(":")[0].strip()
            for line in (await a.bash("cat /proc/net/dev")).output.splitlines() if ":" in line
        ]
        home = os.path.expanduser("~")
        marker = Path(home) / "prorl-host-secret"
        marker.write_text("TOKEN-4ab9e")
        out["home_visible"] = (await a.bash(f"cat {marker} 2>&1; echo rc=$?")).output
        out["home_listing"] = (await a.bash(f"ls -A {home} 2>&1; ls -A /home 2>&1")).output
        marker.unlink()
        out["write_toolserver"] = (await a.bash("echo x > /.prorl/toolserver.py; echo rc=$?")).output
        out["write_proc_sys"] = (await a.bash("echo 1 > /proc/sys/kernel/panic 2>&1; echo rc=$?")).output
        out["write_usr"] = (await a.bash("echo x > /usr/prorl-probe; echo rc=$?")).output
        image = a.image
        out["image_untouched"] = not Path(image, "usr", "prorl-probe").exists() if Path(image).is_dir() else True
        out["ips"] = [a.loopback_ip, b.loopback_ip]
        out["listen"] = [await _listen_8000(sb) for sb in (a, b)]
        out["env_ip"] = (await a.bash("echo $PRORL_LOOPBACK_IP")).output.strip()
        out["uid"] = (await a.bash("id -u")).output.strip()
        return out
    finally:
        await m.stop_all()


async def _listen_8000(sb: Sandbox) -> str:
    """Start a listener on the sandbox's loopback IP, port 8000, and keep it running.

    It reports through a FIFO, so the shell's ``cat`` returns exactly when the
    socket is listening (or the bind failed).
    """
    code = ("import os, socket, time\n"
            "s = socket.socket()\n"
            "try:\n"
            "    s.bind((os.environ['PRORL_LOOPBACK_IP'], 8000)); s.listen(); msg = 'listening %s:%d' % s.getsockname()\n"
            "except OSError as e:\n"
            "    msg = 'bind failed: %s' % e\n"
            "open('/tmp/ready', 'w').write(msg)\n"
            "time.sleep(60)\n")
    await sb.write_file("/tmp/listen.py", code.encode())
    result = await sb.bash("rm -f /tmp/ready; mkfifo /tmp/ready; python3 /tmp/listen.py & cat /tmp/ready")
    return result.output


async def scenario_ports(args: dict[str, Any]) -> dict[str, Any]:
    """Two sandboxes listen on port 8000 at once, each on its own loopback IP."""
    m = manager(args)
    a, b = await m.start("a"), await m.start("b")
    try:
        return {"ips": [a.loopback_ip, b.loopback_ip], "listen": [await _listen_8000(sb) for sb in (a, b)]}
    finally:
        await m.stop_all()


async def scenario_stop_clean(args: dict[str, Any]) -> dict[str, Any]:
    m = manager(args)
    sb = await m.start("stop")
    await sb.bash("sleep 300 & sleep 301 & echo started")
    # One that leaves the shell's session and is orphaned at once (a daemon's double fork): without a pid
    # namespace (local) only its pid file finds it.
    pid_file = f"/tmp/prorl-escapee-{sb.sandbox_id}.pid"
    await sb.bash(f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 302' </dev/null >/dev/null 2>&1 & "
                  f"for _ in $(seq 200); do [ -s {pid_file} ] && break; sleep 0.05; done")
    await sb.python("import threading; x = 1")
    procs = descendants(sb.pid)
    if sb.runtime == "local":
        escapee = int((await sb.read_file(pid_file)).decode())
        procs[escapee] = proc_start_ticks(escapee)
        os.unlink(pid_file)
    pgid = sb.process.pgid
    session = sb.process.spec.session_dir
    socket_path = sb.process.spec.socket_path
    records = sorted(p.name for p in (Path(args["state_dir"]) / "sandboxes").glob("*.json"))
    await sb.stop()
    await sb.stop()  # idempotent
    group = [int(e) for e in os.listdir("/proc")
             if e.isdigit() and _pgid(int(e)) == pgid and _state(int(e)) not in (None, "Z", "X")]
    in_session = [p for p in session_members(pgid) if _state(p) not in (None, "Z", "X")]
    return {
        "n_procs": len(procs), "alive_after": still_alive(procs), "group_after": group, "session_after": in_session,
        "session_left": session.exists(), "socket_left": socket_path.exists(),
        "records_before": records,
        "records_after": sorted(p.name for p in (Path(args["state_dir"]) / "sandboxes").glob("*.json")),
    }


async def scenario_stop_cancelled(args: dict[str, Any]) -> dict[str, Any]:
    """A stop whose caller is cancelled part-way (a job's stage timeout while its sandbox stops) still ends it."""
    m = manager(args)
    sb = await m.start("cancelled-stop")
    await sb.bash("sleep 300 & echo started")
    procs = descendants(sb.pid)
    stopping = asyncio.ensure_future(sb.stop())
    while not sb.stopped:  # let the stop begin: it is past its first await
        await asyncio.sleep(0)
    stopping.cancel()
    try:
        await stopping
        cancelled = False
    except asyncio.CancelledError:
        cancelled = True
    await sb.stop()  # the job's cleanup stops it again: it returns once the sandbox is gone
    alive = still_alive(procs)  # while the node runs on (its shutdown's watchdog would end them anyway)
    records = sorted(p.name for p in (Path(args["state_dir"]) / "sandboxes").glob("*.json"))
    await m.stop_all()
    return {"cancelled": cancelled, "n_procs": len(procs), "alive_after": alive, "records_after": records}


async def scenario_connect_fails(args: dict[str, Any]) -> dict[str, Any]:
    """The sandbox started (ready line printed) but its tool server cannot be reached: the start fails, and stops it."""
    m = manager(args)
    seen: dict[str, Any] = {}
    real_start = m.runtime.start

    async def start_then_lose_socket(spec: Any, on_spawn: Any = None) -> Any:
        process = await real_start(spec, on_spawn)
        seen["procs"], seen["pgid"], seen["session_dir"] = descendants(process.pid), process.pgid, spec.session_dir
        spec.socket_path.unlink()  # what a connect that fails (refused, timed out, cancelled) leaves
        return process

    m.runtime.start = start_then_lose_socket  # type: ignore[method-assign]
    error = None
    try:
        await m.start("lost")
    except SandboxError as e:
        error = str(e)
    # What is still running once start has returned (no waiting: stop must be done by then).
    alive = still_alive(seen["procs"])
    in_session = [p for p in session_members(seen["pgid"]) if _state(p) not in (None, "Z", "X")]
    left = seen["session_dir"].exists()
    await m.stop_all()
    for pid in alive:  # do not leave them to the next test
        os.kill(pid, 9)
    return {"error": error, "n_procs": len(seen["procs"]), "alive_after": alive, "session_after": in_session,
            "session_dir_left": left, "records_after": sorted(p.name for p in (Path(args["state_dir"]) / "sandboxes").glob("*.json"))}


def _session_dirs_left(m: SandboxManager) -> list[str]:
    """What is left in local_dir besides the node's unpacked-SIF cache (kept on purpose, shared by sandboxes)."""
    return sorted(n for n in os.listdir(m.local_dir) if n != "unpacked") if m.local_dir.exists() else []


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


async def scenario_hold(args: dict[str, Any]) -> dict[str, Any]:
    """A stand-in node server: start sandboxes, report their processes, then wait to be killed."""
    m = manager(args)
    sandboxes = [await m.start(f"held-{i}") for i in range(args.get("n", 2))]
    for sb in sandboxes:
        await sb.bash("sleep 600 &")
    procs = {str(p): t for sb in sandboxes for p, t in descendants(sb.pid).items()}
    print(json.dumps({"procs": procs, "sessions": [str(sb.process.spec.session_dir) for sb in sandboxes]}),
          flush=True)
    await asyncio.Event().wait()  # until SIGKILL
    return {}


async def scenario_hold_mid_start(args: dict[str, Any]) -> dict[str, Any]:
    """A stand-in node server killed while a sandbox starts: its session folder exists, no process yet."""
    m = manager(args)

    async def stalled_start(spec: Any, on_spawn: Any) -> Any:
        spec.session_dir.mkdir(parents=True)
        print(json.dumps({"procs": {}, "sessions": [str(spec.session_dir)]}), flush=True)
        await asyncio.Event().wait()  # until SIGKILL

    m.runtime.start = stalled_start  # type: ignore[method-assign]
    await m.start("mid-start")
    return {}


async def scenario_reap(args: dict[str, Any]) -> dict[str, Any]:
    m = manager(args)
    reaped = m.reap_leftovers()
    procs = {int(p): t for p, t in args["procs"].items()}
    return {
        "reaped": reaped, "alive_after": still_alive(procs),
        "sessions_left": [s for s in args["sessions"] if Path(s).exists()],
        "dead_records_left": sorted(p.name for p in (Path(args.get("dead_state_dir") or args["state_dir"])
                                                     / "sandboxes").glob("*.json")),
        "reaped_again": m.reap_leftovers(),
    }


async def scenario_stop_after_sibling_died(args: dict[str, Any]) -> dict[str, Any]:
    """A node started before its sibling was killed: it stops (no start of its own reaps), and cleans up."""
    m = manager(args)
    sb = await m.start("own")
    own_session = str(sb.process.spec.session_dir)
    await m.stop_all()
    procs = {int(p): t for p, t in args["procs"].items()}
    return {
        "alive_after": still_alive(procs),
        "sessions_left": [s for s in [*args["sessions"], own_session] if Path(s).exists()],
        "dead_records_left": sorted(p.name for p in (Path(args["dead_state_dir"]) / "sandboxes").glob("*.json")),
        "own_records_left": sorted(p.name for p in (Path(args["state_dir"]) / "sandboxes").glob("*.json")),
    }


async def scenario_many(args: dict[str, Any]) -> dict[str, Any]:
    m = manager(args)
    n = args["n"]
    started = time.monotonic()
    results = await asyncio.gather(*(m.start(f"many-{i}") for i in range(n)), return_exceptions=True)
    up = [r for r in results if isinstance(r, Sandbox)]
    errors = [repr(r) for r in results if not isinstance(r, Sandbox)]
    echoes = await asyncio.gather(*(sb.bash(f"echo {i}") for i, sb in enumerate(up)))
    procs: dict[int, int | None] = {}
    for sb in up:
        procs.update(descendants(sb.pid))
    ips = {sb.loopback_ip for sb in up}
    await m.stop_all()
    return {
        "up": len(up), "errors": errors, "echo_ok": all(e.output.strip() == str(i) for i, e in enumerate(echoes)),
        "distinct_ips": len(ips), "alive_after": still_alive(procs), "live_after": len(m.live),
        "local_dir_left": _session_dirs_left(m),
        "start_s": time.monotonic() - started,
    }


async def scenario_limits(args: dict[str, Any]) -> dict[str, Any]:
    m = manager(args)
    bomb, other = await m.start("bomb"), await m.start("other")
    out: dict[str, Any] = {}
    try:
        hog = await bomb.python("x = bytearray(3 * 1024 ** 3)", timeout_s=30)
        out["hog_error"] = hog.error
        out["hog_then"] = (await bomb.python("1 + 1")).result
        shell_hog = await bomb.bash("python3 -c 'b = bytearray(3 * 1024 ** 3)' 2>&1 | tail -1; echo rc=$?")
        out["shell_hog"] = shell_hog.output
        # A classic fork bomb: backgrounded, so only stop ends it.
        fb = await bomb.bash("f() { f | f & }; f; sleep 3; echo bombed", timeout_s=10)
        out["bomb_output_tail"] = fb.output[-300:]
        out["bomb_fork_failed"] = "Resource temporarily unavailable" in fb.output or "fork" in fb.output
        out["other_during"] = (await other.bash("echo serving; ls / | wc -l")).output
        procs = descendants(bomb.pid)
        out["bomb_procs"] = len(procs)
        await bomb.stop()
        out["bomb_alive_after_stop"] = still_alive(procs)
        out["other_after"] = (await other.bash("echo still serving")).output
        return out
    finally:
        await m.stop_all()


async def scenario_bad_image(args: dict[str, Any]) -> dict[str, Any]:
    m = manager(args)
    try:
        await m.start("bad")
    except SandboxError as e:
        return {"error": str(e), "live": len(m.live),
                "records": [p.name for p in (Path(args["state_dir"]) / "sandboxes").glob("*.json")],
                "local_dir_left": _session_dirs_left(m)}
    return {"error": None}


async def scenario_start_time(args: dict[str, Any]) -> dict[str, Any]:
    """Start-to-ready seconds of ``n`` sandboxes, one after another (benchmark)."""
    m = manager(args)
    times = []
    for i in range(args["n"]):
        t = time.perf_counter()
        sb = await m.start(f"t{i}")
        await sb.bash("true")
        times.append(time.perf_counter() - t)
        await sb.stop()
    return {"times_s": times}


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    name, args = sys.argv[1], json.loads(sys.argv[2])
    result = asyncio.run(SCENARIOS[name](args))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
