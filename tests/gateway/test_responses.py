"""The OpenAI Responses API (``/v1/responses``) through the official ``openai`` SDK and the OpenAI Agents SDK's
default model (tests/gateway/test_openai_agents.py): function calls out, their outputs in, and a recorded
token buffer identical to the one ``run_tool_agent`` builds for the same conversation, however the conversation
is sent (all items each time, ``previous_response_id``, streamed)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prorl_cli.agent import Trajectory
from prorl_cli.gateway.responses_routes import RESPONSES_KEPT
from prorl_cli.gateway.server import Gateway
from tests.gateway.conftest import CALC_TOOLS, ScriptedModel, open_job, openai_agents
from tests.gateway.test_sdks import SYSTEM, TURNS, USER, _assert_same_tokens, _reference
from tests.harness import need_module

#: The calculator in the Responses API's tool format.
TOOLS = [{"type": "function", **CALC_TOOLS[0]["function"]}]


async def _job(tokenizer: Any, turns: list[str] = TURNS) -> tuple[Gateway, Any, Any]:
    import openai

    gw = Gateway()
    await gw.start()
    job = open_job(gw, tokenizer, ScriptedModel(tokenizer, turns))
    return gw, job, openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)


async def _created(client: Any, stream: bool, **kwargs: Any) -> tuple[Any, list[str]]:
    """A response, and the stream's event types when ``stream`` (the SDK's stream helper checks their order)."""
    if not stream:
        return await client.responses.create(model="prorl", **kwargs), []
    async with client.responses.stream(model="prorl", **kwargs) as events:
        kinds = [event.type async for event in events]
        return await events.get_final_response(), kinds


@pytest.mark.parametrize("how", ["all-items", "previous-id", "stream"])
def test_a_function_call_round_trip_is_token_exact(tokenizer: Any, how: str) -> None:
    need_module("openai", "test")
    stream = how == "stream"

    async def main() -> Trajectory:
        gw, job, client = await _job(tokenizer)
        try:
            items: list[Any] = [{"role": "user", "content": USER}]
            first, kinds = await _created(client, stream, instructions=SYSTEM, input=items, tools=TOOLS)
            assert first.status == "completed" and first.usage.output_tokens > 0
            message, call = first.output
            assert message.type == "message" and message.content[0].text == "Let me compute."
            assert call.type == "function_call" and call.name == "calculator"
            assert call.arguments == '{"expression": "2+3"}'
            if stream:
                assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
                assert "response.function_call_arguments.done" in kinds and "response.output_text.done" in kinds
            answer = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
            if how == "previous-id":
                second, _ = await _created(client, stream, instructions=SYSTEM, input=[answer],
                                           previous_response_id=first.id, tools=TOOLS)
            else:  # the SDKs' own way: the whole conversation, the response's items as they came back
                items += [item.model_dump(exclude_none=True) for item in first.output] + [answer]
                second, _ = await _created(client, stream, instructions=SYSTEM, input=items, tools=TOOLS)
            assert second.output_text == "The answer is 5." and second.previous_response_id == (
                first.id if how == "previous-id" else None)
            return job.trajectory
        finally:
            await client.close()
            await gw.close()

    _assert_same_tokens(asyncio.run(main()), _reference(tokenizer, CALC_TOOLS))


def test_a_cut_turn_is_incomplete_and_logprobs_come_when_included(tokenizer: Any) -> None:
    need_module("openai", "test")
    import openai

    async def main() -> None:
        gw, job, client = await _job(tokenizer, ["The answer is five, as the calculator said."])
        try:
            cut = await client.responses.create(model="prorl", input=USER, max_output_tokens=3,
                                                include=["message.output_text.logprobs"], store=False)
            assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
            assert cut.usage.output_tokens == 3
            logprobs = cut.output[0].content[0].logprobs
            assert [p.logprob for p in logprobs] == job.trajectory.calls[0].logprobs
            # Not stored: a later request cannot continue it, and OpenAI's 400 says so (harnesses match its code).
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="prorl", input="go on", previous_response_id=cut.id)
            assert (refused.value.code, refused.value.param, refused.value.type) == (
                "previous_response_not_found", "previous_response_id", "invalid_request_error")
            assert f"Previous response with id '{cut.id}' not found" in refused.value.message
            with pytest.raises(openai.NotFoundError):  # nor retrieve it
                await client.responses.retrieve(cut.id)
        finally:
            await client.close()
            await gw.close()

    asyncio.run(main())


@pytest.mark.parametrize(("fields", "named"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type 'web_search' is not supported"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema must be a JSON Schema object"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]: content parts of type 'input_image'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "items of type 'item_reference'"),
    ({"truncation": "auto"}, "truncation"),
    # OpenAI's server-side compaction, which the OpenAI Agents SDK sends from ModelSettings(context_management=...).
    ({"context_management": [{"type": "compaction", "compact_threshold": 1000}]}, "context_management"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"previous_response_id": "resp_nowhere"}, "previous_response_id"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice.name names the tool 'nope'"),
])
def test_what_the_gateway_cannot_do_is_a_clear_error(tokenizer: Any, fields: dict[str, Any], named: str) -> None:
    need_module("openai", "test")

    async def main() -> None:
        gw, job, client = await _job(tokenizer)
        try:
            with pytest.raises(Exception) as refused:
                await client.responses.create(model="prorl", **{"input": USER, **fields})
            assert getattr(refused.value, "status_code", None) in (400, 404), refused.value
            assert named in str(refused.value), refused.value
            assert job.trajectory.calls == []  # nothing was sampled
        finally:
            await client.close()
            await gw.close()

    asyncio.run(main())


def test_a_job_keeps_its_last_stored_responses(tokenizer: Any) -> None:
    need_module("openai", "test")
    import openai

    async def main() -> None:
        gw, job, client = await _job(tokenizer, ["ok"] * (RESPONSES_KEPT + 2))
        try:
            ids = [(await client.responses.create(model="prorl", input=f"q{i}")).id for i in range(RESPONSES_KEPT + 1)]
            assert len(job.responses) == RESPONSES_KEPT and ids[0] not in job.responses and ids[-1] in job.responses
            # What GET /v1/responses/{id} answers goes with them: the oldest is OpenAI's 404, the others are kept.
            assert len(job.responses.objects) == RESPONSES_KEPT
            assert (await client.responses.retrieve(ids[1])).id == ids[1]
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(ids[0])
        finally:
            await client.close()
            await gw.close()

    asyncio.run(main())


def test_the_websocket_mode_is_refused_with_an_error_the_sdks_show(tokenizer: Any) -> None:
    """The Responses API's WebSocket mode (``client.responses.connect()``, the OpenAI Agents SDK's
    ``use_responses_websocket=True``) is not served: both SDKs show why and what to use instead, not a bare
    refused upgrade; a job that ends closes a socket as a socket."""
    openai_agents()
    import aiohttp
    from agents import Agent, RunConfig, Runner
    from agents.models.openai_provider import OpenAIProvider

    async def main() -> None:
        gw, job, client = await _job(tokenizer)
        try:
            async with client.responses.connect() as connection:
                await connection.response.create(model="prorl", input=USER)
                event = await connection.recv()
            assert event.type == "error" and event.error.code == "websocket_not_supported"
            assert "HTTP only" in event.error.message
            provider = OpenAIProvider(openai_client=client, use_responses_websocket=True)
            with pytest.raises(Exception) as refused:
                await Runner.run(Agent(name="a", instructions=SYSTEM, model="prorl"), USER,
                                 run_config=RunConfig(model_provider=provider))
            assert "websocket_not_supported" in str(refused.value) and "HTTP only" in str(refused.value)
            assert job.trajectory.calls == []  # nothing was sampled
            async with aiohttp.ClientSession() as session:
                plain = await session.get(f"{job.base_url()}/responses")
                assert plain.status == 405 and "HTTP only" in (await plain.json())["error"]["message"]
                socket = await session.ws_connect(f"{job.base_url()}/responses")
                await job.close()
                closed = await socket.receive()
                assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == aiohttp.WSCloseCode.GOING_AWAY
        finally:
            await client.close()
            await gw.close()

    asyncio.run(main())
