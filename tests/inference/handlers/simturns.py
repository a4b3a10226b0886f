"""Test handler ``simturns``: a multi-turn rollout in raw token ids, for the simulated engine.

Each turn's prompt is the previous prompt + the model's output + a
made-up observation, as in a real agent loop, so a backend's prefix cache
sees a growing prompt. Instance::

    {"turns": 6, "prompt_tokens": 600, "observation_tokens": 40, "max_tokens": 32}
"""

from __future__ import annotations

import random
from typing import Any

from prorl_cli.node.handler import AgentHandler, JobContext
from prorl_cli.protocol import SamplingParams


class SimTurnsHandler(AgentHandler):
    name = "simturns"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance
        rng = random.Random(ctx.job_id)
        prompt = [rng.randrange(1, 30000) for _ in range(int(inst.get("prompt_tokens", 600)))]
        sampling = SamplingParams(max_tokens=int(inst.get("max_tokens", 32)), ignore_eos=True)
        ctx.output["backends"] = []
        for _ in range(int(inst.get("turns", 6))):
            gen = await ctx.generate(prompt, sampling)
            ctx.output["backends"].append(gen.backend_id)
            prompt = prompt + gen.output_ids + [rng.randrange(1, 30000) for _ in range(int(inst.get("observation_tokens", 40)))]
        ctx.output["prompt_tokens"] = len(prompt)

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 1.0
