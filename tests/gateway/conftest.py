"""Fixtures of the gateway tests: the tiny tokenizer and a scripted model behind the generate contract.

The model is scripted (fixed turns, encoded with the real tokenizer, served
through ``generate(prompt_ids, sampling) -> Generation``); everything from
the HTTP request to the recorded token buffer is the real gateway, driven by
the official ``openai`` and ``anthropic`` SDKs. Each call's sampling is packed
and checked as the broker checks a ``generate`` header, so a value the gateway
lets through but a real deployment would refuse fails here too.

``threaded_gateway`` runs a gateway on an event loop of its own thread, for the
SDKs' synchronous clients (the code of their READMEs).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from prorl_cli import protocol as P
from prorl_cli.agent.chat import ChatTokens
from prorl_cli.agent.tools import get_tool_parser
from prorl_cli.exceptions import InferenceError, ProtocolError
from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import SamplingParams
from tests.harness import need_module

CALC_TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]

T = TypeVar("T")


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
        broker_check(sampling)
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


def broker_check(sampling: SamplingParams) -> None:
    """What a job's generate call meets on its way to a model: its header packed by msgpack (an integer past
    64 bits raises ``OverflowError`` there) and checked by the broker's schema (a refusal comes back to the
    node as an error reply, raised as :class:`InferenceError`)."""
    header = {"op": P.Op.GENERATE.value, "rid": 1, "job_id": "job-1", "sampling": sampling.to_wire()}
    try:
        P.parse(P.decode_header(P.encode(header)[0]), 1)
    except ProtocolError as e:
        raise InferenceError(f"the broker refused the call: {e}") from e


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


class ThreadedGateway:
    """A started :class:`Gateway` serving from an event loop on its own thread (synchronous clients block the caller's)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway-loop", daemon=True)
        self.thread.start()
        # Imported here: it needs aiohttp, an extra (the tokenizer fixture skips the test without it).
        from prorl_cli.gateway.server import Gateway

        self.gateway = Gateway()
        self.call(self.gateway.start())

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the gateway's loop and return its result (its exception, raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def open(self, tokenizer: Any, turns: list[str], **kwargs: Any) -> tuple[Any, ScriptedModel]:
        """A job endpoint answering ``turns``, and its model; both made on the loop (their events belong to it)."""
        async def make() -> tuple[Any, ScriptedModel]:
            model = ScriptedModel(tokenizer, turns)
            return open_job(self.gateway, tokenizer, model, **kwargs), model

        return self.call(make())

    def close(self) -> None:
        try:
            self.call(self.gateway.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


@pytest.fixture
def threaded_gateway(tokenizer: Any) -> Iterator[ThreadedGateway]:
    served = ThreadedGateway()
    try:
        yield served
    finally:
        served.close()


def openai_agents() -> Any:
    """The OpenAI Agents SDK (``agents``) with its tracing off: it would export traces to OpenAI's servers."""
    need_module("agents", "test")
    import agents

    agents.set_tracing_disabled(True)
    return agents


def sdk_model(api: str, base_url: str, api_key: str) -> Any:
    """The Agents SDK's model for ``api`` (``responses``, its default, or ``chat``) on a gateway endpoint."""
    import openai

    agents = openai_agents()
    kind = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    return kind(model="prorl", openai_client=openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))
