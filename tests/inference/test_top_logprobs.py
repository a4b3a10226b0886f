"""``sampling.top_logprobs``: the k most likely tokens per output position, from the engines that can say,
carried in two more ``generate_reply`` payload frames only when asked for."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.exceptions import ProtocolError
from prorl_cli.inference.contract import Generation
from prorl_cli.inference.openai_engine import OpenAIEngine, completions_body
from prorl_cli.protocol import SamplingParams, pack_floats, pack_tokens
from prorl_cli.testing.scripted_engine import top_logprobs
from tests.fakes.canned_http import CannedHTTPServer
from tests.harness import Deployment
from tests.inference.conftest import start_bridge

PROMPT = [1, 1624, 201, 57, 74, 277, 316, 2, 201, 1, 2703, 201]


def test_the_reply_frames_carry_top_logprobs_only_when_present() -> None:
    top = [[(5, -0.25), (9, -1.5)], [(6, -0.5), (2, -2.0)], [(7, -0.75), (8, -3.0)]]
    gen = Generation([5, 6, 7], [-0.25, -0.5, -0.75], "stop", "b", top_logprobs=top)
    frames = gen.payload()
    assert len(frames) == 4
    back = Generation.from_payload(frames, "stop", "b")
    assert back.top_logprobs == top and back.output_ids == [5, 6, 7]  # every value exact in float32
    plain = Generation([5], [-0.25], "stop", None)
    assert len(plain.payload()) == 2 and Generation.from_payload(plain.payload(), "stop", None).top_logprobs is None
    empty = Generation([], [], "length", None, top_logprobs=[])
    assert Generation.from_payload(empty.payload(), "length", None).top_logprobs == []


def test_malformed_top_logprobs_frames_are_named() -> None:
    ids, lps = pack_tokens([5, 6]), pack_floats([-0.25, -0.5])
    with pytest.raises(ProtocolError, match="2 payload frames .* or 4 .* got 3"):
        Generation.from_payload([ids, lps, pack_tokens([1, 2])], "stop", None)
    with pytest.raises(ProtocolError, match="3 top_logprobs ids and 3 logprobs for 2 output tokens"):
        Generation.from_payload([ids, lps, pack_tokens([1, 2, 3]), pack_floats([-1.0] * 3)], "stop", None)
    with pytest.raises(ProtocolError, match="4 top_logprobs ids and 2 logprobs"):
        Generation.from_payload([ids, lps, pack_tokens([1, 2, 3, 4]), pack_floats([-1.0] * 2)], "stop", None)
    with pytest.raises(ValueError, match="rows differ in length"):
        Generation([5, 6], [-0.25, -0.5], "stop", None, top_logprobs=[[(5, -0.25)], []])
    with pytest.raises(ValueError, match="top_logprobs for 1 positions"):
        Generation([5, 6], [-0.25, -0.5], "stop", None, top_logprobs=[[(5, -0.25)]])


def test_sampling_top_logprobs_range_is_checked() -> None:
    assert SamplingParams(top_logprobs=20).top_logprobs == 20
    for bad in (-1, 21, 2.5):
        with pytest.raises(ValueError, match="sampling.top_logprobs"):
            SamplingParams(top_logprobs=bad)  # type: ignore[arg-type]


def test_the_scripted_engine_puts_the_sampled_token_first_then_the_configured_ones() -> None:
    rows = top_logprobs([10, 11], 3, alternatives=[11, 40])
    assert rows == [[(10, -0.1), (11, -1.0), (40, -2.0)], [(11, -0.1), (40, -1.0), (12, -2.0)]]


def test_transformers_engine_returns_the_top_k_of_each_step(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from prorl_cli.inference.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_model, max_model_len=256, backend_id="tf")
    gen = asyncio.run(engine.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, top_logprobs=4)))
    assert gen.top_logprobs is not None and len(gen.top_logprobs) == len(gen.output_ids) == 6
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([PROMPT + gen.output_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    for i, (token, row) in enumerate(zip(gen.output_ids, gen.top_logprobs, strict=True)):
        assert len(row) == 4 and [p[1] for p in row] == sorted((p[1] for p in row), reverse=True)
        assert row[0][0] == token and row[0][1] == pytest.approx(gen.logprobs[i])  # greedy: the sampled is the top
        want_values, want_ids = torch.topk(lp[len(PROMPT) - 1 + i], 4)
        assert [p[0] for p in row] == want_ids.tolist()
        assert [p[1] for p in row] == pytest.approx(want_values.tolist(), abs=1e-4)
    plain = asyncio.run(engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0)))
    assert plain.top_logprobs is None


def _vllm_answer(ids: list[int], top: list[dict[str, float]]) -> bytes:
    """A vLLM ``/v1/completions`` answer with ``return_token_ids`` and ``return_tokens_as_token_ids``."""
    return json.dumps({"choices": [{"token_ids": ids, "finish_reason": "stop", "logprobs": {
        "token_logprobs": [-0.5] * len(ids), "tokens": [f"token_id:{i}" for i in ids], "top_logprobs": top}}]}).encode()


def _openai_engine_call(body: bytes, sampling: SamplingParams) -> Generation:
    async def call() -> Generation:
        server = await asyncio.start_server(CannedHTTPServer(200, body).handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = OpenAIEngine(f"http://127.0.0.1:{port}", model="m")
        try:
            return await engine.generate(PROMPT, sampling)
        finally:
            await engine.close()
            server.close()

    return asyncio.run(call())


def test_the_openai_engine_asks_for_and_reads_top_logprobs_by_token_id() -> None:
    body = completions_body("m", PROMPT, SamplingParams(top_logprobs=2))
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    assert completions_body("m", PROMPT, SamplingParams())["logprobs"] == 0
    # vLLM adds the sampled token when it is not among the k: the k most likely are kept, most likely first.
    answer = _vllm_answer([7, 8], [{"token_id:3": -1.5, "token_id:7": -0.5},
                                   {"token_id:4": -0.25, "token_id:9": -2.0, "token_id:8": -3.0}])
    gen = _openai_engine_call(answer, SamplingParams(top_logprobs=2))
    assert gen.top_logprobs == [[(7, -0.5), (3, -1.5)], [(4, -0.25), (9, -2.0)]]
    assert _openai_engine_call(answer, SamplingParams()).top_logprobs is None


def test_the_openai_engine_gives_none_when_the_server_keys_alternatives_by_text(caplog: Any) -> None:
    gen = _openai_engine_call(_vllm_answer([7], [{"hello": -0.5}]), SamplingParams(top_logprobs=1))
    assert gen.top_logprobs is None and gen.output_ids == [7]
    assert "not token_id:N" in caplog.text


def test_values_that_are_not_numbers_are_named_not_a_bare_value_error(caplog: Any) -> None:
    from prorl_cli.exceptions import InferenceError
    from prorl_cli.inference.openai_engine import parse_completion

    # An alternative that is not a log-probability (or an id int() refuses): the alternatives are dropped, the call stands.
    for top in ([{"token_id:7": "high"}], [{"token_id:7": [1]}], [{"token_id:\u00b2": -0.5}]):
        gen = _openai_engine_call(_vllm_answer([7], top), SamplingParams(top_logprobs=1))
        assert gen.top_logprobs is None and gen.output_ids == [7] and gen.logprobs == [-0.5]
    assert "not a token id and a log-probability" in caplog.text
    # The sampled tokens' own log-probabilities are required: a bad one fails the call, naming the field.
    data = {"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": ["-0.5x"]}}]}
    with pytest.raises(InferenceError, match="token_logprobs holds a value that is not a number"):
        parse_completion(data, PROMPT, "http://x/v1", None)


def test_alternatives_travel_node_broker_bridge_and_back(deployment: Deployment, tiny_model: Path) -> None:
    """The real path: a job's call through the broker to a transformers bridge; the reply's two extra frames
    come back as ``Generation.top_logprobs`` only for the job that asked."""
    start_bridge(deployment, "b-top", "--engine", "transformers", "--model", str(tiny_model))
    instance = {"prompt_ids": PROMPT}
    asked = deployment.client.submit("onecall", [instance], sampling={"max_tokens": 5, "temperature": 0,
                                                                      "top_logprobs": 3}, timeout_s=120)
    plain = deployment.client.submit("onecall", [instance], sampling={"max_tokens": 5, "temperature": 0},
                                     timeout_s=120)
    (with_top,), (without,) = deployment.client.wait(asked, timeout_s=180), deployment.client.wait(plain, timeout_s=180)
    assert with_top.ok and without.ok, (with_top.error, without.error)
    ids, top = with_top.output["output_ids"], with_top.output["top_logprobs"]
    assert len(ids) == len(top) == 5 and all(len(row) == 3 for row in top)
    assert [row[0][0] for row in top] == ids  # greedy: the sampled token is each position's most likely
    assert without.output["output_ids"] == ids and without.output["top_logprobs"] is None
