"""``math``: a problem in, a ``\\boxed{}`` answer out, with a persistent Python tool in a sandbox.

Instance (the loader turns DeepScaleR / MATH / AMC rows into this)::

    {"problem": "Compute 1/2 + 1/4.", "answer": "\\frac{3}{4}",
     "settings": {"max_turns": 4}}          # optional overrides (docs/domains.md)

The model may call ``python`` (sympy is in the image) any number of times;
the last ``\\boxed{...}`` of its final turn is its answer. EVAL: reward 1.0
when that answer is mathematically equivalent to ``answer`` (math-verify,
sympy fallback), else 0.0; ``output["predicted"]`` and ``output["verdict"]``
record what was parsed and how it was judged.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from prorl_cli.agent import Trajectory
from prorl_cli.domains.answers import last_boxed, math_equal
from prorl_cli.domains.handler import DomainHandler, final_text
from prorl_cli.domains.sandbox_tools import PYTHON_SCHEMA
from prorl_cli.domains.settings import DomainSettings
from prorl_cli.node.handler import JobContext

SYSTEM = (
    "You are a careful mathematician. Reason step by step; you may run Python (with sympy) through the "
    "python tool. Put the final answer in \\boxed{...}."
)


class MathHandler(DomainHandler):
    """Math problems scored by mathematical equivalence."""

    name = "math"
    defaults = DomainSettings(
        max_turns=6, system_prompt=SYSTEM, tools=("python",), image="math",
        init_timeout_s=120.0, run_timeout_s=900.0, eval_timeout_s=60.0, max_tokens=1024,
        extra={"tool_timeout_s": 30.0},
    )
    tool_schemas = {"python": PYTHON_SCHEMA}

    async def setup(self, ctx: JobContext, settings: DomainSettings) -> None:
        if not isinstance(ctx.instance.get("problem", ctx.instance.get("question")), str):
            raise ValueError("math: instance needs a 'problem' string")
        if "answer" not in ctx.instance:
            raise ValueError("math: instance needs an 'answer'")
        await self.load_chat(ctx, settings)
        if "python" in settings.tools:
            options: dict[str, Any] = {"network": False}
            if settings.image:
                options["image"] = settings.image
            ctx.state["sandbox"] = await ctx.start_sandbox(**options)

    async def act(self, ctx: JobContext, settings: DomainSettings) -> None:
        sandbox: Any = ctx.state.get("sandbox")  # None when settings leave out the python tool
        timeout_s = float(settings.get("tool_timeout_s"))

        async def python(code: str) -> str:
            r = await sandbox.python(str(code), timeout_s=timeout_s)
            parts = [r.stdout.rstrip()] if r.stdout.strip() else []
            if r.result is not None:
                parts.append(r.result)
            if r.error:
                parts.append(f"error: {r.error}")
            if r.timed_out:
                parts.append(f"(stopped after {timeout_s:g} s)")
            return "\n".join(parts) or "(no output)"

        problem = ctx.instance.get("problem", ctx.instance.get("question"))
        await self.agent_loop(ctx, settings, problem, {"python": python})

    async def score(self, ctx: JobContext, settings: DomainSettings) -> None:
        traj = Trajectory.from_dict(ctx.output["trajectory"])
        answer = last_boxed(final_text(traj)) if traj.stop_reason == "stop" else None
        # sympy can take a while on adversarial answers: off the event loop (bounded by the EVAL limit).
        verdict = await asyncio.to_thread(math_equal, str(ctx.instance["answer"]), answer)
        ctx.output["predicted"] = answer
        ctx.output["verdict"] = asdict(verdict)
        ctx.reward = 1.0 if verdict.correct else 0.0
