"""The Responses API and the chat API treat the same agent the same way: the same tools, instructions and messages
render the same prompt (the same token ids) whichever API the agent's SDK speaks; what the Responses API allows
(``instructions`` as message items, ``DELETE /v1/responses/{id}``) is served as the API defines it, and what the
gateway does not serve is a clear error in the API's shape. The real ``openai`` SDK and OpenAI Agents SDK drive
the real gateway; the model is scripted behind the generate contract."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from prorl_cli.gateway.server import Gateway
from tests.gateway.conftest import CALC_TOOLS, ScriptedModel, open_job, openai_agents, turn
from tests.gateway.test_sdks import SYSTEM, USER
from tests.harness import need_module

#: The calculator with ``strict: true`` (the OpenAI Agents SDK sets it on every tool), in each API's format.
STRICT_CHAT_TOOLS = [{"type": "function", "function": {**CALC_TOOLS[0]["function"], "strict": True}}]
STRICT_RESPONSES_TOOLS = [{"type": "function", **CALC_TOOLS[0]["function"], "strict": True}]


@contextlib.asynccontextmanager
async def _sdk_job(tokenizer: Any, turns: list[str]) -> AsyncIterator[tuple[Any, Any]]:
    """A started gateway with one job answering ``turns``, and an ``openai.AsyncOpenAI`` client of it."""
    import openai

    gw = Gateway()
    await gw.start()
    job = open_job(gw, tokenizer, ScriptedModel(tokenizer, turns))
    client = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)
    try:
        yield job, client
    finally:
        await client.close()
        await gw.close()


def _prompts(tokenizer: Any, turns: list[str], *calls: Callable[[Any], Awaitable[Any]]) -> list[list[list[int]]]:
    """For each of ``calls`` (given an ``openai.AsyncOpenAI`` client), the prompt ids of the calls it made, each
    on a job of its own."""
    need_module("openai", "test")
    import openai

    async def main() -> list[list[list[int]]]:
        gw = Gateway()
        await gw.start()
        try:
            out = []
            for call in calls:
                job = open_job(gw, tokenizer, ScriptedModel(tokenizer, turns))
                client = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)
                try:
                    await call(client)
                finally:
                    await client.close()
                assert job.trajectory.calls and job.trajectory.violations == []
                out.append([c.prompt_ids for c in job.trajectory.calls])
            return out
        finally:
            await gw.close()

    return asyncio.run(main())


def test_a_strict_tool_renders_the_same_prompt_through_chat_and_responses(tokenizer: Any) -> None:
    """``strict`` reaches the template through both APIs (it is rendered, as the chat route always did)."""
    chat, responses, plain = _prompts(
        tokenizer, ["ok"],
        lambda c: c.chat.completions.create(model="prorl", tools=STRICT_CHAT_TOOLS, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]),
        lambda c: c.responses.create(model="prorl", instructions=SYSTEM, input=USER, tools=STRICT_RESPONSES_TOOLS),
        lambda c: c.chat.completions.create(model="prorl", tools=CALC_TOOLS, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]))
    assert responses == chat
    assert chat != plain  # strict is in the prompt: the comparison above is not vacuous


def test_an_agents_sdk_agent_renders_the_same_prompts_through_both_of_its_models(tokenizer: Any) -> None:
    """The same OpenAI Agents SDK agent (its tools are strict) through its Responses model (the default) and its
    Chat Completions model: every call's prompt is the same token ids."""
    openai_agents()
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
    )


    @function_tool
    def lookup_order(order_id: str) -> str:
        """Find an order by its id."""
        return f"order {order_id}: paid, 12 EUR"

    def run_with(model_class: Any) -> Callable[[Any], Awaitable[Any]]:
        async def run(client: Any) -> None:
            agent = Agent(name="refunds", instructions="You handle refunds.", tools=[lookup_order],
                          model=model_class(model="prorl", openai_client=client))
            result = await Runner.run(agent, "Refund order 7.")
            assert result.final_output == "Order 7 is refunded."

        return run

    turns = [turn("", ("lookup_order", {"order_id": "7"})), "Order 7 is refunded."]
    responses, chat = _prompts(tokenizer, turns, run_with(OpenAIResponsesModel), run_with(OpenAIChatCompletionsModel))
    assert len(responses) == 2 and responses == chat


def test_instructions_as_message_items_are_the_messages_they_hold(tokenizer: Any) -> None:
    """The API's ``instructions`` may be a list of input items: a developer message item renders as the string
    form does, and the response echoes the items."""
    echoed: list[Any] = []
    items = [{"role": "developer", "content": SYSTEM}]

    async def as_items(client: Any) -> None:
        echoed.append((await client.responses.create(model="prorl", instructions=items, input=USER)).instructions)

    string, listed, chat = _prompts(
        tokenizer, ["ok"],
        lambda c: c.responses.create(model="prorl", instructions=SYSTEM, input=USER),
        as_items,
        lambda c: c.chat.completions.create(model="prorl", messages=[
            {"role": "developer", "content": SYSTEM}, {"role": "user", "content": USER}]))
    assert listed == string == chat
    assert [(m.role, m.content) for m in echoed[0]] == [("developer", SYSTEM)]


@pytest.mark.parametrize("instructions", [
    [{"type": "function_call_output", "call_id": "call_1", "output": "5"}],
    [SYSTEM],
    {"role": "developer", "content": SYSTEM},
])
def test_instructions_that_are_not_messages_are_refused_naming_instructions(tokenizer: Any, instructions: Any) -> None:
    need_module("openai", "test")
    import openai

    async def main() -> None:
        async with _sdk_job(tokenizer, ["ok"]) as (job, client):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="prorl", instructions=instructions, input=USER)
            assert refused.value.param == "instructions"
            assert "a string or a list of message items" in refused.value.message
            assert job.trajectory.calls == []

    asyncio.run(main())


