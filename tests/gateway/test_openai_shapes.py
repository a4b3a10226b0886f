"""What the OpenAI API serves besides sampling, and what it refuses, as the official ``openai`` SDK meets it.

``GET /v1/models/{model}`` (``client.models.retrieve``: litellm's and aider's model checks) and
``GET /v1/responses/{id}`` (``client.responses.retrieve``) answer as the API does; requests the API refuses
(more than 4 ``stop`` strings, a message without the ``content`` its role needs) are refused here too, with
OpenAI's status, type, ``param`` and ``code``, so the SDK raises its usual exception; nothing is sampled for them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from prorl_cli.gateway.server import Gateway
from tests.gateway.conftest import ScriptedModel, open_job
from tests.harness import need_module

SERVED = ("prorl", "org/model-x")


@contextlib.asynccontextmanager
async def _served(tokenizer: Any, turns: list[str], **job_options: Any) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A started gateway with one job, its scripted model and an openai client of it; all closed after."""
    import openai

    gw = Gateway()
    await gw.start()
    model = ScriptedModel(tokenizer, turns)
    job = open_job(gw, tokenizer, model, **job_options)
    client = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)
    try:
        yield job, model, client
    finally:
        await client.close()
        await gw.close()


def test_a_served_model_is_retrieved_as_listed_and_another_is_openais_404(tokenizer: Any) -> None:
    need_module("openai", "test")
    import aiohttp
    import openai

    async def main() -> None:
        async with _served(tokenizer, ["hi"], models=SERVED) as (job, _, client):
            listed = [m.to_dict() for m in (await client.models.list()).data]
            assert [m["id"] for m in listed] == list(SERVED)
            # The SDK percent-encodes the slash of "org/model-x"; the object is the list's, exactly.
            assert [(await client.models.retrieve(name)).to_dict() for name in SERVED] == listed
            async with aiohttp.ClientSession() as s:  # a client that sends the slash as is, and an agent's URL
                base = job.base_url().replace("/v1", "/agents/helper/v1")
                async with s.get(f"{base}/models/org/model-x") as r:
                    assert (r.status, await r.json()) == (200, listed[1])
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("gpt-9")
            assert (missing.value.code, missing.value.type, missing.value.param) == (
                "model_not_found", "invalid_request_error", "model")
            assert "gpt-9" in missing.value.message

    asyncio.run(main())


def test_a_kept_response_is_retrieved_as_it_was_returned(tokenizer: Any) -> None:
    need_module("openai", "test")
    import openai

    async def main() -> None:
        async with _served(tokenizer, ["one", "two"]) as (job, model, client):
            made = await client.responses.create(model="prorl", input="first")
            events = [event async for event in await client.responses.create(model="prorl", input="2nd", stream=True)]
            streamed = events[-1].response  # as response.completed carried it
            for response in (made, streamed):
                got = await client.responses.retrieve(response.id)
                assert got.model_dump() == response.model_dump()
                assert got.output_text == "one" and got.model_extra["prorl"]["policy_version"] == 7
            with pytest.raises(openai.NotFoundError) as missing:
                await client.responses.retrieve("resp_nowhere")
            assert missing.value.type == "invalid_request_error" and "resp_nowhere" in missing.value.message
            # A replay of the response's events is not kept: refused naming the field, not a stream that never ends.
            with pytest.raises(openai.BadRequestError) as replay:
                await client.responses.retrieve(made.id, stream=True)
            assert replay.value.param == "stream"
            assert model.calls == 2

    asyncio.run(main())


#: (what a chat request sends, the param OpenAI's 400 names, its code).
_REFUSED: list[tuple[dict[str, Any], str, str | None]] = [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]},
     "messages[0].content", None),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", None),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": None}]}, "messages[2].content", None),
]


@pytest.mark.parametrize(("fields", "param", "code"), _REFUSED)
def test_what_openai_refuses_is_openais_400_naming_the_param(
    tokenizer: Any, fields: dict[str, Any], param: str, code: str | None
) -> None:
    need_module("openai", "test")
    import openai

    async def main() -> None:
        async with _served(tokenizer, ["hi"]) as (job, model, client):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    **{"model": "prorl", "messages": [{"role": "user", "content": "hi"}], **fields})
            assert (refused.value.param, refused.value.code, refused.value.type) == (
                param, code, "invalid_request_error")
            assert model.calls == 0 and job.trajectory.calls == []

    asyncio.run(main())


def test_what_openai_accepts_around_those_limits_is_answered(tokenizer: Any) -> None:
    """Four stop strings, an assistant turn that only calls tools; Anthropic documents no cap on
    ``stop_sequences``, so five of them pass there; a legacy completion is capped as chat is."""
    need_module("openai", "test")
    need_module("anthropic", "test")
    import anthropic
    import openai

    async def main() -> None:
        async with _served(tokenizer, ["one", "two", "three"]) as (job, model, client):
            four = await client.chat.completions.create(model="prorl", messages=[{"role": "user", "content": "hi"}],
                                                        stop=["w", "x", "y", "z"])
            assert four.choices[0].message.content == "one"
            calls_only = [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
            assert (await client.chat.completions.create(model="prorl", messages=calls_only)).choices[0].message.content
            with pytest.raises(openai.BadRequestError) as legacy:
                await client.completions.create(model="prorl", prompt="x", stop=["a", "b", "c", "d", "e"])
            assert (legacy.value.param, legacy.value.code) == ("stop", "array_above_max_length")
            async with anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key,
                                                max_retries=0) as an:
                five = await an.messages.create(model="prorl", max_tokens=16, stop_sequences=list("vwxyz"),
                                                messages=[{"role": "user", "content": "hi"}])
                assert five.stop_reason == "end_turn"
            assert model.calls == 3

    asyncio.run(main())
