"""``chaos_sandbox``: a handler that starts a real sandbox per job, for the chaos run's sandbox runtimes.

INIT starts a sandbox in the node's configured runtime (``sandbox.runtime``, ``sandbox.image``); RUN makes
one tool call in it (``bash``: echo the instance's number back) and then waits ``hold_s`` with the sandbox
up, so that a node killed meanwhile leaves live sandboxes behind; EVAL checks the echo. Instance::

    {"echo": 17, "hold_s": 0.5}

Load it on a node with ``prorl serve node --handlers scripts/chaos/sandbox_handler.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prorl_cli.node.handler import AgentHandler, JobContext


class ChaosSandboxHandler(AgentHandler):
    """One sandbox and one tool call per job."""

    name = "chaos_sandbox"

    async def init(self, ctx: JobContext) -> None:
        ctx.state["sandbox"] = await ctx.start_sandbox()

    async def run(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance if isinstance(ctx.instance, dict) else {}
        echo = int(inst.get("echo", 0))
        out = await ctx.state["sandbox"].bash(f"echo {echo}")
        ctx.output["echo"] = int(out.output.strip())
        ctx.output["runtime"] = ctx.state["sandbox"].runtime
        await asyncio.sleep(float(inst.get("hold_s", 0.0)))

    async def eval(self, ctx: JobContext) -> None:
        ctx.state.pop("sandbox", None)
        ctx.reward = 1.0
