"""Which sampling fields a job's model calls carry: those its submitter gave and those its handler set, no more.

A field left out reaches the broker's KV admission and the engine as unset, so the admission estimate of a call
whose job set no ``max_tokens`` is its prompt (``call_tokens``), not the prompt plus a default the submitter
never chose. The calls here are made in-process through the node's ``Services`` seam, on the scripted engine
(real tokenizer, fixed turns); the same through a real node, broker and bridge is in
``tests/domains/test_search_r1_rows.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from prorl_cli import protocol as P
from prorl_cli.agent import Tool, run_tool_agent
from prorl_cli.agent.chat import ChatTokens
from prorl_cli.broker.admission import call_tokens
from prorl_cli.config import ProrlConfig
from prorl_cli.inference.contract import Generation
from prorl_cli.node.handler import AgentHandler, HandlerSettings, JobContext, Services
from prorl_cli.protocol import JobSpec, SamplingParams, derive_seed, pack_tokens
from prorl_cli.protocol.headers import Generate
from prorl_cli.testing.scripted import turn
from prorl_cli.testing.scripted_engine import ScriptedEngine


def echo(text: str) -> str:
    return text


class Echo(AgentHandler):
    """One tool call, then an answer: two model calls through ``ctx.agent``, no ``max_tokens`` setting."""

    name = "echo_sampling"
    tools = [Tool("echo", {"type": "object", "properties": {"text": {"type": "string"}}}, echo)]

    async def run(self, ctx: JobContext) -> None:
        await ctx.agent("say hi")

    async def eval(self, ctx: JobContext) -> None:
        ctx.reward = 1.0


class Capped(Echo):
    """The same with a ``max_tokens`` setting, as the shipped domain handlers have."""

    name = "capped_sampling"
    defaults = HandlerSettings(max_tokens=64)


class Recorder(Services):
    """The scripted engine's answers; keeps each call's prompt and sampling as the node's seam got them."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.calls.append((list(prompt_ids), sampling))
        return await self.engine.generate(prompt_ids, sampling)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> ScriptedEngine:
    script = tmp_path_factory.mktemp("sampling") / "script.json"
    script.write_text(json.dumps([{"match": "say hi", "turns": [turn("", ("echo", {"text": "hi"})), "Done: hi."]}]))
    return ScriptedEngine(script, str(tiny_model))


@pytest.fixture(scope="module")
def chat(tiny_model: Path) -> ChatTokens:
    return ChatTokens.from_pretrained(tiny_model)


def as_broker_reads_it(prompt_ids: list[int], sampling: SamplingParams) -> int:
    """The admission estimate of a call: the node's header, over the wire, parsed as the broker parses it."""
    header = P.parse(Generate(1, "j1", sampling).to_wire())
    return call_tokens(header, [pack_tokens(prompt_ids)])


def agent_calls(engine: ScriptedEngine, tmp_path: Path, tiny_model: Path, handler: AgentHandler,
                sampling: dict[str, Any] | None) -> list[tuple[list[int], SamplingParams]]:
    """The model calls of one job running ``handler`` whose submitter gave ``sampling`` (``None``: no map)."""
    wire: dict[str, Any] = {"job_id": "j1", "task": handler.name}
    if sampling is not None:
        wire["sampling"] = sampling
    spec = JobSpec.from_wire(JobSpec.from_wire(wire).to_wire())  # as the node gets it, forwarded by the broker
    services = Recorder(engine)
    ctx = JobContext(spec=spec, instance={"tokenizer": str(tiny_model)}, node_id="n", run_dir=tmp_path,
                     config=ProrlConfig(), services=services, log=logging.getLogger("test"), handler=handler)
    asyncio.run(handler.run(ctx))
    assert len(services.calls) == 2
    return services.calls


