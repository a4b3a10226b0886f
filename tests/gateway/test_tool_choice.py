"""``tool_choice`` honoured: a turn that calls no tool (or not the named one) is sampled again, up to a bound.

The model answers the calls in the order they come (``AttemptsModel``), so the
same prompt gets a different turn on a retry; the official SDKs drive the real
gateway. Only the turn returned to the agent is recorded, token-exact, with the
discarded attempts counted on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from prorl_cli.agent import Trajectory
from prorl_cli.gateway.server import Gateway
from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import SamplingParams, derive_seed
from tests.gateway.conftest import CALC_TOOLS, broker_check, open_job, turn
from tests.harness import need_module

SEARCH_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
TOOLS: list[Any] = [*CALC_TOOLS, SEARCH_TOOL]
ANTHROPIC_TOOLS: list[Any] = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
MESSAGES: list[Any] = [{"role": "system", "content": "You are a calculator agent."}, {"role": "user", "content": "What is 2+3?"}]
TEXT = "I think it is 5."
CALC = turn("Let me compute.", ("calculator", {"expression": "2+3"}))
SEARCH = turn("", ("search", {"q": "2+3"}))


class AttemptsModel:
    """Answers call ``i`` with ``answers[i]`` whatever the prompt (a retry of one prompt gets the next answer)."""

    def __init__(self, tokenizer: Any, answers: list[str]) -> None:
        self.tokenizer = tokenizer
        self.answers = answers
        self.prompts: list[list[int]] = []
        self.seeds: list[int | None] = []

    def ids(self, i: int) -> list[int]:
        return list(self.tokenizer.encode(self.answers[i] + "<|im_end|>", add_special_tokens=False))

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        broker_check(sampling)
        i = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        self.seeds.append(sampling.seed)
        ids = self.ids(min(i, len(self.answers) - 1))
        return Generation(ids, [-0.5] * len(ids), "stop", "attempts", policy_version=3)


def _run(tokenizer: Any, answers: list[str], ask: Any, **job_kwargs: Any) -> tuple[Any, Trajectory, AttemptsModel]:
    """``ask(job)`` against a fresh gateway whose model gives ``answers``; (its result, trajectory, model)."""
    async def main() -> tuple[Any, Trajectory, AttemptsModel]:
        gw = Gateway()
        await gw.start()
        model = AttemptsModel(tokenizer, answers)
        job = open_job(gw, tokenizer, model, **job_kwargs)  # type: ignore[arg-type]  # any generate function
        try:
            return await ask(job), job.trajectory, model
        finally:
            await gw.close()

    return asyncio.run(main())


def _openai(**create: Any) -> Any:
    need_module("openai", "test")
    import openai

    async def ask(job: Any) -> Any:
        async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
            if create.get("stream"):
                chunks = [c async for c in await client.chat.completions.create(model="prorl", **create)]
                calls = [tc.function.name for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                return calls, finish, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            resp = await client.chat.completions.create(model="prorl", **create)
            msg = resp.choices[0].message
            return [c.function.name for c in msg.tool_calls or []], resp.choices[0].finish_reason, msg.content

    return ask


def _assert_recorded(traj: Trajectory, model: AttemptsModel, answer: int, retries: int, unmet: bool) -> None:
    """One recorded call: the turn ``answer`` on the prompt every attempt saw, token-exact."""
    assert len(model.prompts) == retries + 1 and all(p == model.prompts[0] for p in model.prompts)
    assert len(traj.calls) == 1
    call = traj.calls[0]
    assert call.prompt_ids == model.prompts[0]
    assert call.output_ids == model.ids(answer)
    assert call.tool_choice_retries == retries and call.tool_choice_unmet is unmet
    assert traj.sequence_ids == model.prompts[0] + model.ids(answer)
    assert traj.loss_mask == [0] * len(model.prompts[0]) + [1] * len(model.ids(answer))
    assert traj.token_exact
    assert Trajectory.from_dict(json.loads(json.dumps(traj.to_dict()))).calls[0] == call


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_required_is_met_by_the_retry_and_only_it_is_recorded(tokenizer: Any, stream: bool) -> None:
    got, traj, model = _run(tokenizer, [TEXT, CALC], _openai(
        messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=41, stream=stream))
    calls, finish, content = got
    assert calls == ["calculator"] and finish == "tool_calls" and content == "Let me compute."
    _assert_recorded(traj, model, answer=1, retries=1, unmet=False)
    # A fixed seed moves on, or the retry would sample the same turn again.
    assert model.seeds == [41, derive_seed(41, 1)] and model.seeds[1] != 41


def test_retried_seeds_stay_within_the_brokers_range(tokenizer: Any) -> None:
    top = 1 << 62  # the largest seed SAMPLING accepts (every call here passes the broker's check)
    got, traj, model = _run(tokenizer, [TEXT, TEXT, CALC], _openai(
        messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=top))
    assert got[0] == ["calculator"] and model.seeds == [top, derive_seed(top, 1), derive_seed(top, 2)]
    assert all(0 <= seed <= top for seed in model.seeds) and len(set(model.seeds)) == 3
    _assert_recorded(traj, model, answer=2, retries=2, unmet=False)


def test_a_turn_that_already_calls_a_tool_is_not_retried(tokenizer: Any) -> None:
    got, traj, model = _run(tokenizer, [CALC, TEXT], _openai(messages=MESSAGES, tools=TOOLS, tool_choice="required"))
    assert got[0] == ["calculator"]
    _assert_recorded(traj, model, answer=0, retries=0, unmet=False)
    assert model.seeds == [None]


def test_openai_required_never_met_answers_the_last_turn_marked_and_logged(
        tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    answers = [TEXT, "Still no tool.", "The answer is 5."]
    with caplog.at_level(logging.WARNING, logger="prorl_cli.gateway.buffer"):
        got, traj, model = _run(tokenizer, answers, _openai(messages=MESSAGES, tools=TOOLS, tool_choice="required"))
    assert got == ([], "stop", "The answer is 5.")
    _assert_recorded(traj, model, answer=2, retries=2, unmet=True)
    assert any("honoured tool_choice" in r.getMessage() for r in caplog.records)


def test_the_retry_bound_is_the_jobs_setting(tokenizer: Any) -> None:
    got, traj, model = _run(tokenizer, [TEXT, CALC], _openai(messages=MESSAGES, tools=TOOLS, tool_choice="required"),
                            tool_choice_retries=0)
    assert got[0] == []
    _assert_recorded(traj, model, answer=0, retries=0, unmet=True)


def test_openai_named_choice_discards_a_call_to_another_tool(tokenizer: Any) -> None:
    got, traj, model = _run(tokenizer, [SEARCH, CALC], _openai(
        messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "calculator"}}))
    assert got[0] == ["calculator"]
    _assert_recorded(traj, model, answer=1, retries=1, unmet=False)


def test_auto_and_none_never_retry(tokenizer: Any) -> None:
    for choice in ("auto", "none"):
        got, traj, model = _run(tokenizer, [TEXT, CALC], _openai(messages=MESSAGES, tools=TOOLS, tool_choice=choice))
        assert got[0] == [] and got[2] == TEXT
        _assert_recorded(traj, model, answer=0, retries=0, unmet=False)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_anthropic_any_and_named_tool(tokenizer: Any, stream: bool) -> None:
    need_module("anthropic", "test")
    import anthropic

    def ask_with(choice: dict[str, Any]) -> Any:
        async def ask(job: Any) -> Any:
            async with anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key,
                                                max_retries=0) as client:
                kwargs: dict[str, Any] = {"model": "prorl", "max_tokens": 256, "system": MESSAGES[0]["content"],
                                          "messages": MESSAGES[1:], "tools": ANTHROPIC_TOOLS, "tool_choice": choice}
                if stream:
                    async with client.messages.stream(**kwargs) as s:
                        resp = await s.get_final_message()
                else:
                    resp = await client.messages.create(**kwargs)
                return [b.name for b in resp.content if b.type == "tool_use"], resp.stop_reason

        return ask

    got, traj, model = _run(tokenizer, [TEXT, CALC], ask_with({"type": "any"}))
    assert got == (["calculator"], "tool_use")
    _assert_recorded(traj, model, answer=1, retries=1, unmet=False)
    got, traj, model = _run(tokenizer, [CALC, SEARCH, SEARCH], ask_with({"type": "tool", "name": "search"}))
    assert got == (["search"], "tool_use")
    _assert_recorded(traj, model, answer=1, retries=1, unmet=False)
    got, traj, model = _run(tokenizer, [TEXT], ask_with({"type": "tool", "name": "search"}))
    assert got == ([], "end_turn")
    _assert_recorded(traj, model, answer=0, retries=2, unmet=True)


def test_a_named_tool_not_among_tools_is_a_400_naming_the_field(tokenizer: Any) -> None:
    need_module("openai", "test")
    need_module("anthropic", "test")
    import anthropic
    import openai

    async def ask(job: Any) -> list[Any]:
        errors: list[Any] = []
        async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
            cases: list[tuple[Any, Any]] = [({"type": "function", "function": {"name": "weather"}}, TOOLS),
                                            ("required", None), ("sometimes", TOOLS)]
            for choice, tools in cases:
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="prorl", messages=MESSAGES, tool_choice=choice,
                                                         **({"tools": tools} if tools else {}))
                errors.append(e.value.body)
        async with anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key,
                                            max_retries=0) as client:
            with pytest.raises(anthropic.BadRequestError) as a:
                await client.messages.create(model="prorl", max_tokens=64, messages=MESSAGES[1:],
                                             tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "weather"})
            errors.append(a.value.body)
        return errors

    errors, traj, model = _run(tokenizer, [CALC], ask)
    named, no_tools, bad = errors[:3]
    assert named["param"] == "tool_choice" and "'weather'" in named["message"] and "calculator" in named["message"]
    assert no_tools["param"] == "tool_choice" and "needs tools" in no_tools["message"]
    assert bad["param"] == "tool_choice"
    assert "tool_choice.name" in errors[3]["error"]["message"] and "'weather'" in errors[3]["error"]["message"]
    assert model.prompts == [] and traj.calls == []  # refused before any model call
