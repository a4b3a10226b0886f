"""Test handler ``calls``: a number of model calls on growing prompt ids, then an optional hold.

Instance: ``{"calls": 3, "hold_s": 0}``. RUN makes ``calls`` calls (each
prompt is the previous prompt + its output, like a multi-turn rollout) and
then sleeps ``hold_s`` (so a test keeps the job live and its backend bound).
The output lists the backend, output ids and policy version of each call,
or the error that ended RUN.
"""

from __future__ import annotations

import asyncio

from prorl_cli.exceptions import InferenceError
from prorl_cli.node.handler import AgentHandler, JobContext


class CallsHandler(AgentHandler):
    name = "calls"

    async def init(self, ctx: JobContext) -> None:
        pass

    async def run(self, ctx: JobContext) -> None:
        ctx.output["backends"] = backends = []
        ctx.output["outputs"] = outputs = []
        ctx.output["versions"] = versions = []
        prompt = [1, 2, 3]
        try:
            for _ in range(int(ctx.instance.get("calls", 3))):
                gen = await ctx.generate(prompt)
                backends.append(gen.backend_id)
                outputs.append(gen.output_ids)
                versions.append(gen.policy_version)
                prompt = prompt + gen.output_ids
        except InferenceError as e:
            ctx.output["error"] = str(e)
        await asyncio.sleep(float(ctx.instance.get("hold_s", 0)))

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 0.0 if "error" in ctx.output else 1.0
