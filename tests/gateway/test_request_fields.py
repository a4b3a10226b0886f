"""Request fields that real SDKs send and that change the result: applied as the API says, or a 400 naming them.

The official ``openai`` and ``anthropic`` SDKs drive the real gateway; the
model is scripted behind the generate contract. A field the gateway cannot
apply (logit bias, the legacy function-calling API, audio,
Anthropic's own server tools, ...) is refused before anything is sampled: a
client never gets a result it did not ask for. ``parallel_tool_calls: false``
(Anthropic ``disable_parallel_tool_use``) is honoured as ``tool_choice`` is: a
turn with more than one tool call is sampled again. A structured output (a JSON
format, vLLM's regex, choice or grammar) reaches the engine as ``sampling.structured``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from prorl_cli.agent import Trajectory
from prorl_cli.agent.chat import ChatTokens
from prorl_cli.agent.tools import get_tool_parser
from prorl_cli.gateway.server import Gateway
from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import SamplingParams
from tests.gateway.conftest import CALC_TOOLS, ScriptedModel, open_job, turn
from tests.gateway.test_tool_choice import (
    ANTHROPIC_TOOLS,
    CALC,
    MESSAGES,
    SEARCH,
    TOOLS,
    AttemptsModel,
)
from tests.harness import need_module

#: A turn that calls both tools at once.
BOTH = turn("Both at once.", ("calculator", {"expression": "2+3"}), ("search", {"q": "2+3"}))

#: (route, the request's extra fields, the field named in the 400).
_REFUSED: list[tuple[str, dict[str, Any], str]] = [
    # Two constraints; bad shapes.
    ("chat", {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "[0-9]+"}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "answer"}}}, "response_format"),
    ("chat", {"extra_body": {"structured_outputs": {"regex": "[0-9]+", "choice": ["a"]}}}, "structured_outputs"),
    ("completions", {"extra_body": {"guided_choice": []}}, "guided_choice"),
    ("chat", {"logit_bias": {"42": 100}}, "logit_bias"),
    ("chat", {"functions": [{"name": "calculator", "parameters": {"type": "object"}}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"parallel_tool_calls": "no", "tools": CALC_TOOLS}, "parallel_tool_calls"),
    # vLLM's extensions, as a client set up for a vLLM server sends them.
    ("chat", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, "chat_template_kwargs"),
    ("chat", {"extra_body": {"min_p": 0.05}}, "min_p"),
    ("chat", {"extra_body": {"repetition_penalty": 1.1}}, "repetition_penalty"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "calculator", "parameters": "expression"}}]},
     "tools"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "\n# end"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logit_bias": {"42": -100}}, "logit_bias"),
    ("messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ("messages", {"tools": [{"type": "text_editor_20250124", "name": "str_replace_editor"}]}, "tools"),
    ("messages", {"tools": [{"name": "calculator", "input_schema": "expression"}]}, "tools"),
    ("messages", {"thinking": {"type": "enabled"}}, "thinking"),
    ("messages", {"thinking": True}, "thinking"),
    ("messages", {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice"),
    ("messages", {"output_config": {"task_budget": {"type": "tokens", "total": 1000}}}, "output_config.task_budget"),
    ("messages", {"output_config": {"effort": "extreme"}}, "output_config.effort"),
    # A compaction request (the tool runner's compact_before_next_turn()): Anthropic answers a summary block.
    ("messages", {"extra_body": {"compaction": {"type": "compaction"}}}, "compaction"),
    # A prefill: Anthropic continues the final assistant message; the template would start a new turn.
    ("messages", {"messages": [*MESSAGES[1:], {"role": "assistant", "content": "The answer is"}]}, "messages[1]"),
]
#: Values of the same fields that ask for nothing beyond what the gateway does: answered.
_ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"extra_body": {"min_p": 0, "repetition_penalty": 1, "chat_template_kwargs": {}}}),
    ("chat", {"response_format": {"type": "text"}, "logit_bias": {}, "modalities": ["text"], "functions": [],
              "parallel_tool_calls": True, "tools": CALC_TOOLS, "seed": 3, "user": "agent-1",
              "metadata": {"run": "r1"}, "store": False}),
    ("completions", {"echo": False, "suffix": "", "best_of": 1}),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": 2048}, "metadata": {"user_id": "u-1"},
                  "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]}),
    ("messages", {"thinking": {"type": "disabled"}}),
    ("messages", {"output_config": {"effort": "high", "format": None}}),
]


async def _send(job: Any, route: str, extra: dict[str, Any]) -> Any:
    """One request through the official SDK (extra fields as the SDK sends them); the response object."""
    import anthropic
    import openai

    if route == "messages":
        async with anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key,
                                            max_retries=0) as an:
            return await an.messages.create(**{"model": "prorl", "max_tokens": 64, "messages": MESSAGES[1:], **extra})
    async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as oa:
        if route == "completions":
            return await oa.completions.create(model="prorl", prompt="2+3=", max_tokens=8, **extra)
        return await oa.chat.completions.create(model="prorl", messages=MESSAGES, **extra)


def test_fields_the_gateway_cannot_apply_are_a_400_naming_them_and_nothing_is_sampled(tokenizer: Any) -> None:
    need_module("openai", "test")
    need_module("anthropic", "test")
    import anthropic
    import openai

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, ["5"] * 100)
        job = open_job(gw, tokenizer, model)
        try:
            for route, extra, param in _REFUSED:
                with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as e:
                    await _send(job, route, extra)
                body = e.value.body
                assert isinstance(body, dict), (route, extra)
                if route == "messages":  # Anthropic's error body has no param; the message names the field
                    assert body["error"]["message"].startswith(param), (extra, body)
                else:
                    assert body["param"] == param and param in body["message"], (extra, body)
            assert model.calls == 0 and job.trajectory.calls == []
            for route, extra in _ACCEPTED:
                await _send(job, route, extra)
            assert model.calls == len(_ACCEPTED)
        finally:
            await gw.close()

    asyncio.run(main())


def _calls_made(tokenizer: Any, answers: list[str], ask: Any) -> tuple[Any, Trajectory, AttemptsModel]:
    async def main() -> tuple[Any, Trajectory, AttemptsModel]:
        gw = Gateway()
        await gw.start()
        model = FormatModel(tokenizer, answers)
        job = open_job(gw, tokenizer, model)  # type: ignore[arg-type]  # any generate function
        try:
            return await ask(job), job.trajectory, model
        finally:
            await gw.close()

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_parallel_tool_calls_false_never_gets_two_calls_when_a_retry_has_one(
        tokenizer: Any, stream: bool) -> None:
    need_module("openai", "test")
    import openai

    async def ask(job: Any) -> list[str]:
        async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
            create: dict[str, Any] = {"model": "prorl", "messages": MESSAGES, "tools": TOOLS,
                                      "parallel_tool_calls": False}
            if stream:
                chunks = [c async for c in await client.chat.completions.create(stream=True, **create)]
                return [tc.function.name for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            msg = (await client.chat.completions.create(**create)).choices[0].message
            return [c.function.name for c in msg.tool_calls or []]

    names, traj, model = _calls_made(tokenizer, [BOTH, CALC], ask)
    assert names == ["calculator"] and len(model.prompts) == 2
    (call,) = traj.calls
    assert call.output_ids == model.ids(1) and call.tool_choice_retries == 1 and not call.tool_choice_unmet
    assert traj.token_exact
    # Without the flag (or with true), two calls in one turn are what the API allows: nothing is sampled again.
    names, traj, model = _calls_made(tokenizer, [BOTH, CALC], _plain_openai(parallel_tool_calls=True))
    assert names == ["calculator", "search"] and len(model.prompts) == 1


def _plain_openai(**extra: Any) -> Any:
    async def ask(job: Any) -> list[str]:
        import openai

        async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
            msg = (await client.chat.completions.create(model="prorl", messages=MESSAGES, tools=TOOLS,
                                                        **extra)).choices[0].message
            return [c.function.name for c in msg.tool_calls or []]

    return ask


def test_anthropic_disable_parallel_tool_use_is_honoured_with_any_and_auto(tokenizer: Any) -> None:
    need_module("anthropic", "test")
    import anthropic

    def ask_with(choice: dict[str, Any]) -> Any:
        async def ask(job: Any) -> list[str]:
            async with anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key,
                                                max_retries=0) as client:
                resp = await client.messages.create(model="prorl", max_tokens=256, messages=MESSAGES[1:],
                                                    tools=ANTHROPIC_TOOLS, tool_choice=choice)  # type: ignore[arg-type]
                return [b.name for b in resp.content if b.type == "tool_use"]

        return ask

    names, traj, model = _calls_made(tokenizer, [BOTH, SEARCH], ask_with(
        {"type": "auto", "disable_parallel_tool_use": True}))
    assert names == ["search"] and len(model.prompts) == 2 and traj.calls[0].tool_choice_retries == 1
    names, traj, model = _calls_made(tokenizer, [BOTH, BOTH, BOTH], ask_with(
        {"type": "any", "disable_parallel_tool_use": True}))
    assert names == ["calculator", "search"] and len(model.prompts) == 3  # never met: the last turn, marked
    assert traj.calls[0].tool_choice_unmet


def test_a_streamed_tool_call_turn_carries_its_logprobs_as_without_streaming(tokenizer: Any) -> None:
    """``logprobs: true`` on a turn that is only tool calls: every output token's log-prob, streamed or not."""
    need_module("openai", "test")
    import openai

    async def ask(job: Any) -> tuple[list[float], list[float]]:
        async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
            create: dict[str, Any] = {"model": "prorl", "messages": MESSAGES, "tools": TOOLS, "logprobs": True}
            plain = (await client.chat.completions.create(**create)).choices[0]
            chunks = [c async for c in await client.chat.completions.create(stream=True, **create)]
            streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                        for t in c.choices[0].logprobs.content or []]
            assert plain.message.tool_calls and not plain.message.content
            return [t.logprob for t in plain.logprobs.content or []] if plain.logprobs else [], streamed

    (plain, streamed), traj, model = _calls_made(tokenizer, [SEARCH, SEARCH], ask)
    assert plain == streamed == [-0.5] * len(model.ids(0))