def test_with_set_adds_the_changed_fields_to_those_given() -> None:
    sent = SamplingParams.from_given(temperature=0.5)
    capped = sent.with_set(max_tokens=64)
    assert capped.to_wire() == {"temperature": 0.5, "max_tokens": 64} and capped.given == {"temperature", "max_tokens"}
    assert sent.to_wire() == {"temperature": 0.5} and sent.max_tokens == 256  # the original is untouched
    assert not capped.is_set("top_p") and capped.is_set("max_tokens")
    # Built here, every field counts as given, and a copy stays so.
    local = SamplingParams(max_tokens=8).with_set(seed=3)
    assert local.given is None and local.seed == 3 and local.is_set("top_k")
    with pytest.raises(ValueError, match=r"sampling.top_p must be in \(0, 1\], got 0"):
        sent.with_set(top_p=0)


def test_the_agent_loop_sends_the_jobs_fields_and_its_stop_ids_only(
        engine: ScriptedEngine, tmp_path: Path, tiny_model: Path, chat: ChatTokens) -> None:
    """A job that set a temperature and no max_tokens: each call carries the temperature and the template's stop
    ids (the loop sets those), so the broker reserves KV for the prompt, not for 256 tokens nobody asked for."""
    calls = agent_calls(engine, tmp_path, tiny_model, Echo(), {"temperature": 0.5})
    for prompt_ids, sampling in calls:
        assert sampling.to_wire() == {"temperature": 0.5, "stop_token_ids": chat.stop_token_ids}
        assert as_broker_reads_it(prompt_ids, sampling) == len(prompt_ids)


def test_a_job_without_sampling_sends_only_what_its_handler_sets(
        engine: ScriptedEngine, tmp_path: Path, tiny_model: Path, chat: ChatTokens) -> None:
    for prompt_ids, sampling in agent_calls(engine, tmp_path, tiny_model, Echo(), None):
        assert sampling.to_wire() == {"stop_token_ids": chat.stop_token_ids}
        assert as_broker_reads_it(prompt_ids, sampling) == len(prompt_ids)
    # The handler's max_tokens setting is chosen (the node set it), so the broker counts it.
    for prompt_ids, sampling in agent_calls(engine, tmp_path, tiny_model, Capped(), None):
        assert sampling.to_wire() == {"max_tokens": 64, "stop_token_ids": chat.stop_token_ids}
        assert as_broker_reads_it(prompt_ids, sampling) == len(prompt_ids) + 64


def test_the_submitters_max_tokens_and_seed_win_and_stay_given(
        engine: ScriptedEngine, tmp_path: Path, tiny_model: Path, chat: ChatTokens) -> None:
    calls = agent_calls(engine, tmp_path, tiny_model, Capped(), {"max_tokens": 32, "seed": 5})
    assert [s.to_wire() for _, s in calls] == [
        {"max_tokens": 32, "seed": seed, "stop_token_ids": chat.stop_token_ids} for seed in (5, derive_seed(5, 1))]
    assert [as_broker_reads_it(p, s) for p, s in calls] == [len(p) + 32 for p, _ in calls]


def test_run_tool_agent_keeps_the_fields_its_caller_gave(engine: ScriptedEngine, chat: ChatTokens) -> None:
    seen: list[SamplingParams] = []

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        seen.append(sampling)
        return await engine.generate(prompt_ids, sampling)

    given = SamplingParams.from_given(top_p=0.9)
    asyncio.run(run_tool_agent(generate, chat, [{"role": "user", "content": "say hi"}], Echo.tools,
                               sampling=given, record_into=None))
    assert [s.to_wire() for s in seen] == [{"top_p": 0.9, "stop_token_ids": chat.stop_token_ids}] * 2
    # Stop ids the caller chose are its own: the loop adds none, and the fields stay the caller's.
    mine = SamplingParams.from_given(stop_token_ids=[7])
    seen.clear()
    asyncio.run(run_tool_agent(generate, chat, [{"role": "user", "content": "say hi"}], Echo.tools,
                               sampling=mine, record_into=None, max_turns=1))
    assert [s.to_wire() for s in seen] == [{"stop_token_ids": [7]}]
