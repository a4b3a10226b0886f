"""Test handler ``multiturn``: a fixed number of model calls with a tool observation between them.

The tiny random model never writes a tool call, so this handler does not
wait for one: it always appends an observation, which makes every job a
real multi-turn rollout through the token-exact session. Instance::

    {"tokenizer": DIR, "turns": 3, "observation": "text", "pause_s": 0}
"""

from __future__ import annotations

import asyncio
from typing import Any

from prorl_cli.agent import ChatTokens, TokenSession
from prorl_cli.exceptions import InferenceError
from prorl_cli.node.handler import AgentHandler, JobContext

_CHATS: dict[str, ChatTokens] = {}


class MultiTurnHandler(AgentHandler):
    name = "multiturn"

    async def init(self, ctx: JobContext) -> None:
        tok = ctx.instance["tokenizer"]
        if tok not in _CHATS:
            # Loading transformers takes seconds: off the event loop, or the node misses heartbeats.
            chat = await asyncio.to_thread(ChatTokens.from_pretrained, tok)
            _CHATS.setdefault(tok, chat)
        ctx.state["chat"] = _CHATS[tok]

    async def run(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance
        session = TokenSession(ctx.state["chat"], ctx.generate, [{"role": "user", "content": f"job {ctx.job_id}"}])
        ctx.output["deltas"] = []
        try:
            for turn in range(int(inst.get("turns", 3))):
                await session.generate(ctx.sampling)
                if inst.get("pause_s"):
                    await asyncio.sleep(float(inst["pause_s"]))
                if turn < int(inst.get("turns", 3)) - 1:
                    obs = f"{inst.get('observation', 'result')} {turn}: having 2+3=5"
                    ctx.output["deltas"].append(session.add_messages([{"role": "tool", "content": obs}]))
        except InferenceError:
            pass  # recorded on the trajectory by the session
        ctx.output["trajectory"] = session.trajectory.to_dict()

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 1.0 if ctx.output["trajectory"]["error"] is None else 0.0
