"""A user's own agent program, as a TRL/veRL/SkyRL user brings it: the synchronous ``openai`` SDK, a planner
that calls tools in parallel (``tool_choice: required``), then three sub-agents at once in threads, each with a
system prompt of its own, streaming their turns (the SDK's ``stream()`` helper) and calling tools, then a final
planner call. Each conversation stays a token buffer of its own, token-exact, and its training sample's mask
covers exactly the tokens the model sampled, with their log-probs."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

import pytest

from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import SamplingParams
from prorl_cli.training.samples import build_samples
from tests.gateway.conftest import ScriptedModel, ThreadedGateway, broker_check, turn
from tests.harness import need_module

TOOLS: Any = [{"type": "function", "function": {"name": name, "description": f"{name} two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    for name in ("add", "mul")]
RUN = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}
SCRIPT = {
    "You are the planner.": [turn("", ("add", {"a": 2, "b": 3}), ("mul", {"a": 4, "b": 5})),
                             "Plan: 5 and 20. Delegating.", "Final: 25"],
    "You are worker A.": [turn("Thinking.", ("add", {"a": 1, "b": 1})), "A says 2"],
    "You are worker B.": [turn("", ("mul", {"a": 3, "b": 3}), ("add", {"a": 1, "b": 2})), "B says 9 and 3"],
    "You are worker C.": ["C says hi"],
}


class ByAgent(ScriptedModel):
    """Turn ``i`` of the conversation whose system prompt is a key of ``SCRIPT``."""

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        broker_check(sampling)
        self.calls += 1
        prompt = self.tokenizer.decode(prompt_ids)
        turns = next(t for system, t in SCRIPT.items() if system in prompt)
        done = prompt.count("<|im_start|>assistant") - 1
        ids = list(self.tokenizer.encode(turns[done] + "<|im_end|>", add_special_tokens=False))
        return Generation(ids, [-0.5 - 0.01 * i for i in range(len(ids))], "stop", "scripted", policy_version=2)


def _served(threaded_gateway: ThreadedGateway, tokenizer: Any, **kwargs: Any) -> tuple[Any, Any]:
    async def make() -> tuple[Any, Any]:
        from tests.gateway.conftest import open_job

        model = ByAgent(tokenizer, [])
        return open_job(threaded_gateway.gateway, tokenizer, model, **kwargs), model

    return threaded_gateway.call(make())


def _tool_results(message: Any) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c.id, "content": str(RUN[c.function.name](**json.loads(c.function.arguments)))}
            for c in message.tool_calls or []]


def test_a_planner_with_parallel_tool_calls_and_streaming_sub_agents_in_threads(
    threaded_gateway: ThreadedGateway, tokenizer: Any
) -> None:
    need_module("openai", "test")
    import openai

    job, _ = _served(threaded_gateway, tokenizer)
    client = openai.OpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)

    plan: list[Any] = [{"role": "system", "content": "You are the planner."}, {"role": "user", "content": "Compute."}]
    first = client.chat.completions.create(model="prorl", messages=plan, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=True)
    message: Any = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == [
        ("add", {"a": 2, "b": 3}), ("mul", {"a": 4, "b": 5})]
    plan += [message, *_tool_results(message)]  # the SDK's message object itself, as many agents send it back
    second = client.chat.completions.create(model="prorl", messages=plan, tools=TOOLS)
    plan.append(second.choices[0].message.model_dump())  # a full dump: refusal, audio, function_call all None
    assert second.model_extra is not None and second.model_extra["prorl"]["continued"]

    def worker(name: str) -> tuple[str, Any]:
        convo: list[Any] = [{"role": "system", "content": f"You are worker {name}."},
                            {"role": "user", "content": f"Your part, {name}."}]
        while True:
            with client.chat.completions.stream(model="prorl", messages=convo, tools=TOOLS,
                                                stream_options={"include_usage": True}) as stream:
                for _ in stream:
                    pass
                done = stream.get_final_completion()
            msg = done.choices[0].message
            convo.append({"role": "assistant", "content": msg.content, **({"tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in msg.tool_calls]} if msg.tool_calls else {})})
            if not msg.tool_calls:
                return msg.content or "", done.usage
            convo += _tool_results(msg)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        reports = list(pool.map(worker, "ABC"))
    assert [text for text, _ in reports] == ["A says 2", "B says 9 and 3", "C says hi"]
    plan.append({"role": "user", "content": "; ".join(text for text, _ in reports)})
    final = client.chat.completions.create(model="prorl", messages=plan, tools=TOOLS, tool_choice="none")
    assert final.choices[0].message.content == "Final: 25"
    client.close()

    traj = job.trajectory
    assert traj.violations == [] and traj.token_exact and job.buffer.continuity == 1.0
    assert job.buffer.conversations == 4 and len(traj.calls) == 8
    by_segment: dict[int, list[Any]] = {}
    for call in traj.calls:
        by_segment.setdefault(call.segment, []).append(call)
    assert sorted(len(calls) for calls in by_segment.values()) == [1, 2, 2, 3]
    for calls in by_segment.values():  # each call extends its own conversation's last prompt + output, verbatim
        for before, after in zip(calls, calls[1:], strict=False):
            held = before.prompt_ids + before.output_ids
            assert after.prompt_ids[: len(held)] == held
    # The usage a streamed turn reports is what was recorded for it.
    recorded = {(len(c.prompt_ids), len(c.output_ids)) for c in traj.calls}
    assert all((u.prompt_tokens, u.completion_tokens) in recorded for _, u in reports)
    assert (final.usage is not None and (final.usage.prompt_tokens, final.usage.completion_tokens) in recorded)

    samples, report = build_samples(traj.to_dict(), rollout_id="r", group_id="g", reward=1.0)
    assert report.samples == 4
    for sample in samples:
        calls = next(cs for cs in by_segment.values() if sample.input_ids[: len(cs[0].prompt_ids)] == cs[0].prompt_ids)
        want_mask = [0] * len(sample.input_ids)
        want_lps = [0.0] * len(sample.input_ids)
        for call in calls:
            at = len(call.prompt_ids)
            assert sample.input_ids[at: at + len(call.output_ids)] == call.output_ids
            want_mask[at: at + len(call.output_ids)] = [1] * len(call.output_ids)
            want_lps[at: at + len(call.output_ids)] = call.logprobs
        assert sample.response_mask == want_mask
        assert sample.old_log_probs == pytest.approx(want_lps)


def test_a_model_name_the_job_does_not_serve_says_what_to_send(
    threaded_gateway: ThreadedGateway, tokenizer: Any
) -> None:
    need_module("openai", "test")
    import openai

    job, model = _served(threaded_gateway, tokenizer, models=("prorl", "gpt-4o-mini"))
    client = openai.OpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)
    messages: Any = [{"role": "system", "content": "You are worker C."}, {"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    said = str(err.value)
    assert "model 'gpt-4o' does not exist here; this job serves ['prorl', 'gpt-4o-mini']" in said, said
    assert "model_aliases" in said and "PRORL_GATEWAY_MODEL" in said, said
    assert model.calls == 0 and job.trajectory.calls == []
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages)  # another name it serves
    assert reply.choices[0].message.content == "C says hi" and reply.model == "gpt-4o-mini"
    client.close()
