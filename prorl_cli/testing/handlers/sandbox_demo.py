"""``sandbox_demo``: a scripted agent that fixes a bug with real tools in a real sandbox.

No model: it shows what a handler does with :meth:`JobContext.start_sandbox`
and checks the tools end to end. Instance (all optional)::

    {"image": "/path/python.sif",   # default: sandbox.image from the config
     "network": false,
     "hang_in_run": false}          # await forever in RUN (tests: crashes, cancel)

INIT starts the sandbox and writes a buggy ``/work/app.py``. RUN reads it
with bash, fixes it with the editor's str_replace, runs it, evaluates an
expression in the persistent Python namespace, and copies out a ``diff``
of the fix and the program's output (EVAL runs after the sandbox is gone,
so it reads only what RUN saved). EVAL: reward 1.0 when the fixed program
prints the expected line.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prorl_cli.node.handler import AgentHandler, JobContext

BUGGY = 'def add(a, b):\n    return a - b\n\n\nprint("2 + 3 =", add(2, 3))\n'
EXPECTED = "2 + 3 = 5"


class SandboxDemoHandler(AgentHandler):
    """Runs bash, the editor, python and file copy-out in a sandbox."""

    name = "sandbox_demo"

    async def init(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance if isinstance(ctx.instance, dict) else {}
        options: dict[str, Any] = {"network": bool(inst.get("network", False))}
        if inst.get("image"):
            options["image"] = inst["image"]
        sandbox = await ctx.start_sandbox(**options)
        ctx.state["sandbox"] = sandbox
        await sandbox.write_file("/work/app.py", BUGGY.encode())
        await sandbox.bash("cd /work && cp app.py app.py.orig")
        ctx.output.update(sandbox_id=sandbox.sandbox_id, runtime=sandbox.runtime, loopback_ip=sandbox.loopback_ip)

    async def run(self, ctx: JobContext) -> None:
        sb = ctx.state["sandbox"]
        inst: dict[str, Any] = ctx.instance if isinstance(ctx.instance, dict) else {}
        steps: list[str] = []
        seen = await sb.bash("pwd; grep -n 'return' app.py")  # cwd persisted from INIT
        steps.append(seen.output)
        fix = await sb.edit("str_replace", "/work/app.py", old_str="return a - b", new_str="return a + b")
        steps.append(fix.output)
        ran = await sb.bash("python3 app.py")
        steps.append(ran.output)
        await sb.python("total = sum(range(10))")
        ctx.output["python"] = (await sb.python("total * 2")).result
        await sb.bash("diff -u app.py.orig app.py > /work/fix.diff; uname -n > /dev/null")
        ctx.output["diff"] = (await sb.read_file("/work/fix.diff")).decode()
        ctx.output["steps"] = steps
        ctx.state["program_output"] = ran.output
        ctx.output["uid_inside"] = (await sb.bash("id -u")).output.strip()
        if inst.get("hang_in_run"):
            await asyncio.Event().wait()

    async def eval(self, ctx: JobContext) -> None:
        sandbox = ctx.state.pop("sandbox", None)
        ctx.output["stopped_before_eval"] = bool(sandbox is not None and sandbox.stopped)
        ctx.reward = 1.0 if ctx.state.get("program_output", "").strip() == EXPECTED else 0.0