def test_anthropic_count_tokens_counts_the_prompt_a_call_would_send_and_samples_nothing(tokenizer: Any) -> None:
    """Claude Code calls ``/v1/messages/count_tokens`` (``?beta=true``) to manage its context: the count is the
    prompt the same messages and tools would be sent as (the next call's ``input_tokens``); nothing is recorded."""
    need_module("anthropic", "test")
    import anthropic

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, ["5"])
        job = open_job(gw, tokenizer, model)
        ask: dict[str, Any] = {"model": "prorl", "system": MESSAGES[0]["content"], "messages": MESSAGES[1:],
                               "tools": ANTHROPIC_TOOLS}
        try:
            async with anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key,
                                                max_retries=0) as client:
                counted = await client.messages.count_tokens(**ask)
                beta = await client.beta.messages.count_tokens(**ask)
                assert model.calls == 0 and job.trajectory.calls == []
                resp = await client.messages.create(max_tokens=16, **ask)
                assert counted.input_tokens == beta.input_tokens == resp.usage.input_tokens > 0
                with pytest.raises(anthropic.NotFoundError, match="model 'claude-x' does not exist"):
                    await client.messages.count_tokens(**{**ask, "model": "claude-x"})
                with pytest.raises(anthropic.BadRequestError, match="messages must be a non-empty list"):
                    await client.messages.count_tokens(**{**ask, "messages": []})
        finally:
            await gw.close()

    asyncio.run(main())


