"""Test handler ``onecall``: one model call on fixed prompt ids with the job's sampling.

Instance: ``{"prompt_ids": [1, 2, 3]}``. The output holds the call's ids,
finish reason and backend, or the error it raised.
"""

from __future__ import annotations

from prorl_cli.exceptions import InferenceError
from prorl_cli.node.handler import AgentHandler, JobContext


class OneCallHandler(AgentHandler):
    name = "onecall"

    async def init(self, ctx: JobContext) -> None:
        pass

    async def run(self, ctx: JobContext) -> None:
        try:
            gen = await ctx.generate(list(ctx.instance["prompt_ids"]))
        except InferenceError as e:
            ctx.output["error"] = str(e)
            return
        ctx.output.update(output_ids=gen.output_ids, finish_reason=gen.finish_reason, backend_id=gen.backend_id)

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 1.0 if "output_ids" in ctx.output else 0.0
