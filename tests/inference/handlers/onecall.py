"""Test handler ``onecall``: one model call on fixed prompt ids with the job's sampling.

Instance: ``{"prompt_ids": [1, 2, 3], "eval_call": false}``. RUN makes the
call; with ``eval_call`` EVAL makes one more, so a test can tell (by the
job's stage) that RUN's call is over. The output holds each call's ids,
finish reason, backend, alternatives (``top_logprobs``) and the stop string that ended it, or the error
it raised.
"""

from __future__ import annotations

from typing import Any

from prorl_cli.exceptions import InferenceError
from prorl_cli.node.handler import AgentHandler, JobContext


async def _call(ctx: JobContext) -> dict[str, Any]:
    try:
        gen = await ctx.generate(list(ctx.instance["prompt_ids"]))
    except InferenceError as e:
        return {"error": str(e)}
    return {"output_ids": gen.output_ids, "finish_reason": gen.finish_reason, "backend_id": gen.backend_id,
            "top_logprobs": gen.top_logprobs, "stop_string": gen.stop_string}


class OneCallHandler(AgentHandler):
    name = "onecall"

    async def init(self, ctx: JobContext) -> None:
        pass

    async def run(self, ctx: JobContext) -> None:
        ctx.output.update(await _call(ctx))

    async def eval(self, ctx: JobContext) -> None:
        if ctx.instance.get("eval_call"):
            ctx.output["eval"] = await _call(ctx)
        ctx.reward = 1.0 if "output_ids" in ctx.output else 0.0
