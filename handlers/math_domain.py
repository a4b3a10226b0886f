"""``math``: a problem in, a ``\\boxed{}`` answer out, with a persistent Python tool in a sandbox.

Instance (the loader turns DeepScaleR / MATH / AMC rows into this)::

    {"problem": "Compute 1/2 + 1/4.", "answer": "\\frac{3}{4}",
     "settings": {"max_turns": 4}}          # optional overrides (docs/domains.md)

The model may call ``python`` (sympy is in the image) any number of times;
the last ``\\boxed{...}`` of its final turn is its answer (or a later
``<answer>...</answer>``; without either, a last line ``Answer: ...`` as
DAPO-Math-17k's prompt asks, or the number after a last ``####`` as GSM8K's
does: a model trained on those rows answers so). EVAL: reward 1.0
when that answer is mathematically equivalent to ``answer`` (math-verify,
sympy fallback), else 0.0; ``output["predicted"]`` and ``output["verdict"]``
record what was parsed and how it was judged. An answer that may be
astronomically large (``9^{9^{9}}``, factorials) is judged in a child process
killed after ``min(20 s, eval_timeout_s)``: past that it scores 0.0.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from prorl_cli.domains.answers import gsm8k_final, math_answer, math_equal_bounded
from prorl_cli.domains.sandbox_tools import PYTHON
from prorl_cli.node.handler import AgentHandler, HandlerSettings, JobContext, final_text

SYSTEM = (
    "You are a careful mathematician. Reason step by step; you may run Python (with sympy) through the "
    "python tool. Put the final answer in \\boxed{...}."
)


class MathHandler(AgentHandler):
    """Math problems scored by mathematical equivalence."""

    name = "math"
    defaults = HandlerSettings(
        max_turns=6, system_prompt=SYSTEM, tools=("python",), image="math",
        init_timeout_s=120.0, run_timeout_s=900.0, eval_timeout_s=60.0, max_tokens=1024,
        tool_timeout_s=30.0,
    )
    tools = (PYTHON,)

    async def init(self, ctx: JobContext) -> None:
        ctx.output["domain"] = self.name
        if not isinstance(ctx.instance, dict):
            raise ValueError(f"math: an instance must be a JSON object, got {type(ctx.instance).__name__}")
        if not isinstance(ctx.instance.get("problem", ctx.instance.get("question")), str):
            raise ValueError("math: instance needs a 'problem' string")
        if "answer" not in ctx.instance:
            raise ValueError("math: instance needs an 'answer'")
        if "python" in (ctx.settings.tools or ()):
            await ctx.start_sandbox(network=False)

    async def run(self, ctx: JobContext) -> None:
        await ctx.agent(ctx.instance.get("problem", ctx.instance.get("question")))

    async def eval(self, ctx: JobContext) -> None:
        traj = ctx.trajectory
        answer = math_answer(final_text(traj)) if traj.stop_reason == "stop" else None
        # Off the event loop; an answer such as 9^{9^{9}} is judged in a child process killed at the limit
        # (in a thread it would go on computing after the EVAL limit, holding CPU and memory).
        limit_s = min(20.0, float(ctx.settings.eval_timeout_s or 20.0))
        gold = gsm8k_final(str(ctx.instance["answer"]))  # a GSM8K row given as it is published
        verdict = await asyncio.to_thread(math_equal_bounded, gold, answer, timeout_s=limit_s)
        ctx.output["predicted"] = answer
        ctx.output["verdict"] = asdict(verdict)
        ctx.reward = 1.0 if verdict.correct else 0.0
