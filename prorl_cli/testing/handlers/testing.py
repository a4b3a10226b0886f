"""Built-in handlers for tests, benchmarks and the quickstart's no-LLM mode.

``noop`` does nothing in every stage. ``test`` does what its instance says::

    {"echo": <anything>,                      # copied to the output
     "sleep_s": {"init": 0.1, "run": 0.5},    # await in a stage
     "block_s": {"run": 10},                  # block the event loop in a stage (time.sleep)
     "block_attempt": 1,                      # ...only in this attempt
     "raise_in": "run",                       # raise RuntimeError in a stage
     "hang_in": "eval",                       # await forever in a stage
     "hang_attempt": 1,                       # ...only in this attempt (a retry elsewhere finishes)
     "on_cancel": "swallow" | "raise",        # ...and misbehave when cancelled
     "journal": "/path/dir"}                  # append "<job_id> <attempt> <stage>" per stage start

Neither calls a model: they exercise the pipeline, not an agent.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from prorl_cli.node.handler import AgentHandler, JobContext


class NoopHandler(AgentHandler):
    """Does nothing; measures the pipeline's own overhead."""

    name = "noop"

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> None:
        return None

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 1.0


class ScriptedTestHandler(AgentHandler):
    """Sleeps, raises or hangs in the stages its instance names."""

    name = "test"

    async def _stage(self, ctx: JobContext, stage: str) -> None:
        if not isinstance(ctx.instance, dict):
            raise TypeError(f"the test handler's instance must be a map, got {type(ctx.instance).__name__}")
        inst: dict[str, Any] = ctx.instance
        journal = inst.get("journal")
        if journal:
            with open(Path(journal) / f"{ctx.job_id}.log", "a") as f:
                f.write(f"{ctx.job_id} {ctx.attempt} {stage} {os.getpid()}\n")
        ctx.output.setdefault("stages", []).append(stage)
        block_s = (inst.get("block_s") or {}).get(stage)
        if block_s and inst.get("block_attempt", ctx.attempt) == ctx.attempt:
            time.sleep(float(block_s))  # deliberately blocks the node's event loop
        delay_s = (inst.get("sleep_s") or {}).get(stage)
        if delay_s:
            await asyncio.sleep(float(delay_s))
        if inst.get("raise_in") == stage:
            raise RuntimeError(f"scripted failure in {stage}")
        if inst.get("hang_in") == stage and inst.get("hang_attempt", ctx.attempt) == ctx.attempt:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                # Misbehaving handlers: swallow the cancel, or turn it into another error.
                if inst.get("on_cancel") == "swallow":
                    return
                if inst.get("on_cancel") == "raise":
                    raise RuntimeError("cleanup failed while being cancelled") from None
                raise

    async def init(self, ctx: JobContext) -> None:
        await self._stage(ctx, "init")

    async def run(self, ctx: JobContext) -> None:
        await self._stage(ctx, "run")
        inst = ctx.instance if isinstance(ctx.instance, dict) else {}
        ctx.output["echo"] = inst.get("echo")
        if inst.get("echo_sampling"):  # what reached the handler: the job's sampling as submitted
            ctx.output["sampling"] = ctx.spec.sampling.to_wire() if ctx.spec.sampling is not None else None

    async def eval(self, ctx: JobContext) -> None:
        await self._stage(ctx, "eval")
        ctx.reward = 1.0

    def init_exception(self, ctx: JobContext, exc: BaseException) -> None:
        ctx.reward = 0.0
        ctx.output["fallback"] = f"init: {type(exc).__name__}"

    def run_exception(self, ctx: JobContext, exc: BaseException) -> None:
        ctx.reward = 0.0
        ctx.output["fallback"] = f"run: {type(exc).__name__}"

    def eval_exception(self, ctx: JobContext, exc: BaseException) -> None:
        ctx.reward = 0.0
        ctx.output["fallback"] = f"eval: {type(exc).__name__}"

    def final_result(self, ctx: JobContext) -> Any:
        return {**ctx.output, "attempt": ctx.attempt, "node_id": ctx.node_id}
