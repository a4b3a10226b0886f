"""Canonical messages: the unchanged prefix of a resent conversation is reused, an edit anywhere is not."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from prorl_cli.gateway.messages import MessageMemo, RequestError, openai_messages


def _conversation(tool_name: str = "calculator", arguments: str = '{"expression": "1+1"}') -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "Compute 1+1."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": tool_name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "2"},
    ]


def test_a_resent_conversation_gives_what_a_fresh_parse_gives() -> None:
    memo = MessageMemo()
    first = _conversation()
    assert openai_messages(first, memo) == openai_messages(first)
    longer = copy.deepcopy(first) + [{"role": "assistant", "content": "The answer is 2."}]
    got = openai_messages(longer, memo)
    assert got == openai_messages(longer)
    assert got[2] is memo.out[2]  # reused, not parsed again
    assert got[3]["name"] == "calculator"  # the tool result still takes its call's name


def test_an_edited_earlier_message_is_parsed_again_with_what_follows() -> None:
    memo = MessageMemo()
    openai_messages(_conversation(), memo)
    edited = _conversation(tool_name="search", arguments='{"q": "x"}')
    got = openai_messages(edited, memo)
    assert got == openai_messages(edited)
    assert got[2]["tool_calls"][0]["function"] == {"name": "search", "arguments": {"q": "x"}}
    assert got[3]["name"] == "search"  # the unchanged tool message follows the edited call


def test_a_bad_message_after_a_reused_prefix_is_named_and_the_memo_keeps_the_last_good_request() -> None:
    memo = MessageMemo()
    good = _conversation()
    openai_messages(good, memo)
    bad = copy.deepcopy(good) + [{"role": "robot", "content": "?"}]
    with pytest.raises(RequestError, match=r"messages\[4\]\.role 'robot'"):
        openai_messages(bad, memo)
    assert memo.raw is good and len(memo.out) == len(good)


def test_text_parts_are_joined_as_vllm_joins_them() -> None:
    """A harness's separate blocks (a reminder, then the user's words) do not run into each other, and a prompt
    reads as ``vllm serve`` renders it for a template that takes a string: parts joined by a newline."""
    from prorl_cli.gateway.messages import anthropic_messages

    parts = [{"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
             {"type": "text", "text": "Fix the bug."}]
    expected = "<system-reminder>be brief</system-reminder>\nFix the bug."
    assert openai_messages([{"role": "user", "content": parts}]) == [{"role": "user", "content": expected}]
    [user] = anthropic_messages(None, [{"role": "user", "content": parts}])
    assert user == {"role": "user", "content": expected}
    [_, tool] = anthropic_messages(None, [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": parts}]},
    ], prefill_ok=True)
    assert tool["content"] == expected