def test_top_logprobs_without_include_gives_the_empty_logprobs_openai_gives(tokenizer: Any) -> None:
    """As OpenAI's Responses API: log-probs come with ``include: ["message.output_text.logprobs"]`` only;
    ``top_logprobs`` alone is accepted and the text part carries ``logprobs: []`` (not a missing field)."""
    need_module("openai", "test")

    async def main() -> None:
        async with _sdk_job(tokenizer, ["ok", "ok"]) as (job, client):
            bare = await client.responses.create(model="prorl", input=USER, top_logprobs=2, store=False)
            assert bare.output[0].content[0].logprobs == []
            included = await client.responses.create(model="prorl", input="again", top_logprobs=2, store=False,
                                                     include=["message.output_text.logprobs"])
            logprobs = included.output[0].content[0].logprobs
            assert [p.logprob for p in logprobs] == job.trajectory.calls[1].logprobs

    asyncio.run(main())


def test_a_deleted_response_is_forgotten(tokenizer: Any) -> None:
    """``client.responses.delete``: OpenAI's answer, then neither retrieve nor ``previous_response_id`` finds it."""
    need_module("openai", "test")
    import aiohttp
    import openai

    async def main() -> None:
        async with _sdk_job(tokenizer, ["ok", "ok"]) as (job, client):
            first = await client.responses.create(model="prorl", input=USER)
            second = await client.responses.create(model="prorl", input="again")
            assert await client.responses.delete(first.id) is None
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(first.id)
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="prorl", input="go on", previous_response_id=first.id)
            assert refused.value.code == "previous_response_not_found"
            with pytest.raises(openai.NotFoundError) as again:
                await client.responses.delete(first.id)
            assert "not found" in again.value.message
            async with aiohttp.ClientSession() as session:
                answer = await session.delete(f"{job.base_url()}/responses/{second.id}")
                assert answer.status == 200
                assert await answer.json() == {"id": second.id, "object": "response", "deleted": True}
            assert second.id not in job.responses and second.id not in job.responses.objects

    asyncio.run(main())


def test_responses_input_tokens_counts_the_prompt_a_create_would_send_and_samples_nothing(tokenizer: Any) -> None:
    """``client.responses.input_tokens.count`` with the body ``create`` gets (tools, instructions, a
    ``previous_response_id``) is that create's ``usage.input_tokens``; ``model`` may be left out; nothing is
    sampled or recorded; a model the job does not serve is refused as a create is."""
    need_module("openai", "test")
    import openai

    tools = [{"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]

    async def main() -> None:
        async with _sdk_job(tokenizer, ["first", "second"]) as (job, client):
            ask: dict[str, Any] = {"input": USER, "instructions": SYSTEM, "tools": tools}
            counted = await client.responses.input_tokens.count(model="prorl", **ask)
            unnamed = await client.responses.input_tokens.count(**ask)
            assert counted.object == "response.input_tokens" and counted.input_tokens == unnamed.input_tokens
            assert job.trajectory.calls == []
            first = await client.responses.create(model="prorl", **ask)
            assert first.usage is not None and first.usage.input_tokens == counted.input_tokens > 0
            more: dict[str, Any] = {"previous_response_id": first.id, "input": "And then?", "tools": tools}
            then = await client.responses.input_tokens.count(model="prorl", **more)
            second = await client.responses.create(model="prorl", **more)
            assert second.usage is not None and second.usage.input_tokens == then.input_tokens > counted.input_tokens
            assert len(job.trajectory.calls) == 2
            with pytest.raises(openai.NotFoundError, match="model 'gpt-x' does not exist"):
                await client.responses.input_tokens.count(model="gpt-x", input=USER)

    asyncio.run(main())


def test_responses_endpoints_not_served_say_so_in_openais_error_shape(tokenizer: Any) -> None:
    """Compaction, cancelling and listing input items are each a 404 naming the endpoint and why it is not
    served, in OpenAI's error body (not a bare 405); nothing is sampled."""
    need_module("openai", "test")
    import openai

    async def main() -> None:
        async with _sdk_job(tokenizer, ["ok"]) as (job, client):
            kept = await client.responses.create(model="prorl", input=USER)
            refusals: dict[str, Callable[[], Awaitable[Any]]] = {
                "POST responses/compact": lambda: client.responses.compact(model="prorl", input=USER),
                f"POST responses/{kept.id}/cancel": lambda: client.responses.cancel(kept.id),
                f"GET responses/{kept.id}/input_items": lambda: client.responses.input_items.list(kept.id),
            }
            for named, call in refusals.items():
                with pytest.raises(openai.NotFoundError) as refused:
                    await call()
                assert refused.value.code == "unsupported_endpoint", named
                assert isinstance(refused.value.body, dict)
                assert refused.value.body["message"].startswith(f"{named} is not served by the gateway: "), (
                    named, refused.value.body)
            assert len(job.trajectory.calls) == 1

    asyncio.run(main())


def test_a_chat_messages_name_does_not_change_the_prompt(tokenizer: Any) -> None:
    """OpenAI's ``name`` on a chat message is not rendered: the chat templates the gateway serves (Qwen2's,
    Hermes', the tiny model's) have no place for it (docs/harness.md says so)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    named, plain = _prompts(
        tokenizer, ["ok"],
        lambda c: c.chat.completions.create(model="prorl", messages=[{**m, "name": "alice"} for m in messages]),
        lambda c: c.chat.completions.create(model="prorl", messages=messages))
    assert named == plain
