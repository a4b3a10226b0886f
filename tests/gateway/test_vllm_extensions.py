"""vLLM's request extensions, as clients set up for a vLLM server send them (``extra_body``): the ones the generate
contract carries are applied (``stop_token_ids``, and ``include_stop_str_in_output`` on the text), the ones that
would change what is sampled, the prompt or what comes back are a 400 naming them (docs/harness.md): none is
ignored while the agent is answered as if it had been honoured."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prorl_cli.agent import Trajectory
from prorl_cli.gateway.server import Gateway
from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import SamplingParams
from tests.gateway.conftest import ScriptedModel, broker_check, open_job
from tests.harness import need_module

MESSAGES: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]

#: (route, the field and value a vLLM client sends): refused, naming the field; nothing is sampled.
REFUSED: list[tuple[str, dict[str, Any]]] = [
    *[("chat", extra) for extra in (
        {"ignore_eos": True}, {"min_tokens": 8}, {"bad_words": ["five"]}, {"allowed_token_ids": [1, 2, 3]},
        {"use_beam_search": True}, {"length_penalty": 0.5}, {"truncate_prompt_tokens": 16}, {"prompt_logprobs": 1},
        {"return_tokens_as_token_ids": True}, {"continue_final_message": True}, {"add_generation_prompt": False},
        {"echo": True}, {"stop_token_ids": [-1]}, {"stop_token_ids": "7"}, {"include_stop_str_in_output": "yes"})],
    *[("completions", extra) for extra in (
        {"ignore_eos": True}, {"min_tokens": 8}, {"use_beam_search": True}, {"prompt_logprobs": 0},
        {"truncate_prompt_tokens": 16}, {"return_tokens_as_token_ids": True}, {"stop_token_ids": [1.5]})],
]
#: Their defaults, which a vLLM client may send on every request: answered.
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"ignore_eos": False, "min_tokens": 0, "bad_words": [], "use_beam_search": False, "length_penalty": 1.0,
              "return_tokens_as_token_ids": False, "continue_final_message": False, "add_generation_prompt": True,
              "echo": False, "skip_special_tokens": True, "include_stop_str_in_output": False, "stop_token_ids": []}),
    ("completions", {"ignore_eos": False, "min_tokens": 0, "use_beam_search": False, "length_penalty": 1,
                     "stop_token_ids": []}),
]


class StopsAtIds(ScriptedModel):
    """A scripted turn cut after the first of the call's ``stop_token_ids`` in it, as an engine stops there; the
    sampling of each call is kept."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        super().__init__(tokenizer, turns)
        self.samplings: list[SamplingParams] = []

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        broker_check(sampling)
        self.samplings.append(sampling)
        gen = await super().__call__(prompt_ids, sampling)
        ids = list(gen.output_ids)
        for i, tid in enumerate(ids):
            if tid in sampling.stop_token_ids:
                ids = ids[: i + 1]
                break
        return Generation(ids, list(gen.logprobs[: len(ids)]), "stop", gen.backend_id, policy_version=0)


def _run(tokenizer: Any, turns: list[str], ask: Any) -> tuple[Any, Trajectory, StopsAtIds]:
    async def main() -> tuple[Any, Trajectory, StopsAtIds]:
        gw = Gateway()
        await gw.start()
        model = StopsAtIds(tokenizer, turns)
        job = open_job(gw, tokenizer, model)
        try:
            return await ask(job), job.trajectory, model
        finally:
            await gw.close()

    return asyncio.run(main())


async def _ask(job: Any, route: str, extra: dict[str, Any], messages: Any = MESSAGES) -> Any:
    import openai

    async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
        if route == "completions":
            return await client.completions.create(model="prorl", prompt="2+3=", max_tokens=16, extra_body=extra)
        return await client.chat.completions.create(model="prorl", messages=messages, extra_body=extra)


def test_vllm_extensions_that_change_the_result_are_a_400_naming_them(tokenizer: Any) -> None:
    need_module("openai", "test")
    import openai

    async def ask(job: Any) -> None:
        for route, extra in REFUSED:
            (field,) = extra
            with pytest.raises(openai.BadRequestError) as e:
                await _ask(job, route, extra)
            body = e.value.body
            assert isinstance(body, dict) and body["param"] == field and field in body["message"], (route, extra, body)
        for route, extra in ACCEPTED:
            await _ask(job, route, extra)

    _, traj, model = _run(tokenizer, ["5"] * 10, ask)
    assert len(model.samplings) == len(ACCEPTED) == len(traj.calls)  # the refused ones sampled nothing


def test_stop_token_ids_end_the_turn_and_the_conversation_goes_on_token_exactly(tokenizer: Any) -> None:
    need_module("openai", "test")
    stop_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(stop_id, int) and stop_id >= 0

    async def ask(job: Any) -> list[Any]:
        first = await _ask(job, "chat", {"stop_token_ids": [stop_id]})
        messages = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And 3+4?"}]
        second = await _ask(job, "chat", {"stop_token_ids": [stop_id]}, messages)
        return [first, second]

    replies, traj, model = _run(tokenizer, ["It is 5.<|endoftext|> never sampled", "7"], ask)
    # The request's id is added to the template's end of turn, which still ends a turn.
    assert stop_id in model.samplings[0].stop_token_ids
    assert set(model.samplings[0].stop_token_ids) > {stop_id}
    first, second = replies
    assert first.choices[0].message.content == "It is 5." and first.choices[0].finish_reason == "stop"
    assert traj.calls[0].output_ids[-1] == stop_id  # sampled, so recorded: it is not text
    assert second.choices[0].message.content == "7"
    assert traj.token_exact and traj.calls[1].segment == 0
    held = traj.calls[0].prompt_ids + traj.calls[0].output_ids
    assert traj.calls[1].prompt_ids[: len(held)] == held


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer: Any, route: str) -> None:
    need_module("openai", "test")

    async def ask(job: Any) -> list[str]:
        texts = []
        for include in (True, False):
            extra = {"stop": ["</answer>"], "include_stop_str_in_output": include}
            reply = await _ask(job, route, extra, [*MESSAGES[:1], {"role": "user", "content": f"q {include}"}])
            texts.append(reply.choices[0].message.content if route == "chat" else reply.choices[0].text)
        return texts

    (kept, cut), traj, _ = _run(tokenizer, ["<answer>5</answer> and more"] * 2, ask)
    assert kept == "<answer>5</answer>" and cut == "<answer>5"
    assert traj.calls[0].output_ids == traj.calls[1].output_ids  # the same tokens recorded either way
    # The trajectory says which string ended each call (the first call's "stop" too, not only the reply's).
    assert [c.stop_string for c in traj.calls] == ["</answer>"] * 2
    assert [c.finish_reason for c in traj.calls] == ["stop"] * 2
