"""Plain completions (``/v1/completions``) in the token buffer: the job's first one opens a conversation.

The buffer is driven directly with a character-level chat (one id per
character), so what it records is checked without a tokenizer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prorl_cli.agent.tools import get_tool_parser
from prorl_cli.gateway.buffer import TokenBuffer
from prorl_cli.gateway.messages import ChatRequest
from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import SamplingParams


class CharChat:
    """One token id per character: enough of :class:`~prorl_cli.agent.chat.ChatTokens` for text prompts."""

    stop_token_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))

    def turn_text(self, ids: list[int]) -> str:
        return self.decode(ids)


async def _answer(prompt_ids: list[int], sampling: SamplingParams) -> Generation:
    out = [ord(c) for c in " ok"]
    return Generation(out, [-0.5] * len(out), "stop", "scripted")


def _buffer() -> TokenBuffer:
    def chat_for(tools: Any) -> Any:
        return CharChat()

    return TokenBuffer(chat_for, _answer, get_tool_parser("hermes"), sampling=SamplingParams(max_tokens=8))


def _request() -> ChatRequest:
    return ChatRequest(messages=[], tools=None, model="prorl")


def test_the_first_text_completion_is_no_violation_and_an_unrelated_second_one_is() -> None:
    async def main() -> TokenBuffer:
        buffer = _buffer()
        first = await buffer.complete_text("hello", _request())
        assert (first.segment, first.continued) == (0, False)
        again = await buffer.complete_text("hello ok and more", _request())  # extends the first call
        assert (again.segment, again.continued) == (0, True)
        other = await buffer.complete_text("something else", _request())
        assert (other.segment, other.continued) == (1, False)
        return buffer

    buffer = asyncio.run(main())
    calls = buffer.trajectory.calls
    assert [c.prefix_ok for c in calls] == [True, True, False]
    # Only the unrelated prompt is an edit; the job's first call opened the first conversation.
    (violation,) = buffer.trajectory.violations
    assert violation["call"] == 2 and violation["reason"] == "a text prompt that does not extend the last call"
    assert len(buffer.segments) == 2


def test_a_completion_ending_on_the_end_of_sequence_token_has_no_such_text(tokenizer: Any) -> None:
    """vLLM returns the end-of-sequence id as the last output id of a finished turn; its text ("<|im_end|>")
    is not part of the completion, streamed or not (as chat answers), while the recorded ids keep it."""
    from tests.gateway.conftest import open_job
    from tests.harness import need_module

    need_module("openai", "test")
    import openai

    from prorl_cli.agent.chat import ChatTokens
    from prorl_cli.gateway.server import Gateway

    eos = ChatTokens(tokenizer).stop_token_ids[0]

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        ids = [*tokenizer.encode(" lived a cat.", add_special_tokens=False), eos]
        return Generation(ids, [-0.1] * len(ids), "stop", "scripted")

    async def main() -> tuple[str, str, list[int]]:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, generate)
        try:
            async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as c:
                whole = await c.completions.create(model="prorl", prompt="Once upon a time there", max_tokens=20)
                stream = await c.completions.create(model="prorl", prompt="Once upon a time here", max_tokens=20,
                                                    stream=True)
                streamed = "".join([ch.choices[0].text async for ch in stream if ch.choices])
            return whole.choices[0].text, streamed, job.trajectory.calls[0].output_ids
        finally:
            await gw.close()

    whole, streamed, recorded = asyncio.run(main())
    assert whole == streamed == " lived a cat."
    assert recorded[-1] == eos  # the trajectory is what the model sampled
