"""Engines against real models: the transformers engine, and vLLM on the CPU over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.exceptions import InferenceError
from prorl_cli.inference.openai_engine import OpenAIEngine
from prorl_cli.inference.vllm_server import free_port
from prorl_cli.protocol import SamplingParams
from tests.fakes.canned_http import CannedHTTPServer
from tests.harness import need_module

PROMPT = [1, 1624, 201, 57, 74, 277, 316, 2, 201, 1, 2703, 201]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Any:
    from prorl_cli.inference.transformers_engine import TransformersEngine

    eng = TransformersEngine(tiny_model, max_model_len=256, backend_id="tf")
    run(eng.start())
    return eng


def teacher_forced_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> list[float]:
    """Log-probs of ``output`` after ``prompt`` from one full forward pass (no KV cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def test_transformers_logprobs_are_the_models(engine: Any, tiny_model: Path) -> None:
    gen = run(engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.8, seed=7)))
    assert gen.backend_id == "tf" and len(gen.output_ids) == len(gen.logprobs) > 0
    expected = teacher_forced_logprobs(tiny_model, PROMPT, gen.output_ids)
    assert gen.logprobs == pytest.approx(expected, abs=1e-4)


def test_transformers_seed_greedy_stop_and_length(engine: Any) -> None:
    a = run(engine.generate(PROMPT, SamplingParams(max_tokens=10, seed=3)))
    b = run(engine.generate(PROMPT, SamplingParams(max_tokens=10, seed=3)))
    assert a.output_ids == b.output_ids and a.finish_reason == "length" and len(a.output_ids) == 10
    g = run(engine.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0)))
    assert g.output_ids == run(engine.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, seed=99))).output_ids
    stop = run(engine.generate(PROMPT, SamplingParams(max_tokens=10, seed=3, stop_token_ids=[a.output_ids[3]])))
    assert stop.finish_reason == "stop" and stop.output_ids == a.output_ids[: a.output_ids.index(a.output_ids[3]) + 1]
    # Near the context limit, output is cut at max_model_len (as vLLM does).
    near = run(engine.generate([5] * 250, SamplingParams(max_tokens=50, seed=1)))
    assert len(near.output_ids) == 6 or near.finish_reason == "stop"
    assert len(near.output_ids) <= 6


def test_transformers_bad_input_names_the_problem(engine: Any) -> None:
    with pytest.raises(InferenceError, match="maximum context length is 256"):
        run(engine.generate([5] * 300, SamplingParams()))
    with pytest.raises(InferenceError, match="outside the vocabulary"):
        run(engine.generate([10**6], SamplingParams()))


@pytest.mark.vllm
def test_vllm_token_in_token_out(vllm_server: Any) -> None:
    eng = OpenAIEngine(vllm_server.url, backend_id="v")
    run(eng.start())
    assert eng.max_model_len == 1024 and eng.model
    a = run(eng.generate(PROMPT, SamplingParams(max_tokens=16, seed=5)))
    b = run(eng.generate(PROMPT, SamplingParams(max_tokens=16, seed=5)))
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs and len(a.output_ids) == 16
    assert all(lp <= 0 for lp in a.logprobs)
    s = run(eng.generate(PROMPT, SamplingParams(max_tokens=16, seed=5, stop_token_ids=[a.output_ids[2]])))
    assert s.finish_reason == "stop" and s.output_ids[-1] == a.output_ids[2]


@pytest.mark.vllm
def test_vllm_errors_carry_the_servers_message(vllm_server: Any) -> None:
    eng = OpenAIEngine(vllm_server.url)
    with pytest.raises(InferenceError, match=r"HTTP 400: .*maximum context length is 1024"):
        run(eng.generate([5] * 1100, SamplingParams(max_tokens=4)))
    with pytest.raises(InferenceError, match="out of vocabulary"):
        run(eng.generate([10**6], SamplingParams(max_tokens=4)))


@pytest.mark.vllm
def test_vllm_a_prompt_that_fills_the_context_is_named_like_the_other_engines(vllm_server: Any) -> None:
    # A prompt of exactly max_model_len tokens fits vLLM's own prompt check but leaves no room for output.
    eng = OpenAIEngine(vllm_server.url)
    with pytest.raises(InferenceError, match="maximum context length is 1024") as refused:
        run(eng.generate([5] * 1024, SamplingParams(max_tokens=4)))
    assert "1024 tokens" in str(refused.value)
    assert len(run(eng.generate([5] * 1023, SamplingParams(max_tokens=4, ignore_eos=True))).output_ids) == 1


