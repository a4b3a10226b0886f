"""The official ``openai`` and ``anthropic`` SDKs against the gateway: tool calls out, tool results in,
and a recorded token buffer identical to the one ``run_tool_agent`` builds for the same conversation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from prorl_cli.agent import ChatTokens, Trajectory, run_tool_agent
from prorl_cli.gateway.messages import anthropic_tools
from prorl_cli.gateway.server import Gateway
from prorl_cli.protocol import SamplingParams
from prorl_cli.training.samples import build_samples
from tests.gateway.conftest import CALC_TOOLS, ScriptedModel, open_job, turn
from tests.harness import need_module

SYSTEM = "You are a calculator agent."
USER = "What is 2+3?"
TURNS = [turn("Let me compute.", ("calculator", {"expression": "2+3"})), "The answer is 5."]


def _reference(tokenizer: Any, tools: list[dict[str, Any]]) -> Trajectory:
    """What ``run_tool_agent`` records for the same conversation (the tool answers "5")."""
    model = ScriptedModel(tokenizer, TURNS)
    return asyncio.run(run_tool_agent(
        model, ChatTokens(tokenizer, tools=tools),
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        {"calculator": lambda expression: "5"}, sampling=SamplingParams(max_tokens=256)))


def _assert_same_tokens(got: Trajectory, want: Trajectory) -> None:
    assert len(got.calls) == len(want.calls) == 2
    for g, w in zip(got.calls, want.calls, strict=True):
        assert g.prompt_ids == w.prompt_ids
        assert g.output_ids == w.output_ids
        assert g.logprobs == w.logprobs
        assert g.prefix_ok and g.segment == 0 and g.policy_version == 7
    assert got.sequence_ids == want.sequence_ids
    assert got.loss_mask == want.loss_mask
    assert got.logprobs == want.logprobs
    assert got.violations == [] and got.token_exact
    samples, report = build_samples(got.to_dict(), rollout_id="r", group_id="g", reward=1.0)
    assert len(samples) == 1 and report.merge_ratio == 1.0
    assert samples[0].input_ids == want.sequence_ids


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_sdk_tool_call_round_trip_is_token_exact(tokenizer: Any, stream: bool) -> None:
    need_module("openai", "test")
    import openai

    async def main() -> Trajectory:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, TURNS)
        job = open_job(gw, tokenizer, model)
        client = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
        try:
            if stream:
                chunks = [c async for c in await client.chat.completions.create(
                    model="prorl", messages=messages, tools=CALC_TOOLS, stream=True,
                    stream_options={"include_usage": True})]
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
                assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
                assert len(deltas) == 1 and deltas[0].id and deltas[0].function
                call_id, name, args = deltas[0].id, deltas[0].function.name, deltas[0].function.arguments
                messages.append({"role": "assistant", "content": content, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]})
            else:
                resp = await client.chat.completions.create(model="prorl", messages=messages, tools=CALC_TOOLS)
                msg = resp.choices[0].message
                assert resp.choices[0].finish_reason == "tool_calls" and msg.tool_calls
                content = msg.content or ""
                call = msg.tool_calls[0]
                call_id, name, args = call.id, call.function.name, call.function.arguments
                assert resp.usage is not None and resp.usage.prompt_tokens == len(job.trajectory.calls[0].prompt_ids)
                messages.append(msg)  # the SDK's own object, as most agents append it
            assert content == "Let me compute."
            assert name == "calculator" and json.loads(args) == {"expression": "2+3"} and call_id
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "5"})
            if stream:
                chunks = [c async for c in await client.chat.completions.create(
                    model="prorl", messages=messages, tools=CALC_TOOLS, stream=True)]
                final = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                resp = await client.chat.completions.create(model="prorl", messages=messages, tools=CALC_TOOLS)
                final = resp.choices[0].message.content or ""
                assert resp.choices[0].finish_reason == "stop" and not resp.choices[0].message.tool_calls
            assert final == "The answer is 5."
            return job.trajectory
        finally:
            await client.close()
            await gw.close()

    _assert_same_tokens(asyncio.run(main()), _reference(tokenizer, CALC_TOOLS))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_anthropic_sdk_tool_use_round_trip_is_token_exact(tokenizer: Any, stream: bool) -> None:
    need_module("anthropic", "test")
    import anthropic

    tools = [{"name": "calculator", "description": "Evaluate an arithmetic expression.",
              "input_schema": CALC_TOOLS[0]["function"]["parameters"]}]

    async def main() -> Trajectory:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, ScriptedModel(tokenizer, TURNS))
        client = anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": USER}]
        try:
            if stream:
                async with client.messages.stream(model="prorl", max_tokens=256, system=SYSTEM, messages=messages,
                                                  tools=tools) as s:
                    resp = await s.get_final_message()
            else:
                resp = await client.messages.create(model="prorl", max_tokens=256, system=SYSTEM, messages=messages,
                                                    tools=tools)
            assert resp.stop_reason == "tool_use"
            uses = [b for b in resp.content if b.type == "tool_use"]
            texts = [b.text for b in resp.content if b.type == "text"]
            assert texts == ["Let me compute."]
            assert len(uses) == 1 and uses[0].name == "calculator" and uses[0].input == {"expression": "2+3"}
            messages.append({"role": "assistant", "content": resp.content})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "5"}]})
            resp = await client.messages.create(model="prorl", max_tokens=256, system=SYSTEM, messages=messages,
                                                tools=tools)
            assert resp.stop_reason == "end_turn"
            assert [b.text for b in resp.content if b.type == "text"] == ["The answer is 5."]
            assert resp.usage.output_tokens == len(job.trajectory.calls[1].output_ids)
            return job.trajectory
        finally:
            await client.close()
            await gw.close()

    _assert_same_tokens(asyncio.run(main()), _reference(tokenizer, anthropic_tools(tools) or []))


def test_edited_history_starts_a_new_segment_with_the_reason(tokenizer: Any) -> None:
    need_module("openai", "test")
    import openai

    turns = ["First answer.", "Second answer.", "Third answer."]

    async def main() -> Trajectory:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, ScriptedModel(tokenizer, turns))
        client = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "one"}]
        try:
            for question in ("two", "three"):
                resp = await client.chat.completions.create(model="openai/prorl", messages=messages)
                messages += [{"role": "assistant", "content": resp.choices[0].message.content},
                             {"role": "user", "content": question}]
            assert [c.segment for c in job.trajectory.calls] == [0, 0]
            del messages[2:4]  # the harness drops a middle exchange (truncation)
            resp = await client.chat.completions.create(model="prorl", messages=messages)
            assert resp.choices[0].message.content == "Second answer."  # one assistant turn left in the prompt
            return job.trajectory
        finally:
            await client.close()
            await gw.close()

    traj = asyncio.run(main())
    assert [c.segment for c in traj.calls] == [0, 0, 1]
    assert [c.prefix_ok for c in traj.calls] == [True, True, False]
    (v,) = traj.violations
    assert v["call"] == 2 and v["segment"] == 1 and "message 2 (assistant) differs" in v["reason"]
    assert not traj.token_exact
    samples, report = build_samples(traj.to_dict(), rollout_id="r", group_id="g", reward=0.0)
    assert len(samples) == 2 and report.merge_ratio == 0.5


def test_session_gives_host_side_agents_a_base_url(tokenizer: Any, tiny_model: Any, tmp_path: Any) -> None:
    """``prorl_cli.gateway.session(ctx)``: an agent in the node process uses ``openai.AsyncOpenAI`` as is;
    the trajectory lands in ``ctx.output`` and the endpoint closes with the job's cleanups."""
    need_module("openai", "test")
    import logging

    import openai

    from prorl_cli.config import ProrlConfig
    from prorl_cli.gateway import session
    from prorl_cli.node.handler import JobContext, Services
    from prorl_cli.protocol import JobSpec

    model = ScriptedModel(tokenizer, ["Hello from the node."])

    class ScriptedServices(Services):
        async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Any:
            return await model(prompt_ids, sampling)

    async def main() -> None:
        ctx = JobContext(spec=JobSpec(job_id="host-1", task="agent"), instance={"tokenizer": str(tiny_model)},
                         node_id="n", run_dir=tmp_path, config=ProrlConfig(), services=ScriptedServices(),
                         log=logging.getLogger("test"))
        gw = await session(ctx)
        client = openai.AsyncOpenAI(base_url=gw.base_url(), api_key=gw.api_key, max_retries=0)
        try:
            resp = await client.chat.completions.create(model="prorl", messages=[{"role": "user", "content": "hi"}])
            assert resp.choices[0].message.content == "Hello from the node."
            assert len(ctx.output["trajectory"]["calls"]) == 1 and ctx.output["turns"] == 1
            for cleanup in ctx._cleanups:  # what the node runs after RUN
                await cleanup()
            with pytest.raises(openai.APIStatusError) as ended:
                await client.chat.completions.create(model="prorl", messages=[{"role": "user", "content": "hi"}])
            assert ended.value.status_code == 410
        finally:
            await client.close()
            await gw.gateway.close()

    asyncio.run(main())


