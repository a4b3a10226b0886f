"""``sandbox_bash``: runs given bash (and python) steps in a sandbox, as agent tool calls; for hostile-code tests.

No model: the instance names the tool calls. Two jobs that name the same
``pair`` meet on the node (both run in the node process): the ``benign`` one
publishes where its sandbox is (its session folder and a listening port on its
loopback IP), starts its steps once the ``hostile`` one has started its own, and
runs its ``after`` steps once the hostile job's sandbox is gone. Instance::

    {"steps": [{"bash": "...", "timeout_s": 10},      # RUN, in order; "python": "..." for the python tool
               {"python": "..."}],
     "after": [{"bash": "..."}],                      # benign only: once the hostile job's sandbox is gone
     "limits": {"mem_gb": 0.5, "max_procs": 64, "disk_mb": 64, "wall_s": 0},  # SandboxLimits
     "network": false,
     "pair": "case-1", "role": "hostile" | "benign",
     "pair_timeout_s": 120}

Steps may use ``@@node_pid@@``, ``@@home@@`` (PRORL_HOME), ``@@deployment_dir@@``,
``@@local_dir@@`` (sandbox.local_dir), ``@@broker_host@@`` / ``@@broker_port@@``, and
(hostile) ``@@peer_session_dir@@`` / ``@@peer_ip@@`` / ``@@peer_port@@`` / ``@@peer_gateway@@``.

The output has each step's result (or the error that ended it), the
sandbox's identity for leftover checks (leader pid, session folder, pid
namespaces, cgroups), its limit events and its ``stop_reason``. A step that
raises ends RUN with that error (the job fails naming it); EVAL runs anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prorl_cli.node.handler import AgentHandler, JobContext
from prorl_cli.rendezvous import read_rendezvous
from prorl_cli.sandbox.options import SandboxLimits
from prorl_cli.sandbox.runtime import process_tree
from prorl_cli.sandbox.sandbox import Sandbox

PEER_REPLY = b"peer-listener-reached\n"


class _Pair:
    """What the two jobs of a pair share on the node."""

    def __init__(self) -> None:
        self.benign_ready = asyncio.Event()
        self.hostile_started = asyncio.Event()
        self.hostile_done = asyncio.Event()
        self.peer: dict[str, str] = {}


_PAIRS: dict[str, _Pair] = {}


def _pair(ctx: JobContext) -> _Pair | None:
    inst = ctx.instance if isinstance(ctx.instance, dict) else {}
    name = inst.get("pair")
    return _PAIRS.setdefault(str(name), _Pair()) if name else None


async def _wait(event: asyncio.Event, ctx: JobContext) -> None:
    inst = ctx.instance if isinstance(ctx.instance, dict) else {}
    async with asyncio.timeout(float(inst.get("pair_timeout_s", 120.0))):
        await event.wait()


async def _identity(sandbox: Sandbox) -> dict[str, Any]:
    """What identifies the sandbox's processes and files on the host (for the tests' leftover checks)."""
    own = os.readlink("/proc/self/ns/pid")
    namespaces = set()
    for pid in process_tree(sandbox.pid):
        with contextlib.suppress(OSError):
            namespaces.add(os.readlink(f"/proc/{pid}/ns/pid"))
    if not namespaces - {own}:
        # A rootless node may not read the namespaces of a fakeroot sandbox's processes (they run as its
        # subordinate ids): ask inside, where the link names the same namespace.
        inside = await sandbox.bash("readlink /proc/self/ns/pid")
        namespaces.add(inside.output.strip())
    cgroup = sandbox.process.spec.cgroup
    return {
        # Clock ticks after boot, as /proc/PID/stat's start times: the sandbox's pid namespace's init started
        # before this, and lives as long as any process in the namespace; a namespace made after this one
        # was freed may get its number again.
        "ready_ticks": int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK")),
        "id": sandbox.sandbox_id, "pid": sandbox.pid, "session_dir": str(sandbox.process.spec.session_dir),
        "pid_namespaces": sorted(namespaces - {own}), "loopback_ip": sandbox.loopback_ip,
        "cgroups": [str(d) for d in cgroup.dirs] if cgroup is not None else [],
    }


class SandboxBashHandler(AgentHandler):
    """Runs the instance's tool calls in one sandbox (see the module docstring)."""

    name = "sandbox_bash"
    eval_after_run_failure = True  # EVAL says the hostile job is over, whatever RUN did

    async def init(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance if isinstance(ctx.instance, dict) else {}
        limits = SandboxLimits(**inst["limits"]) if inst.get("limits") else None
        sandbox = await ctx.start_sandbox(network=bool(inst.get("network", False)), limits=limits)
        ctx.state["sandbox"] = sandbox
        ctx.output["sandbox"] = await _identity(sandbox)
        pair = _pair(ctx)
        if pair is None:
            return
        if inst.get("role") == "benign":
            await self._listen(ctx, sandbox, pair)
            pair.benign_ready.set()
        else:
            await _wait(pair.benign_ready, ctx)

    async def _listen(self, ctx: JobContext, sandbox: Sandbox, pair: _Pair) -> None:
        """A listener on this sandbox's loopback IP (what a job's gateway port is), relayed to the node."""

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(PEER_REPLY)
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()

        host_path, inside_path = sandbox.gateway_socket()
        server = await asyncio.start_unix_server(answer, path=str(host_path))
        ctx.state["listener"] = server
        ip, port = await sandbox.relay(inside_path)
        pair.peer.update(session_dir=str(sandbox.process.spec.session_dir), ip=ip, port=str(port),
                         gateway=str(host_path))

    def _substitute(self, ctx: JobContext, text: str, pair: _Pair | None) -> str:
        deployment_dir = Path(ctx.config.home).expanduser() / ctx.config.deployment
        local_dir = ctx.config.sandbox.local_dir or f"{os.environ.get('TMPDIR') or '/tmp'}/prorl-{os.getuid()}"
        values = {"node_pid": str(os.getpid()), "home": str(Path(ctx.config.home).expanduser()),
                  "deployment_dir": str(deployment_dir), "local_dir": local_dir}
        with contextlib.suppress(OSError, ValueError):
            address = urlparse(read_rendezvous(deployment_dir).address.replace("tcp://", "http://"))
            values.update(broker_host=address.hostname or "", broker_port=str(address.port or ""))
        if pair is not None:
            values.update({f"peer_{k}": v for k, v in pair.peer.items()})
        for key, value in values.items():
            text = text.replace(f"@@{key}@@", value)
        return text

    async def _steps(self, ctx: JobContext, steps: list[dict[str, Any]], key: str, pair: _Pair | None) -> None:
        sandbox: Sandbox = ctx.state["sandbox"]
        results: list[dict[str, Any]] = ctx.output.setdefault(key, [])
        for step in steps:
            timeout_s = step.get("timeout_s")
            try:
                if "python" in step:
                    py = await sandbox.python(self._substitute(ctx, str(step["python"]), pair), timeout_s=timeout_s)
                    results.append(asdict(py))
                else:
                    sh = await sandbox.bash(self._substitute(ctx, str(step["bash"]), pair), timeout_s=timeout_s)
                    results.append(asdict(sh))
            except Exception as e:
                results.append({"error": {"type": type(e).__name__, "message": str(e)}})
                raise
            finally:
                ctx.output["limit_events"] = sandbox.limit_events()
                ctx.output["stop_reason"] = sandbox.stop_reason

    async def run(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance if isinstance(ctx.instance, dict) else {}
        pair = _pair(ctx)
        benign = inst.get("role") == "benign"
        if pair is not None:
            if benign:
                await _wait(pair.hostile_started, ctx)
            else:
                pair.hostile_started.set()
        await self._steps(ctx, list(inst.get("steps") or []), "steps", pair)
        if pair is not None and benign:
            await _wait(pair.hostile_done, ctx)
            await self._steps(ctx, list(inst.get("after") or []), "after", pair)

    async def eval(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance if isinstance(ctx.instance, dict) else {}
        sandbox: Sandbox | None = ctx.state.pop("sandbox", None)
        listener: asyncio.Server | None = ctx.state.pop("listener", None)
        if listener is not None:
            listener.close()
        ctx.output["stopped_before_eval"] = bool(sandbox is not None and sandbox.stopped)
        if sandbox is not None:
            ctx.output["stop_reason"] = sandbox.stop_reason
        pair = _pair(ctx)
        if pair is not None:
            if inst.get("role") == "benign":
                _PAIRS.pop(str(inst["pair"]), None)  # the last of the two to need it
            else:
                pair.hostile_done.set()  # its sandbox is gone: cleanups run before EVAL
        ctx.reward = 1.0

    def init_exception(self, ctx: JobContext, exc: BaseException) -> None:
        super().init_exception(ctx, exc)
        inst = ctx.instance if isinstance(ctx.instance, dict) else {}
        pair = _pair(ctx)
        if pair is not None and inst.get("role") != "benign":
            pair.hostile_started.set()  # nothing will run: let the benign job go on
            pair.hostile_done.set()
