"""``dapo_sim``: simulated agentic rollouts for dynamic-sampling tests and benchmarks.

Instance::

    {"p": 0.5,            # probability of reward 1.0 (0 or 1: a zero-variance group)
     "scale_s": 0.05,     # duration scale: scale_s * Pareto(alpha), a long tail
     "alpha": 1.5,
     "max_s": 2.0,        # duration cap
     "fail_p": 0.0,       # probability that the run stage raises
     "seed": 0}

Reward and duration are drawn from a generator seeded by ``seed`` and the
job id, so the same job id always gives the same rollout (a restarted
trainer resubmitting its ids sees the same outcomes). No model, no sandbox.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from prorl_cli.node.handler import AgentHandler, JobContext


def draw(instance: dict[str, Any], job_id: str) -> tuple[float, float, bool]:
    """(duration_s, reward, fails) of one simulated rollout."""
    rng = random.Random(f"{instance.get('seed', 0)}:{job_id}")
    scale_s = float(instance.get("scale_s", 0.05))
    duration_s = min(float(instance.get("max_s", 2.0)), scale_s * rng.paretovariate(float(instance.get("alpha", 1.5))))
    reward = 1.0 if rng.random() < float(instance.get("p", 0.5)) else 0.0
    fails = rng.random() < float(instance.get("fail_p", 0.0))
    return duration_s, reward, fails


class DapoSimHandler(AgentHandler):
    """Sleeps a heavy-tailed time, then rewards 1 with probability ``p``."""

    name = "dapo_sim"

    async def init(self, ctx: JobContext) -> None:
        inst = ctx.instance if isinstance(ctx.instance, dict) else {}
        ctx.state["draw"] = draw(inst, ctx.job_id)

    async def run(self, ctx: JobContext) -> None:
        duration_s, _, fails = ctx.state["draw"]
        await asyncio.sleep(duration_s)
        if fails:
            raise RuntimeError("simulated rollout failure")
        ctx.output["duration_s"] = duration_s

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = ctx.state["draw"][1]
