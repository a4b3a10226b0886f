"""A RUN that times out, fails or is cancelled keeps its tokens.

The node's real pipeline runs a handler on the real agent loop; the model is
scripted (fixed ids through the generate contract) and hangs or fails on a
chosen call.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, ClassVar

from prorl_cli.agent import run_tool_agent
from prorl_cli.agent.chat import ChatTokens
from prorl_cli.config import ProrlConfig
from prorl_cli.inference import Generation
from prorl_cli.node.handler import AgentHandler, JobContext, Services
from prorl_cli.node.pipeline import Pipeline
from prorl_cli.node.registry import HandlerRegistry
from prorl_cli.protocol import JobResult, JobSpec, SamplingParams

TOOL_TURN = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call><|im_end|>'


class HangingModel(Services):
    """Answers with a tool call, then hangs (``mode="hang"``) or fails (``mode="fail"``) on the second call."""

    def __init__(self, chat: ChatTokens, mode: str) -> None:
        self.ids = chat.encode(TOOL_TURN)
        self.mode = mode
        self.calls = 0

    async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.calls += 1
        if self.calls == 1:
            return Generation(self.ids, [-0.25] * len(self.ids), "stop", "scripted")
        if self.mode == "fail":
            raise RuntimeError("the engine fell over")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class AgentHandlerUnderTest(AgentHandler):
    name = "partial"
    chat: ClassVar[Any] = None
    eval_after_run_failure = True

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> None:
        await run_tool_agent(ctx.generate, self.chat, [{"role": "user", "content": "go"}], {"echo": lambda text: text},
                             sampling=ctx.sampling, max_turns=4, record_into=ctx.output)

    async def eval(self, ctx: JobContext) -> None:
        ctx.output["evaluated_calls"] = len(ctx.output["trajectory"]["calls"])
        ctx.reward = 0.5


def _run(chat: ChatTokens, tmp_path: Path, mode: str, *, eval_after: bool = True, cancel_after_s: float | None = None) -> JobResult:
    handler = type("H", (AgentHandlerUnderTest,), {"chat": chat, "eval_after_run_failure": eval_after})
    registry = HandlerRegistry()
    registry.add(handler, "test")

    async def main() -> JobResult:
        pipeline = Pipeline(ProrlConfig(), registry, HangingModel(chat, mode), "n1", tmp_path,
                            on_stage=lambda spec, stage: None, on_done=lambda r: None)
        spec = JobSpec(job_id="j1", task="partial", stage_timeouts_s={"run": 1.0})
        task = asyncio.ensure_future(pipeline.run_job(spec, {}))
        if cancel_after_s is not None:
            await asyncio.sleep(cancel_after_s)
            task.cancel()
        return await task

    logging.getLogger("prorl").setLevel(logging.WARNING)
    return asyncio.run(main())


def _calls(result: JobResult) -> list[dict[str, Any]]:
    return result.output["trajectory"]["calls"]


def test_a_timed_out_run_returns_its_partial_trajectory(chat: ChatTokens, tmp_path: Path) -> None:
    r = _run(chat, tmp_path, "hang")
    assert r.state == "timed_out" and r.critical_error == "run"
    traj = r.output["trajectory"]
    assert traj["stop_reason"] == "timeout"
    assert len(_calls(r)) == 1 and _calls(r)[0]["output_ids"] == chat.encode(TOOL_TURN)
    assert sum(traj["loss_mask"]) == len(chat.encode(TOOL_TURN))
    # The handler chose to score it anyway; the job's state stays timed_out.
    assert r.output["evaluated_calls"] == 1 and r.reward == 0.5


def test_a_failed_run_returns_its_partial_trajectory_and_skips_eval_by_default(chat: ChatTokens, tmp_path: Path) -> None:
    r = _run(chat, tmp_path, "fail", eval_after=False)
    assert r.state == "failed"
    assert r.output["trajectory"]["stop_reason"] == "error"
    assert r.output["trajectory"]["error"]["message"] == "the engine fell over"
    assert len(_calls(r)) == 1
    assert "evaluated_calls" not in r.output and r.reward == 0.0


def test_a_cancelled_run_returns_its_partial_trajectory(chat: ChatTokens, tmp_path: Path) -> None:
    r = _run(chat, tmp_path, "hang", cancel_after_s=0.3)
    assert r.state == "cancelled"
    assert r.output["trajectory"]["stop_reason"] == "cancelled"
    assert len(_calls(r)) == 1