def test_claude_codes_metadata_user_id_is_accepted_and_names_the_agent(tokenizer: Any) -> None:
    """Claude Code sends ``metadata.user_id`` on every call: ``user_<sha256>_account_<uuid>_session_<uuid>``
    (159 characters when logged in) or, since v2.1.78, JSON naming its device and session (~150). Both are within
    the 256 characters Anthropic's API accepts and name the agent; past 256 is a 400 naming the field."""
    need_module("anthropic", "test")
    import anthropic

    uuid = "54c1eb09-bc4c-4d2f-98eb-6d2ab2d5e2fe"
    legacy = f"user_{'a' * 64}_account_{uuid}_session_{uuid}"
    current = json.dumps({"device_id": "b" * 64, "account_uuid": "", "session_id": uuid}, separators=(",", ":"))
    assert len(legacy) > 128 and len(current) > 128

    async def main() -> Trajectory:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, ScriptedModel(tokenizer, ["5"] * 4))
        try:
            async with anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key,
                                                max_retries=0) as client:
                for user_id in (legacy, current):
                    await client.messages.create(model="prorl", max_tokens=16, messages=MESSAGES[1:],
                                                 metadata={"user_id": user_id})
                with pytest.raises(anthropic.BadRequestError, match="metadata.user_id must name the agent in 1 to 256"):
                    await client.messages.create(model="prorl", max_tokens=16, messages=MESSAGES[1:],
                                                 metadata={"user_id": "x" * 257})
            return job.trajectory
        finally:
            await gw.close()

    traj = asyncio.run(main())
    assert [c.agent for c in traj.calls] == [legacy, current]


