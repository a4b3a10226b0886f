"""Plain completions (``/v1/completions``) in the token buffer: conversations, continuations and edits as for chat.

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
    """One token id per character: enough of :class:`~prorl_cli.agent.chat.ChatTokens` for text prompts, and a
    bracketed template (``[role]content`` per message, then ``[assistant]``) for chat ones."""

    stop_token_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def initial_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode("".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]")

    def continuation(self, output_ids: list[int], new: list[dict[str, Any]]) -> list[int]:
        return self.initial_prompt(new)

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


def _request(messages: list[dict[str, Any]] | None = None, agent: str | None = None) -> ChatRequest:
    return ChatRequest(messages=messages or [], tools=None, model="prorl", agent=agent)


def test_an_unrelated_text_completion_opens_a_conversation_and_an_edited_one_is_a_violation() -> None:
    """As for chat: a prompt that extends no conversation is a new one, unless it opens as a conversation did (its
    first prompt) and then differs: that is an edit of its history (truncated, rewritten or asked again)."""
    async def main() -> TokenBuffer:
        buffer = _buffer()
        first = await buffer.complete_text("hello", _request())
        assert (first.segment, first.continued) == (0, False)
        again = await buffer.complete_text("hello ok and more", _request())  # extends the first call
        assert (again.segment, again.continued) == (0, True)
        other = await buffer.complete_text("something else", _request())  # another conversation
        assert (other.segment, other.continued) == (1, False)
        back = await buffer.complete_text("hello ok and more ok, then", _request())  # the first one goes on
        assert (back.segment, back.continued) == (0, True)
        edited = await buffer.complete_text("hello there", _request())  # opens as the first, then differs
        assert (edited.segment, edited.continued) == (2, False)
        return buffer

    buffer = asyncio.run(main())
    calls = buffer.trajectory.calls
    assert [c.prefix_ok for c in calls] == [True, True, True, True, False]
    assert [c.segment for c in calls] == [0, 0, 1, 0, 2]
    (violation,) = buffer.trajectory.violations
    assert violation["call"] == 4 and violation["segment"] == 2, violation
    assert violation["reason"] == ("a text prompt that opens as conversation 0 does (its first prompt) and does "
                                   "not extend its last call"), violation
    assert buffer.continuity == 3 / 4 and buffer.conversations == 3


def test_a_text_completion_after_a_chat_turn_is_a_new_conversation_not_an_edit() -> None:
    """An agent that chats, then makes a plain completion of its own (a summariser, a sub-agent on the legacy API):
    two conversations, each token-exact, continuity 1.0, no violation."""
    async def main() -> TokenBuffer:
        buffer = _buffer()
        chat = await buffer.complete(_request([{"role": "user", "content": "hi"}]))
        assert (chat.segment, chat.continued) == (0, False)
        text = await buffer.complete_text("Once upon a time", _request())
        assert (text.segment, text.continued) == (1, False)
        more = await buffer.complete_text("Once upon a time ok there", _request())
        assert (more.segment, more.continued) == (1, True)
        turn = await buffer.complete(_request([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " ok"},
                                               {"role": "user", "content": "more"}]))
        assert (turn.segment, turn.continued) == (0, True)  # the chat goes on in its own buffer
        return buffer

    buffer = asyncio.run(main())
    assert buffer.trajectory.violations == [], buffer.trajectory.violations
    assert [c.prefix_ok for c in buffer.trajectory.calls] == [True] * 4
    assert buffer.continuity == 1.0 and buffer.conversations == 2


def test_a_text_prompt_that_extends_a_chat_turn_exactly_goes_on_in_its_conversation() -> None:
    """A harness that renders the template itself and continues a chat turn through /v1/completions: the prompt
    holds that turn's ids verbatim, so it extends that conversation token-exactly."""
    async def main() -> TokenBuffer:
        buffer = _buffer()
        await buffer.complete(_request([{"role": "user", "content": "hi"}]))
        text = await buffer.complete_text("[user]hi[assistant] ok[user]go on[assistant]", _request())
        assert (text.segment, text.continued) == (0, True)
        return buffer

    buffer = asyncio.run(main())
    assert buffer.trajectory.violations == [] and buffer.conversations == 1


def test_text_conversations_are_per_agent() -> None:
    """Another agent's text prompt never extends (or edits) this agent's conversation, as with chat."""
    async def main() -> TokenBuffer:
        buffer = _buffer()
        await buffer.complete_text("hello", _request(agent="lead"))
        other = await buffer.complete_text("hello ok", _request(agent="helper"))
        assert (other.segment, other.continued) == (1, False)
        same = await buffer.complete_text("hello ok", _request(agent="helper"))  # asks its first prompt again
        assert (same.segment, same.continued) == (2, False)
        return buffer

    buffer = asyncio.run(main())
    assert [c.agent for c in buffer.trajectory.calls] == ["lead", "helper", "helper"]
    (violation,) = buffer.trajectory.violations
    assert violation["call"] == 2 and "conversation 1" in violation["reason"], violation


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
