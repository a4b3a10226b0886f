"""Token-exact turn boundaries under chat templates other than the tiny model's plain ChatML."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent import run_tool_agent
from prorl_cli.agent.chat import ChatTemplateError, ChatTokens
from prorl_cli.exceptions import ConfigError
from prorl_cli.inference import Generation
from prorl_cli.inference.tiny_model import CHAT_TEMPLATE
from prorl_cli.protocol import SamplingParams

_HEADER = "{{- '<|im_start|>assistant\\n' }}"
# As Qwen3's template does: only the last assistant turn gets an (empty) <think> block.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    _HEADER, _HEADER + "{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}", 1
)


def calculator(expression: str) -> str:
    """The tool the scripted turns call."""
    return {"17*23": "391", "2+3": "5"}[expression]


def _tokenizer(tiny_model: Path, template: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    tok.chat_template = template
    return tok


class Scripted:
    """Returns the ids of scripted turns, one per call, and keeps the prompts."""

    def __init__(self, chat: ChatTokens, texts: list[str]) -> None:
        self.outputs = [chat.encode(t) for t in texts]
        self.prompts: list[list[int]] = []

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.outputs[len(self.prompts) - 1]
        return Generation(ids, [-0.5] * len(ids), "stop", "scripted")


def test_thinking_template_that_marks_only_the_last_turn_extends_token_exactly(tiny_model: Path) -> None:
    chat = ChatTokens(_tokenizer(tiny_model, THINKING_TEMPLATE))
    tool_turn = ('<think>\nmultiply\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
                 '{"expression": "17*23"}}\n</tool_call><|im_end|>')
    model = Scripted(chat, [tool_turn, "<think>\ndone\n</think>\n\n391<|im_end|>"])
    traj = asyncio.run(run_tool_agent(model, chat, [{"role": "user", "content": "17*23?"}],
                                      {"calculator": calculator}, sampling=SamplingParams(), record_into=None))
    assert traj.stop_reason == "stop" and traj.error is None and traj.token_exact and len(traj.calls) == 2
    first, second = traj.calls
    base = first.prompt_ids + first.output_ids
    assert second.prompt_ids[: len(base)] == base
    assert second.prompt_ids[len(base):] == chat.encode(
        "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_turn_end_token_stops_when_eos_is_another_token(tiny_model: Path) -> None:
    """A base model's tokenizer names <|endoftext|> as EOS, its template ends turns with <|im_end|>."""
    tok = _tokenizer(tiny_model, CHAT_TEMPLATE)
    tok.eos_token = "<|endoftext|>"
    chat = ChatTokens(tok)
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert chat.stop_token_ids == sorted([eos, im_end])
    # A turn that ended on <|im_end|> is closed by the rest of the suffix only.
    assert chat.closing_text(chat.encode("hi<|im_end|>")) == "\n"
    # An ordinary added token that happens to start the suffix is text, not a stop.
    plain = _tokenizer(tiny_model, CHAT_TEMPLATE.replace("'<|im_end|>\\n' }}{%- elif message['role'] == 'tool'",
                                                          "'</tool_call>\\n' }}{%- elif message['role'] == 'tool'"))
    assert ChatTokens(plain).stop_token_ids == [plain.eos_token_id]


def test_tool_call_markers_that_are_special_tokens_are_parsed(tiny_model: Path) -> None:
    """Some tokenizers mark <tool_call> special: the loop must still see the call."""
    from tokenizers import AddedToken

    tok = _tokenizer(tiny_model, CHAT_TEMPLATE)
    tok.add_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)],
                   special_tokens=True)
    chat = ChatTokens(tok)
    tool_turn = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call><|im_end|>'
    assert "<tool_call>" not in chat.decode(chat.encode(tool_turn), skip_special_tokens=True)
    model = Scripted(chat, [tool_turn, "391<|im_end|>"])
    traj = asyncio.run(run_tool_agent(model, chat, [{"role": "user", "content": "17*23?"}],
                                      {"calculator": calculator}, sampling=SamplingParams(), record_into=None))
    assert traj.stop_reason == "stop" and len(traj.calls) == 2 and traj.token_exact
    assert traj.messages[2] == {"role": "tool", "name": "calculator", "content": "391"}
    # The text drops only the end-of-turn token.
    assert traj.calls[0].text == tool_turn.removesuffix("<|im_end|>") and traj.calls[1].text == "391"


def test_a_path_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot load a tokenizer from '.*missing': no such directory"):
        ChatTokens.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="the directory holds no tokenizer files"):
        ChatTokens.from_pretrained(tmp_path / "empty")


# As Mistral's templates do: the tools block goes before the last user message, so a new user turn moves it.
TOOLS_BEFORE_LAST_USER = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}"
    "{%- if tools and loop.index0 == ns.last %}{{- '[TOOLS]' + (tools | tojson) + '[/TOOLS]' }}{%- endif %}"
    "{{- '<|im_start|>user\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_moves_earlier_text_is_still_refused(tiny_model: Path) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    chat = ChatTokens(_tokenizer(tiny_model, TOOLS_BEFORE_LAST_USER), tools=tools)
    assert chat.observation_text([{"role": "tool", "content": "r"}]) == \
        "<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ChatTemplateError, match="re-renders earlier turns"):
        chat.observation_text([{"role": "user", "content": "next"}])


# As Llama 3.x's template does: tool calls are bare JSON, no <tool_call> anywhere.
JSON_CALLS_TEMPLATE = CHAT_TEMPLATE.replace("<tool_call>", "").replace("</tool_call>", "")


def test_hermes_parser_on_a_template_without_tool_call_tags_is_named(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    chat = ChatTokens(_tokenizer(tiny_model, JSON_CALLS_TEMPLATE))
    turn = '{"name": "calculator", "parameters": {"expression": "2+3"}}<|im_end|>'
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="prorl_cli.agent.loop"):
            traj = asyncio.run(run_tool_agent(Scripted(chat, [turn]), chat, [{"role": "user", "content": "q"}],
                                              {"calculator": calculator}, sampling=SamplingParams(),
                                              record_into=None))
        assert traj.stop_reason == "stop" and len(traj.calls) == 1
    # Once per tokenizer, naming the way out.
    assert caplog.text.count("never writes <tool_call>") == 1 and "register_tool_parser" in caplog.text
    caplog.clear()
    hermes = ChatTokens(_tokenizer(tiny_model, CHAT_TEMPLATE))
    with caplog.at_level(logging.WARNING, logger="prorl_cli.agent.loop"):
        asyncio.run(run_tool_agent(Scripted(hermes, ["hi<|im_end|>"]), hermes, [{"role": "user", "content": "q"}],
                                   {"calculator": calculator}, sampling=SamplingParams(), record_into=None))
    assert "never writes" not in caplog.text


class DatedTokenizer:
    """A real tokenizer whose template output starts with the day it is rendered on (as Llama 3.2's does)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.day = 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def apply_chat_template(self, messages: Any, **kw: Any) -> str:
        return f"<|im_start|>system\nToday: day {self.day}<|im_end|>\n" + self._tok.apply_chat_template(messages, **kw)


def test_a_dated_template_still_extends_after_the_day_changes(tiny_model: Path) -> None:
    dated = DatedTokenizer(_tokenizer(tiny_model, CHAT_TEMPLATE))
    chat = ChatTokens(dated)
    dated.day = 2  # the node's cached tokenizer, the next morning
    assert chat.observation_text([{"role": "tool", "content": "r"}]) == \
        "<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
