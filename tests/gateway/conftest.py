"""Fixtures of the gateway tests: the tiny tokenizer and a scripted model behind the generate contract.

The model is scripted (fixed turns, encoded with the real tokenizer, served
through ``generate(prompt_ids, sampling) -> Generation``); everything from
the HTTP request to the recorded token buffer is the real gateway, driven by
the official ``openai`` and ``anthropic`` SDKs.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent.chat import ChatTokens
from prorl_cli.agent.tools import get_tool_parser
from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import SamplingParams
from tests.harness import need_module

CALC_TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def turn(text: str = "", *calls: tuple[str, dict[str, Any]]) -> str:
    """An assistant turn: ``text`` then Hermes tool calls."""
    parts = [text] if text else []
    parts += [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls]
    return "\n".join(parts)


class ScriptedModel:
    """Turn ``i`` of a conversation (i = assistant turns already in the prompt) from a fixed list.

    ``gate``: when set, each call waits for it (tests of cancellation); ``cancelled`` counts calls cancelled.
    """

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        self.calls = 0
        self.cancelled = 0
        self.entered = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        prompt = self.tokenizer.decode(prompt_ids)
        done = prompt.count("<|im_start|>assistant") - 1
        text = self.turns[done] if done < len(self.turns) else "no more turns"
        ids = list(self.tokenizer.encode(text + "<|im_end|>", add_special_tokens=False))
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        return Generation(ids, [-0.25 - 0.001 * i for i in range(len(ids))], finish, "scripted", policy_version=7)


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    need_module("aiohttp", "http")
    return ChatTokens.from_pretrained(tiny_model).tokenizer


def open_job(gateway: Any, tokenizer: Any, model: ScriptedModel, **kwargs: Any) -> Any:
    """A job endpoint on ``gateway`` answering from ``model``."""
    def chat_for(tools: list[dict[str, Any]] | None) -> ChatTokens:
        return ChatTokens(tokenizer, tools=tools)

    return gateway.open_job("job-1", generate=model, chat_for=chat_for, parser=get_tool_parser("hermes"),
                            sampling=SamplingParams(max_tokens=256), **kwargs)