def test_vllm_top_k_reaches_the_model(tokenizer: Any) -> None:
    """``top_k`` (vLLM's extension; the generate contract carries it) is applied on both OpenAI routes."""
    need_module("openai", "test")
    import openai

    seen: list[int | None] = []

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, ["5"] * 4)

        async def generate(prompt_ids: list[int], sampling: Any) -> Any:
            seen.append(sampling.top_k)
            return await model(prompt_ids, sampling)

        job = open_job(gw, tokenizer, generate)
        try:
            async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
                await client.chat.completions.create(model="prorl", messages=MESSAGES, extra_body={"top_k": 20})
                await client.completions.create(model="prorl", prompt="2+3=", extra_body={"top_k": 7})
                await client.chat.completions.create(model="prorl", messages=MESSAGES)
        finally:
            await gw.close()

    asyncio.run(main())
    assert seen == [20, 7, SamplingParams().top_k]  # the job's own when the request gives none


def test_stop_strings_reach_the_engine_and_unset_fields_stay_unset(tokenizer: Any) -> None:
    """A request's stop strings go to the engine (it stops there instead of generating past them), beside the
    job's; and what neither the job nor the request set is sent as unset, so the engine's defaults apply and the
    broker's KV admission counts no ``max_tokens`` nobody asked for."""
    need_module("openai", "test")
    import openai

    seen: list[SamplingParams] = []

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, ["5"] * 4)

        async def generate(prompt_ids: list[int], sampling: Any) -> Any:
            seen.append(sampling)
            return await model(prompt_ids, sampling)

        def chat_for(tools: list[dict[str, Any]] | None) -> ChatTokens:
            return ChatTokens(tokenizer, tools=tools)

        job = gw.open_job("job-1", generate=generate, chat_for=chat_for, parser=get_tool_parser("hermes"),
                          sampling=SamplingParams.from_given(temperature=0.5, stop=["JOB"]))
        try:
            async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
                await client.chat.completions.create(model="prorl", messages=MESSAGES, stop=["END", "\n\n"])
                await client.completions.create(model="prorl", prompt="2+3=", stop="END", max_tokens=9)
                await client.chat.completions.create(model="prorl", messages=MESSAGES)
        finally:
            await gw.close()

    asyncio.run(main())
    assert [s.stop for s in seen] == [["JOB", "END", "\n\n"], ["JOB", "END"], ["JOB"]]
    wires = [s.to_wire() for s in seen]
    assert [w.get("max_tokens") for w in wires] == [None, 9, None]
    assert all(w["temperature"] == 0.5 and "top_p" not in w for w in wires), wires


