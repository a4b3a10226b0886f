"""OpenAI ``logprobs.content[i].top_logprobs`` filled from the engine's alternatives, streamed or not.

The model returns alternatives as the scripted engine does (the sampled token,
then configured ones); the official SDK reads them back as token strings.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prorl_cli.gateway.server import Gateway
from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import SamplingParams
from prorl_cli.testing.scripted_engine import top_logprobs
from tests.gateway.conftest import broker_check, open_job
from tests.harness import need_module

MESSAGES: list[Any] = [{"role": "user", "content": "Say hello."}]
ANSWER = "Hello there"


class AlternativesModel:
    """Answers ``ANSWER``; with ``sampling.top_logprobs = k``, the scripted engine's alternatives (" world", " cat")."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.alternatives = [tokenizer.encode(t, add_special_tokens=False)[0] for t in (" world", " cat")]
        self.asked: list[int | None] = []

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        broker_check(sampling)
        self.asked.append(sampling.top_logprobs)
        ids = list(self.tokenizer.encode(ANSWER + "<|im_end|>", add_special_tokens=False))
        k = sampling.top_logprobs
        return Generation(ids, [-0.1] * len(ids), "stop", "alt",
                          top_logprobs=top_logprobs(ids, k, self.alternatives) if k else None)


def _ask(tokenizer: Any, **create: Any) -> tuple[Any, AlternativesModel]:
    need_module("openai", "test")
    import openai

    async def main() -> tuple[Any, AlternativesModel]:
        gw = Gateway()
        await gw.start()
        model = AlternativesModel(tokenizer)
        job = open_job(gw, tokenizer, model)  # type: ignore[arg-type]  # any generate function
        try:
            async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
                if create.get("stream"):
                    chunks = [c async for c in await client.chat.completions.create(
                        model="prorl", messages=MESSAGES, **create)]
                    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
                    return [t for lp in lps for t in lp.content or []], model
                resp = await client.chat.completions.create(model="prorl", messages=MESSAGES, **create)
                lp = resp.choices[0].logprobs
                return (lp.content if lp else None), model
        finally:
            await gw.close()

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_top_logprobs_are_the_engines_alternatives_as_token_strings(tokenizer: Any, stream: bool) -> None:
    content, model = _ask(tokenizer, logprobs=True, top_logprobs=3, stream=stream)
    assert model.asked == [3]
    ids = tokenizer.encode(ANSWER + "<|im_end|>", add_special_tokens=False)
    assert content is not None and len(content) == len(ids)
    for token_id, entry in zip(ids, content, strict=True):
        tops = entry.top_logprobs
        assert [t.logprob for t in tops] == pytest.approx([-0.1, -1.0, -2.0])
        assert tops[0].token == entry.token == tokenizer.decode([token_id])
        assert tops[0].bytes == list(entry.token.encode("utf-8"))
    first = content[0].top_logprobs
    names = [t.token for t in first[1:]]
    assert names == [tokenizer.decode([a]) for a in model.alternatives]
    assert names[0].startswith(" w") and names[1].startswith(" c")  # the tiny vocabulary's first pieces of each


def test_without_top_logprobs_none_are_asked_for(tokenizer: Any) -> None:
    content, model = _ask(tokenizer, logprobs=True)
    assert model.asked == [None] and content and all(e.top_logprobs == [] for e in content)
    need_module("openai", "test")
    import openai

    # Alternatives without log-probs: a 400, as OpenAI and vLLM answer, not a reply silently without them.
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true") as e:
        _ask(tokenizer, top_logprobs=3)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "top_logprobs"


def test_top_logprobs_out_of_range_is_a_400_naming_it(tokenizer: Any) -> None:
    need_module("openai", "test")
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _ask(tokenizer, logprobs=True, top_logprobs=21)
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_text_completion_returns_the_logprobs_it_asks_for(tokenizer: Any, stream: bool) -> None:
    """``/v1/completions`` with ``logprobs: k``: each output token, its log-prob and its k alternatives as the
    SDK's legacy ``Logprobs``; ``logprobs: 0``, the log-probs alone; absent, none (and none asked of the engine)."""
    need_module("openai", "test")
    import openai

    async def main() -> tuple[list[Any], AlternativesModel]:
        gw = Gateway()
        await gw.start()
        model = AlternativesModel(tokenizer)
        job = open_job(gw, tokenizer, model)  # type: ignore[arg-type]  # any generate function
        got = []
        try:
            async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
                for k in (2, 0, None):
                    extra = {} if k is None else {"logprobs": k}
                    if stream:
                        chunks = [c async for c in await client.completions.create(
                            model="prorl", prompt="Say hello.", stream=True, **extra)]
                        got.append(next((c.choices[0].logprobs for c in chunks if c.choices[0].logprobs), None))
                    else:
                        resp = await client.completions.create(model="prorl", prompt="Say hello.", **extra)
                        got.append(resp.choices[0].logprobs)
        finally:
            await gw.close()
        return got, model

    (two, zero, absent), model = asyncio.run(main())
    assert model.asked == [2, None, None]
    ids = tokenizer.encode(ANSWER + "<|im_end|>", add_special_tokens=False)
    tokens = [tokenizer.decode([t]) for t in ids]
    for lp in (two, zero):
        assert lp is not None and lp.tokens == tokens and lp.token_logprobs == pytest.approx([-0.1] * len(ids))
        assert lp.text_offset == [len("".join(tokens[:i])) for i in range(len(ids))]
    assert two.top_logprobs is not None and len(two.top_logprobs) == len(ids)
    for token, alts in zip(tokens, two.top_logprobs, strict=True):
        assert alts[token] == pytest.approx(-0.1) and len(alts) == 2  # k = 2: the sampled token and one more
    assert zero.top_logprobs == [None] * len(ids)
    assert absent is None
