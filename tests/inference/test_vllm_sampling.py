"""vLLM samples from the distribution the generate contract names, whatever the model's generation_config.json says."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from prorl_cli.inference.openai_engine import OpenAIEngine
from prorl_cli.protocol import SamplingParams
from tests.harness import need_module
from tests.inference.conftest import MAX_MODEL_LEN, serving_vllm

PROMPT = [1, 1624, 201, 57, 74, 277, 316, 2, 201, 1, 2703, 201]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_greedy_takes_the_models_top_token_despite_a_repetition_penalty_in_generation_config(
        tiny_model: Path, tmp_path: Path) -> None:
    # Qwen2.5-Instruct ships repetition_penalty 1.05 in generation_config.json, and vLLM applies such defaults to
    # every request that leaves the field out: its samples would come from a penalised distribution while the
    # log-probs it returns (and the trainer computes) are the unmodified model's. A strong one makes it visible.
    need_module("vllm", "vllm")
    from prorl_cli.inference.vllm_server import VLLMServer

    model = tmp_path / "penalised"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 5.0}))

    async def ask(url: str) -> tuple[list[int], list[int]]:
        engine = OpenAIEngine(url)
        try:
            await engine.start()
            gen = await engine.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                               top_logprobs=1))
            assert gen.top_logprobs is not None
            return gen.output_ids, [row[0][0] for row in gen.top_logprobs]
        finally:
            await engine.close()

    server = VLLMServer(model, max_model_len=MAX_MODEL_LEN, log_path=tmp_path / "vllm.log")
    with serving_vllm(server):
        sampled, most_likely = asyncio.run(ask(server.url))
    assert len(sampled) == 24
    assert sampled == most_likely, "greedy did not take the model's most likely token"
