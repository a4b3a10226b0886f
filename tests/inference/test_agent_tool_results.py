"""The agent loop's tool results: results JSON cannot encode, tool-call ids, and its own misuse errors."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent import TokenSession, get_tool_parser, run_tool_agent
from prorl_cli.agent.chat import ChatTokens
from prorl_cli.exceptions import AgentLoopError, ProrlError, UnknownToolParser
from prorl_cli.inference.tiny_model import CHAT_TEMPLATE
from prorl_cli.protocol import SamplingParams
from tests.inference.test_agent_templates import Scripted

_RAISE = "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
# As Mistral's templates do: a tool result, and each call of an assistant turn, must carry a 9-character id.
CALL_ID_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- elif message['role'] == 'tool' %}",
    "{%- elif message['role'] == 'tool' %}"
    "{%- if message.get('tool_call_id') is none or message['tool_call_id'] | length != 9 %}" + _RAISE + "{%- endif %}",
    1,
).replace(
    "{%- for tc in message.get('tool_calls') or [] %}",
    "{%- for tc in message.get('tool_calls') or [] %}"
    "{%- if tc.get('id') is none or tc['id'] | length != 9 %}" + _RAISE + "{%- endif %}",
    1,
)


def _call(expression: str) -> str:
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'


def _agent(chat: ChatTokens, texts: list[str], tools: dict[str, Any]) -> Any:
    return asyncio.run(run_tool_agent(Scripted(chat, texts), chat, [{"role": "user", "content": "q"}], tools,
                                      sampling=SamplingParams(), record_into=None))


def test_a_result_json_cannot_encode_is_the_models_observation(chat: ChatTokens) -> None:
    def lookup(key: str) -> Any:
        return {"key": key, "seen": {1, 2}}  # a set: json.dumps refuses it

    turn = '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call><|im_end|>'
    traj = _agent(chat, [turn, "done<|im_end|>"], {"lookup": lookup})
    assert traj.stop_reason == "stop" and traj.error is None and len(traj.calls) == 2 and traj.token_exact
    assert re.match(r"error: tool 'lookup' returned a dict that is not JSON-serializable: .*set",
                    traj.messages[2]["content"])


def test_add_messages_out_of_order_is_a_prorl_error_naming_it(chat: ChatTokens) -> None:
    session = TokenSession(chat, Scripted(chat, ["hi<|im_end|>"]), [{"role": "user", "content": "hi"}])
    with pytest.raises(AgentLoopError, match=r"before the first generate\(\)") as first:
        session.add_messages([{"role": "user", "content": "x"}])
    assert isinstance(first.value, RuntimeError) and isinstance(first.value, ProrlError)
    asyncio.run(session.generate(SamplingParams()))
    session.add_messages([{"role": "user", "content": "x"}])
    with pytest.raises(AgentLoopError, match=r"twice after the same generate\(\)"):
        session.add_messages([{"role": "user", "content": "y"}])


def test_an_unknown_tool_parser_is_a_prorl_error_naming_the_registered_ones() -> None:
    with pytest.raises(UnknownToolParser) as e:
        get_tool_parser("mistral")
    assert isinstance(e.value, KeyError) and isinstance(e.value, ProrlError)
    # Plain text (a KeyError would quote it): the name asked for and the names there are.
    assert str(e.value).startswith("unknown tool parser 'mistral'; registered: [") and "'hermes'" in str(e.value)


def _tokenizer(tiny_model: Path, template: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    tok.chat_template = template
    return tok


def test_a_template_that_needs_tool_call_ids_gets_them(tiny_model: Path) -> None:
    chat = ChatTokens(_tokenizer(tiny_model, CALL_ID_TEMPLATE))
    two_calls = _call("17*23") + _call("2+3") + "<|im_end|>"
    texts = [two_calls, _call("2+3") + "<|im_end|>", "391<|im_end|>"]
    calculator = {"17*23": "391", "2+3": "5"}.__getitem__
    traj = _agent(chat, texts, {"calculator": lambda expression: calculator(expression)})
    assert traj.stop_reason == "stop" and traj.error is None and len(traj.calls) == 3 and traj.token_exact
    roles = [m["role"] for m in traj.messages]
    assert roles == ["user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]
    # Each result names its call; the assistant's calls carry the same ids, in order.
    for at, results in ((1, traj.messages[2:4]), (4, traj.messages[5:6])):
        calls = traj.messages[at]["tool_calls"]
        assert [c["id"] for c in calls] == [r["tool_call_id"] for r in results]
        assert [c["function"]["name"] for c in calls] == ["calculator"] * len(results)
    ids = [m["tool_call_id"] for m in traj.messages if m["role"] == "tool"]
    assert len(set(ids)) == 3 and all(re.fullmatch(r"[0-9a-zA-Z]{9}", i) for i in ids)
    # Rendered again (a trainer, a viewer), the trajectory's messages pass the template's check; a second
    # rollout of the same turns gets the same ids, so the appended observation is what a re-render gives.
    chat.tokenizer.apply_chat_template(traj.messages, tokenize=False)
    again = _agent(chat, texts, {"calculator": lambda expression: calculator(expression)})
    assert again.messages == traj.messages and again.sequence_ids == traj.sequence_ids