#: (route, the request's extra fields, the constraint the engine is asked for), as each SDK sends them.
_CONSTRAINED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("chat", {"response_format": {"type": "json_object"}}, {"json_object": True}),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                                                                          "schema": {"type": "object"}}}},
     {"json": {"type": "object"}}),
    # A turn that answers after tools: the model may not call one, so the whole turn can be constrained.
    ("chat", {"response_format": {"type": "json_object"}, "tools": CALC_TOOLS, "tool_choice": "none"},
     {"json_object": True}),
    ("chat", {"extra_body": {"guided_json": {"type": "object"}}}, {"json": {"type": "object"}}),
    ("chat", {"extra_body": {"structured_outputs": {"regex": "[0-9]+", "json_object": False}}}, {"regex": "[0-9]+"}),
    ("completions", {"extra_body": {"guided_choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ("completions", {"extra_body": {"guided_grammar": 'root ::= "5"'}}, {"grammar": 'root ::= "5"'}),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}}},
     {"json": {"type": "object"}}),
    ("messages", {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     {"json": {"type": "object"}}),
    ("messages", {"extra_body": {"output_format": {"type": "json_schema", "schema": {"type": "object"}}}},
     {"json": {"type": "object"}}),
]


def test_a_structured_output_reaches_the_engine_as_the_calls_constraint(tokenizer: Any) -> None:
    """Each API's way to ask for JSON (or vLLM's regex, choice, grammar) is the generate call's
    ``sampling.structured``, checked as the broker checks it; a request without one sends none."""
    need_module("openai", "test")
    need_module("anthropic", "test")
    import openai

    async def main() -> list[dict[str, Any] | None]:
        gw = Gateway()
        await gw.start()
        model = FormatModel(tokenizer, ["{}"], constrained="{}")
        job = open_job(gw, tokenizer, model)
        try:
            for route, extra, _ in _CONSTRAINED:
                if route == "responses":
                    async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as oa:
                        await oa.responses.create(model="prorl", input="2+3?", **extra)
                else:
                    await _send(job, route, extra)
            await _send(job, "chat", {})
            # The trajectory says which calls were constrained (their log-probs are the masked distribution's).
            assert [c.structured for c in job.trajectory.calls] == model.asked
            return model.asked
        finally:
            await gw.close()

    assert asyncio.run(main()) == [want for _, _, want in _CONSTRAINED] + [None]


#: The answer format of the tests below: an object with an integer ``answer``.
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
_ANSWER_FORMAT: dict[str, dict[str, Any]] = {
    "chat": {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}},
    "responses": {"text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}}},
    "messages": {"output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}},
}
_ANSWER_TOOLS = {"chat": {"tools": TOOLS}, "responses": {"tools": [{"type": "function", **TOOLS[0]["function"]}]},
                 "messages": {"tools": ANTHROPIC_TOOLS}}


class FormatModel(AttemptsModel):
    """Call ``i`` sampled free gets ``answers[i]``; a call under a constraint gets ``constrained``, as an engine
    that masks the rest would sample (the constraints each call was asked under are in ``asked``)."""

    def __init__(self, tokenizer: Any, answers: list[str], constrained: str = '{"answer": 5}') -> None:
        super().__init__(tokenizer, answers)
        self.constrained = constrained
        self.asked: list[dict[str, Any] | None] = []

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Any:
        self.asked.append(sampling.structured)
        if sampling.structured is None:
            return await super().__call__(prompt_ids, sampling)
        ids = list(self.tokenizer.encode(self.constrained + "<|im_end|>", add_special_tokens=False))
        return Generation(ids, [0.0] * len(ids), "stop", "attempts")


async def _answer(job: Any, route: str, extra: dict[str, Any]) -> tuple[str, list[str]]:
    """One request with tools and the answer format; (the answer's text, the tools called)."""
    import openai

    extra = {**_ANSWER_FORMAT[route], **_ANSWER_TOOLS[route], **extra}
    if route == "responses":
        async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as oa:
            resp = await oa.responses.create(model="prorl", input="2+3?", **extra)
            return resp.output_text, [o.name for o in resp.output if o.type == "function_call"]
    resp = await _send(job, route, extra)
    if route == "messages":
        return "".join(b.text for b in resp.content if b.type == "text"), \
            [b.name for b in resp.content if b.type == "tool_use"]
    msg = resp.choices[0].message
    return msg.content or "", [c.function.name for c in msg.tool_calls or []]


@pytest.mark.parametrize("route", ["chat", "responses", "messages"])
@pytest.mark.parametrize(("free", "want"), [
    (CALC, "tool"),  # a tool call: never constrained
    ("The answer is 5.", "retried"),  # prose: sampled again under the format
    ('{"answer": "five"}', "retried"),  # JSON the schema refuses
    ('{"answer": 5}', "kept"),  # already in the format: kept, with the model's own log-probs
], ids=["tool-call", "prose", "off-schema", "in-format"])
def test_a_format_beside_tools_constrains_only_a_turn_that_answers(tokenizer: Any, route: str, free: str,
                                                                     want: str) -> None:
    """OpenAI applies a response format to the final answer, not to a turn that calls a tool (the OpenAI Agents
    SDK sends its ``output_type`` at every call, tools and all): the gateway samples the turn free, and only a
    turn that answers outside the format is sampled again under it; the trajectory records the turn returned."""
    need_module("openai", "test")
    need_module("anthropic", "test")

    (text, tools), traj, model = _calls_made(tokenizer, [free], lambda job: _answer(job, route, {}))
    assert isinstance(model, FormatModel)
    (call,) = traj.calls
    if want == "tool":
        assert tools == ["calculator"] and model.asked == [None]
    elif want == "kept":
        assert json.loads(text) == {"answer": 5} and model.asked == [None]
    else:
        assert text == '{"answer": 5}' and tools == []
        assert model.asked == [None, {"json": ANSWER_SCHEMA}]
        assert call.output_ids == list(tokenizer.encode(text + "<|im_end|>", add_special_tokens=False))
    assert call.format_retried is (want == "retried")
    assert call.structured == ({"json": ANSWER_SCHEMA} if want == "retried" else None)
    assert traj.token_exact and call.prompt_ids == model.prompts[0]


def test_a_turn_that_must_call_a_tool_is_not_held_to_the_answer_format(tokenizer: Any) -> None:
    """``tool_choice: required`` beside a format: the turn must be a tool call, so no constraint applies to it,
    even when no attempt honours the choice (the last one is answered, as generated)."""
    need_module("openai", "test")

    (text, tools), traj, model = _calls_made(tokenizer, ["Prose.", CALC],
                                             lambda job: _answer(job, "chat", {"tool_choice": "required"}))
    assert tools == ["calculator"] and model.asked == [None, None]
    (_, _), traj, model = _calls_made(tokenizer, ["Prose."] * 3,
                                      lambda job: _answer(job, "chat", {"tool_choice": "required"}))
    assert model.asked == [None] * 3 and traj.calls[0].tool_choice_unmet and not traj.calls[0].format_retried


@pytest.mark.parametrize(("structured", "text", "met"), [
    ({"choice": ["yes", "no"]}, "no", True),
    ({"choice": ["yes", "no"]}, "No.", False),
    ({"regex": "[0-9]{3}"}, "123", True),
    ({"regex": "[0-9]{3}"}, "1234", False),  # a full match, as the engine's constraint is
    ({"regex": "([0-9]"}, "1", False),  # a regex Python cannot read: the engine decides
    ({"json_object": True}, ' {"a": 1}\n', True),
    ({"json_object": True}, "[1]", False),
    ({"json": ANSWER_SCHEMA}, '{"answer": 5}', True),
    ({"json": ANSWER_SCHEMA}, '```json\n{"answer": 5}\n```', False),
    ({"json": {"type": 5}}, "5", False),  # not a schema
    ({"json": {"$ref": "https://example.invalid/s.json"}}, "5", False),  # nothing fetched: the engine decides
    ({"json": {"$schema": 5}}, "5", False),
    ({"json": {"type": "string", "pattern": "("}}, '"("', False),
    ({"json": {"type": "array"}}, "[" * 100_000 + "]" * 100_000, False),  # too deep for Python's parser
    ({"json": {"items": {"items": {"type": "integer"}}}}, "[[1, 2], [3]]", True),
    ({"grammar": 'root ::= "5"'}, "5", False),  # a grammar is left to the engine
])
def test_which_free_answers_already_meet_the_constraint(structured: dict[str, Any], text: str, met: bool) -> None:
    need_module("aiohttp", "gateway")
    from prorl_cli.gateway.buffer import meets_constraint

    assert meets_constraint(structured, text) is met