@pytest.mark.vllm
def test_vllm_constrains_the_output_as_sampling_structured_asks(vllm_server: Any, tiny_model: Path) -> None:
    """A random model's output obeys the constraint: one of the choices, the regex, an object of the schema. The
    log-probs are the masked distribution's: a token only the constraint allows has log-prob 0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    eng = OpenAIEngine(vllm_server.url, backend_id="v")

    def text(structured: dict[str, Any], seed: int, max_tokens: int = 24) -> tuple[str, list[float]]:
        gen = run(eng.generate(PROMPT, SamplingParams(max_tokens=max_tokens, seed=seed, structured=structured)))
        assert gen.finish_reason == "stop", gen  # the constraint ends the turn, well inside max_tokens
        return tok.decode(gen.output_ids, skip_special_tokens=True), gen.logprobs

    for seed in range(4):
        choice, logprobs = text({"choice": ["yes", "no"]}, seed)
        assert choice in ("yes", "no")
        assert logprobs[-1] == 0.0, logprobs  # after the answer, only the end of turn is allowed
        assert re.fullmatch("[0-9]{3}", text({"regex": "[0-9]{3}"}, seed)[0])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    obj = json.loads(text({"json": schema}, 1, max_tokens=200)[0])
    assert list(obj) == ["a"] and isinstance(obj["a"], int), obj


@pytest.mark.vllm
def test_a_gateway_answer_beside_tools_obeys_the_constraint_on_vllm(vllm_server: Any, tiny_model: Path) -> None:
    """A constraint beside tools through the gateway on vLLM (the OpenAI Agents SDK's case, an ``output_type``
    and tools at every call): the random model's free turn is neither a tool call nor what the constraint allows,
    so the gateway samples it again under the constraint, and the answer obeys it; the trajectory records the
    constrained turn. (A regex and a choice: a random model pads a JSON object with whitespace past any bound.)"""
    need_module("openai", "test")
    need_module("aiohttp", "gateway")
    import openai

    from prorl_cli.agent.chat import ChatTokens
    from prorl_cli.agent.tools import get_tool_parser
    from prorl_cli.gateway.server import Gateway

    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}}]
    constraints = [{"regex": "[0-9]{1,3}"}, {"choice": ["yes", "no"]}]
    base = ChatTokens.from_pretrained(tiny_model)
    eng = OpenAIEngine(vllm_server.url, backend_id="v")

    async def main() -> list[tuple[Any, Any]]:
        gw = Gateway()
        await gw.start()
        job = gw.open_job("job-1", generate=eng.generate, parser=get_tool_parser("hermes"),
                          chat_for=lambda t: ChatTokens(base.tokenizer, tools=t),
                          sampling=SamplingParams(max_tokens=48))
        answers = []
        try:
            async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as client:
                for seed, structured in enumerate(constraints * 2):
                    resp = await client.chat.completions.create(
                        model="prorl", seed=seed, tools=tools,  # type: ignore[arg-type]
                        messages=[{"role": "user", "content": f"Is {seed} + 2 more than 3?"}],
                        extra_body={"structured_outputs": structured})
                    answers.append((resp.choices[0].message, job.trajectory.calls[-1]))
        finally:
            await gw.close()
            await eng.close()
        return answers

    for (msg, call), structured in zip(run(main()), constraints * 2, strict=True):
        assert not msg.tool_calls and call.format_retried, (msg, call.text)  # a random model's free turn
        assert call.structured == structured and call.prefix_ok and call.finish_reason == "stop"
        assert msg.content in ("yes", "no") if "choice" in structured else re.fullmatch("[0-9]{1,3}", msg.content)


def test_engines_that_cannot_constrain_refuse_instead_of_answering_unconstrained(engine: Any) -> None:
    from prorl_cli.exceptions import ProtocolError
    from prorl_cli.inference.sim_engine import SimEngine

    for eng in (engine, SimEngine()):
        with pytest.raises(ProtocolError, match=r"sampling.structured \(choice\): the .* cannot constrain"):
            run(eng.generate(PROMPT, SamplingParams(structured={"choice": ["yes", "no"]})))


def test_server_down_is_an_error_not_a_hang() -> None:
    eng = OpenAIEngine(f"http://127.0.0.1:{free_port()}/v1", model="m", timeout_s=10)
    with pytest.raises(InferenceError, match="ConnectionRefusedError"):
        run(eng.generate(PROMPT, SamplingParams()))
    assert run(eng.healthy()) is False


@pytest.fixture
def fake() -> Iterator[Any]:
    async def call(status: int, body: bytes) -> Any:
        server = await asyncio.start_server(CannedHTTPServer(status, body).handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await OpenAIEngine(f"http://127.0.0.1:{port}", model="m").generate(PROMPT, SamplingParams())
        finally:
            server.close()

    yield lambda status, body: run(call(status, body))


def test_malformed_replies_are_named(fake: Any) -> None:
    with pytest.raises(InferenceError, match="not JSON"):
        fake(200, b"<html>")
    with pytest.raises(InferenceError, match="no choices"):
        fake(200, b"{}")
    with pytest.raises(InferenceError, match="return_token_ids"):
        fake(200, json.dumps({"choices": [{"text": "hi"}]}).encode())
    with pytest.raises(InferenceError, match="2 token ids but logprobs.token_logprobs is 1 long"):
        fake(200, json.dumps({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]}).encode())
    with pytest.raises(InferenceError, match="prompt_token_ids differ"):
        fake(200, json.dumps({"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-1.0]},
                                           "prompt_token_ids": [9, 9]}]}).encode())
    with pytest.raises(InferenceError, match="HTTP 503: overloaded"):
        fake(503, json.dumps({"error": {"message": "overloaded"}}).encode())
    gen = fake(200, json.dumps({"choices": [{"token_ids": [4], "logprobs": {"token_logprobs": [-0.25]},
                                             "finish_reason": "length"}]}).encode())
    assert (gen.output_ids, gen.logprobs, gen.finish_reason) == ([4], [-0.25], "length")


@pytest.mark.parametrize("models", [{"data": [{"object": "model"}]}, {"data": [{"id": "m", "max_model_len": "long"}]}])
def test_a_malformed_models_answer_is_named(models: dict[str, Any]) -> None:
    """``describe`` (an engine given no model name, or ``--attach``) names a /models answer it cannot read."""

    async def call() -> None:
        server = await asyncio.start_server(CannedHTTPServer(200, json.dumps(models).encode()).handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = OpenAIEngine(f"http://127.0.0.1:{port}")
        try:
            await engine.describe()
        finally:
            await engine.close()
            server.close()

    with pytest.raises(InferenceError, match="malformed /models answer"):
        run(call())
