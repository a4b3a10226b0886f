"""Test handler ``obs``: generate calls, agent tool calls, an optional sandbox, and failures on request.

Instance: ``{"turns": 2, "tools": 1, "sandbox": false, "fail": null | "run" | "eval", "reward": 1.0, "hold_s": 0}``
(``hold_s``: stay that long in RUN, to keep a deployment busy; with ``release``, a file path, until that file
exists, for at most ``hold_s``: the test decides when the load ends). ``obs_slow`` is the same handler under another
name, so a test can load a deployment without touching the figures of ``obs``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from prorl_cli.agent.loop import call_tool
from prorl_cli.agent.tools import ToolCall
from prorl_cli.node.handler import AgentHandler, JobContext
from prorl_cli.protocol import SamplingParams


def _add(a: int, b: int) -> str:
    return str(a + b)


class ObsHandler(AgentHandler):
    name = "obs"

    async def init(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance
        if inst.get("sandbox"):
            ctx.state["sandbox"] = await ctx.start_sandbox()

    async def run(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance
        prompt = list(range(1, 41))
        sampling = SamplingParams(max_tokens=8, ignore_eos=True)
        for _ in range(int(inst.get("turns", 2))):
            gen = await ctx.generate(prompt, sampling)
            prompt = prompt + gen.output_ids + [7, 8, 9]
            for _ in range(int(inst.get("tools", 1))):
                await call_tool({"add": _add}, ToolCall(name="add", arguments={"a": 2, "b": 3}))
        if inst.get("release"):
            release, deadline = Path(str(inst["release"])), time.monotonic() + float(inst.get("hold_s", 60.0))
            while not release.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        elif inst.get("hold_s"):
            await asyncio.sleep(float(inst["hold_s"]))
        sandbox = ctx.state.get("sandbox")
        if sandbox is not None:
            await sandbox.bash("echo hi")
        if inst.get("fail") == "run":
            ctx.log.warning("about to fail on purpose")
            raise RuntimeError("the run failed on purpose")

    async def eval(self, ctx: JobContext) -> None:
        if ctx.instance.get("fail") == "eval":
            raise ValueError("the eval failed on purpose")
        ctx.reward = float(ctx.instance.get("reward", 1.0))


class ObsSlowHandler(ObsHandler):
    name = "obs_slow"
