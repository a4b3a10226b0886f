"""The published OpenAI Agents SDK (``openai-agents``), unmodified, through the gateway: a triage agent hands
off to a refunds agent that calls a tool. Each agent's calls are recorded under its name, both conversations
are token-exact, and a trainer can take the refunds agent's samples alone; with the SDK's default model (the
Responses API) and its Chat Completions one, run or streamed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prorl_cli.agent import Trajectory
from prorl_cli.gateway.server import Gateway
from prorl_cli.protocol import JobResult
from prorl_cli.training.samples import samples_from_results
from tests.gateway.conftest import ScriptedModel, open_job, openai_agents, sdk_model, turn
from tests.gateway.test_request_fields import FormatModel

# Turn i of a conversation = assistant turns already in its prompt: the refunds agent sees triage's handoff.
TURNS = [
    turn("", ("transfer_to_refunds", {})),
    turn("", ("lookup_order", {"order_id": "7"})),
    "Order 7 is refunded.",
]


@pytest.mark.parametrize(("api", "streamed"), [("responses", False), ("responses", True), ("chat", False)],
                         ids=["responses-run", "responses-run_streamed", "chat-run"])
def test_a_handoff_between_two_sdk_agents_is_recorded_per_agent_and_token_exact(
        tokenizer: Any, api: str, streamed: bool) -> None:
    openai_agents()
    from agents import Agent, Runner, function_tool

    looked_up: list[str] = []

    @function_tool
    def lookup_order(order_id: str) -> str:
        """Find an order by its id."""
        looked_up.append(order_id)
        return f"order {order_id}: paid, 12 EUR"

    async def main() -> tuple[Trajectory, Any, str]:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, ScriptedModel(tokenizer, TURNS))

        def model_for(name: str) -> Any:
            # Configuration only: each agent's model is the job's endpoint under the agent's name.
            return sdk_model(api, job.base_url().replace("/v1", f"/agents/{name}/v1"), job.api_key)

        refunds = Agent(name="refunds", instructions="You handle refunds.", tools=[lookup_order],
                        model=model_for("refunds"))
        triage = Agent(name="triage", instructions="You route customers.", handoffs=[refunds],
                       model=model_for("triage"))
        try:
            if streamed:
                run = Runner.run_streamed(triage, "I need a refund for order 7.")
                async for _ in run.stream_events():
                    pass
                return job.trajectory, job.buffer, str(run.final_output)
            result = await Runner.run(triage, "I need a refund for order 7.")
            return job.trajectory, job.buffer, str(result.final_output)
        finally:
            await gw.close()

    traj, buffer, final = asyncio.run(main())
    assert final == "Order 7 is refunded." and looked_up == ["7"]
    assert [c.agent for c in traj.calls] == ["triage", "refunds", "refunds"]
    assert traj.violations == [] and traj.token_exact
    assert buffer.continuity_by_conversation() == {0: 1.0, 1: 1.0}
    results = [JobResult(job_id=j, task="harness", state="done", reward=r, group_id="g",
                         output={"trajectory": traj.to_dict()}) for j, r in (("a", 1.0), ("b", 0.0))]
    batch = samples_from_results(results, agents=["refunds"])
    assert [(s.agent, s.calls) for s in batch.samples] == [("refunds", [1, 2])] * 2


@pytest.mark.parametrize(("api", "streamed"), [("responses", False), ("responses", True), ("chat", False)],
                         ids=["responses-run", "responses-run_streamed", "chat-run"])
def test_an_sdk_agent_with_tools_and_an_output_type_calls_its_tool_then_answers_in_the_type(
        tokenizer: Any, api: str, streamed: bool) -> None:
    """The SDK sends an agent's ``output_type`` as the format of every call, its tools beside it. The tool call
    goes through unconstrained; the prose answer after it is sampled again under the schema and becomes the
    typed ``final_output``."""
    openai_agents()
    import pydantic
    from agents import Agent, Runner, function_tool

    added: list[tuple[int, int]] = []

    class Sum(pydantic.BaseModel):
        total: int

    @function_tool
    def add(x: int, y: int) -> int:
        """Add two integers."""
        added.append((x, y))
        return x + y

    async def main() -> tuple[Any, Trajectory, FormatModel]:
        gw = Gateway()
        await gw.start()
        model = FormatModel(tokenizer, [turn("", ("add", {"x": 2, "y": 3})), "The sum is 5."], '{"total": 5}')
        job = open_job(gw, tokenizer, model)
        agent = Agent(name="adder", instructions="Add with the tool.", tools=[add], output_type=Sum,
                      model=sdk_model(api, job.base_url(), job.api_key))
        try:
            if streamed:
                run = Runner.run_streamed(agent, "What is 2 + 3?")
                async for _ in run.stream_events():
                    pass
                return run.final_output, job.trajectory, model
            return (await Runner.run(agent, "What is 2 + 3?")).final_output, job.trajectory, model
        finally:
            await gw.close()

    final, traj, model = asyncio.run(main())
    assert final == Sum(total=5) and added == [(2, 3)]
    assert model.asked[:2] == [None, None] and len(model.asked) == 3
    assert model.asked[2] is not None and "total" in model.asked[2]["json"]["properties"]
    assert [c.format_retried for c in traj.calls] == [False, True]
    assert traj.calls[1].structured == model.asked[2] and traj.token_exact
