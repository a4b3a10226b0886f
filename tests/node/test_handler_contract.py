"""The explicit parts of the handler contract, in one process: ctx.sandbox, ctx.trajectory, recording.

The model is the scripted engine the deployments use (real tokenizer, fixed
turns), called in-process through the node's ``Services`` seam; the
end-to-end runs through a real node are in ``test_handler_example.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent import JOB_RECORDER, Tool, Trajectory, run_tool_agent
from prorl_cli.config import ProrlConfig
from prorl_cli.domains.sandbox_tools import BASH, bash
from prorl_cli.exceptions import HandlerError
from prorl_cli.inference.contract import Generation
from prorl_cli.node.handler import AgentHandler, JobContext, Services
from prorl_cli.protocol import JobSpec, SamplingParams
from prorl_cli.testing.scripted import turn
from prorl_cli.testing.scripted_engine import ScriptedEngine


def echo(text: str) -> str:
    return text


class Echo(AgentHandler):
    name = "echo_contract"
    tools = [Tool("echo", {"type": "object", "properties": {"text": {"type": "string"}}}, echo)]

    async def run(self, ctx: JobContext) -> None:
        await ctx.agent("say hi")

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 1.0


class ScriptedServices(Services):
    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine

    async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        return await self.engine.generate(prompt_ids, sampling)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ScriptedEngine:
    script = tmp_path_factory.mktemp("contract") / "script.json"
    script.write_text(json.dumps([{"match": "say hi", "turns": [turn("", ("echo", {"text": "hi"})), "Done: hi."]}]))
    return ScriptedEngine(script, str(tiny_model))


def context(tmp_path: Path, tiny_model: Path, services: Services | None = None) -> JobContext:
    return JobContext(spec=JobSpec(job_id="j1", task="echo_contract"), instance={"tokenizer": str(tiny_model)},
                      node_id="n", run_dir=tmp_path, config=ProrlConfig(), services=services or Services(),
                      log=logging.getLogger("test"), handler=Echo())


def test_wrapping_ctx_generate_keeps_recording(engine: ScriptedEngine, tmp_path: Path, tiny_model: Path) -> None:
    async def main() -> tuple[JobContext, list[int]]:
        ctx = context(tmp_path, tiny_model, ScriptedServices(engine))
        inner, sizes = ctx.generate, []

        async def wrapped(prompt_ids: list[int], sampling: SamplingParams | None = None) -> Generation:
            sizes.append(len(prompt_ids))
            return await inner(prompt_ids, sampling)

        ctx.generate = wrapped  # type: ignore[method-assign]
        await ctx.agent("say hi")
        ctx.publish_trajectory()  # what the node does after RUN
        return ctx, sizes

    ctx, sizes = asyncio.run(main())
    assert len(ctx.trajectory.calls) == 2 and sizes == [len(c.prompt_ids) for c in ctx.trajectory.calls]
    assert ctx.output["stop_reason"] == "stop" and ctx.output["turns"] == 2
    assert Trajectory.from_dict(ctx.output["trajectory"]).sequence_ids == ctx.trajectory.sequence_ids


def test_run_tool_agent_records_into_the_running_job_whatever_generate_is(
    engine: ScriptedEngine, tmp_path: Path, tiny_model: Path
) -> None:
    async def main() -> JobContext:
        ctx = context(tmp_path, tiny_model, ScriptedServices(engine))
        token = JOB_RECORDER.set(ctx.record_trajectory)  # the node sets it for each job's task
        calls = 0

        async def bare(prompt_ids: list[int], sampling: SamplingParams) -> Generation:  # not ctx.generate at all
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("the model client fell over on call 2")
            return await engine.generate(prompt_ids, sampling)

        try:
            with pytest.raises(RuntimeError, match="fell over"):
                await run_tool_agent(bare, await ctx.chat(), [{"role": "user", "content": "say hi"}],
                                     Echo.tools, sampling=SamplingParams(max_tokens=64))
        finally:
            JOB_RECORDER.reset(token)
        return ctx

    ctx = asyncio.run(main())
    # The first call was recorded before the second failed the loop; the record says how it ended.
    assert len(ctx.trajectory.calls) == 1 and ctx.trajectory.stop_reason == "error"
    assert [m["content"] for m in ctx.trajectory.messages if m["role"] == "tool"] == ["hi"]


def test_sandbox_and_trajectory_before_any_name_the_problem(tmp_path: Path, tiny_model: Path) -> None:
    ctx = context(tmp_path, tiny_model)
    with pytest.raises(HandlerError, match="has no sandbox; start one in INIT with ctx.start_sandbox"):
        _ = ctx.sandbox
    with pytest.raises(HandlerError, match=r"has no trajectory; ctx.agent\(\) in RUN records one"):
        _ = ctx.trajectory
    # The shipped tools say the same to the model instead of a KeyError (no tool_timeout_s set anywhere).
    assert ctx.settings.tool_timeout_s is None and BASH.context
    with pytest.raises(HandlerError, match="has no sandbox"):
        asyncio.run(bash(ctx, "ls"))
    # A handler of the old contract sets ctx.state["sandbox"] itself: that is the job's sandbox too.
    marker: Any = object()
    ctx.state["sandbox"] = marker
    assert ctx.has_sandbox and ctx.sandbox is marker


class SeedRecorder(ScriptedServices):
    """The scripted engine's answers, keeping each call's sampling as the node's ``Services`` seam got it."""

    def __init__(self, engine: ScriptedEngine) -> None:
        super().__init__(engine)
        self.sampled: list[SamplingParams] = []

    async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.sampled.append(sampling)
        return await super().generate(ctx, prompt_ids, sampling)


@pytest.mark.parametrize("seed", [5, None])
def test_each_call_of_a_seeded_job_gets_a_seed_of_its_own_and_a_rerun_the_same(
        engine: ScriptedEngine, tmp_path: Path, tiny_model: Path, seed: int | None) -> None:
    """One seed for every call of a rollout would draw each turn from the same random stream: call ``n`` is
    sampled with ``derive_seed(seed, n)`` (the first with the seed), the fields the submitter left unset stay
    unset, and a rerun of the job makes the same calls with the same seeds. Unseeded calls stay unseeded."""
    from prorl_cli.protocol import derive_seed

    wire = {"job_id": "j1", "task": "echo_contract", "sampling": {"max_tokens": 32, **({"seed": seed} if seed else {})}}
    spec = JobSpec.from_wire(JobSpec.from_wire(wire).to_wire())  # as the node gets it, forwarded by the broker

    async def one_run() -> list[SamplingParams]:
        services = SeedRecorder(engine)
        ctx = JobContext(spec=spec, instance={"tokenizer": str(tiny_model)}, node_id="n", run_dir=tmp_path,
                         config=ProrlConfig(), services=services, log=logging.getLogger("test"), handler=Echo())
        await ctx.agent("say hi")
        for _ in range(2):  # a handler's own calls count on from the agent's
            await ctx.generate([1, 2, 3])
        return services.sampled

    first, again = asyncio.run(one_run()), asyncio.run(one_run())
    seeds = [s.seed for s in first]
    assert len(seeds) == 4 and seeds == [s.seed for s in again]
    if seed is None:
        assert seeds == [None] * 4
    else:
        assert seeds == [seed] + [derive_seed(seed, n) for n in (1, 2, 3)] and len(set(seeds)) == 4
    # The handler's own calls pass on only the fields the submitter gave, the new seed among them: the
    # engine's own defaults fill the rest (temperature here).
    assert [s.to_wire() for s in first[2:]] == [{"max_tokens": 32, **({"seed": x} if x else {})} for x in seeds[2:]]
