"""Test handler ``obs_lost``, served only by the node a test kills: its jobs stay in RUN until then."""

from __future__ import annotations

import asyncio

from prorl_cli.node.handler import AgentHandler, JobContext


class ObsLostHandler(AgentHandler):
    name = "obs_lost"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> None:
        await asyncio.sleep(120)

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 1.0