def test_openai_streams_end_with_a_usage_chunk_only_when_asked(tokenizer: Any) -> None:
    """As OpenAI streams: the usage chunk (empty ``choices``) only with ``stream_options.include_usage``, and then
    ``usage: null`` on every other chunk; the gateway's own ``prorl`` fields ride on the finish-reason chunk,
    whichever way (chat and legacy completions)."""
    need_module("openai", "test")
    import openai

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, ScriptedModel(tokenizer, ["Streamed."] * 8))
        client = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)
        try:
            for include_usage in (None, False, True):
                options: dict[str, Any] = {} if include_usage is None else {
                    "stream_options": {"include_usage": include_usage}}
                chat = [c async for c in await client.chat.completions.create(
                    model="prorl", messages=[{"role": "user", "content": "hi"}], stream=True, **options)]
                text = [c async for c in await client.completions.create(
                    model="prorl", prompt="hi", stream=True, **options)]
                for chunks in (chat, text):
                    call = job.trajectory.calls[-1 if chunks is text else -2]
                    with_choice = chunks[:-1] if include_usage else chunks
                    assert all(c.choices for c in with_choice) and all(c.usage is None for c in with_choice)
                    last = with_choice[-1]
                    assert last.choices[0].finish_reason == "stop"
                    assert (last.model_extra or {})["prorl"] == {
                        "segment": call.segment, "continued": False, "policy_version": 7}
                    if include_usage:
                        assert chunks[-1].choices == [] and chunks[-1].usage is not None
                        assert chunks[-1].usage.completion_tokens == len(call.output_ids)
                        assert chunks[-1].usage.prompt_tokens == len(call.prompt_ids)
                assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == "Streamed."
                assert "".join(c.choices[0].text for c in text if c.choices).startswith("Streamed.")
        finally:
            await client.close()
            await gw.close()

    asyncio.run(main())


def test_tool_call_markers_that_are_special_tokens_reach_the_client(tiny_model: Any) -> None:
    """A tokenizer that marks <tool_call> special (as vLLM's Hermes parser expects some to): the call is parsed
    from the turn's text with special tokens kept, and recorded with them."""
    need_module("openai", "test")
    import openai
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    tok.add_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)],
                   special_tokens=True)

    async def main() -> tuple[Any, Trajectory]:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tok, ScriptedModel(tok, TURNS))
        client = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)
        try:
            resp = await client.chat.completions.create(model="prorl", messages=[{"role": "user", "content": USER}],
                                                        tools=CALC_TOOLS)
            return resp.choices[0], job.trajectory
        finally:
            await client.close()
            await gw.close()

    choice, traj = asyncio.run(main())
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("calculator", {"expression": "2+3"})]
    assert traj.calls[0].text == TURNS[0]
