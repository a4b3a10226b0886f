"""The transformers engine's in-place reload refuses a checkpoint it cannot load whole, and then serves as before."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.exceptions import InferenceError
from prorl_cli.protocol import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [1, 2, 3, 4]


def serve_reload_serve(model: Path, checkpoint: Path) -> tuple[Any, Exception | None, Any]:
    """Greedy output of ``model``, the error of reloading ``checkpoint`` into it (or ``None``), greedy output after."""
    from prorl_cli.inference.transformers_engine import TransformersEngine

    async def go() -> tuple[Any, Exception | None, Any]:
        engine = TransformersEngine(model, max_model_len=256)
        try:
            before = await engine.generate(PROMPT, GREEDY)
            error: Exception | None = None
            try:
                await engine.reload(str(checkpoint), 1)
            except InferenceError as e:
                error = e
            return before, error, await engine.generate(PROMPT, GREEDY)
        finally:
            await engine.close()

    return asyncio.run(go())


def test_a_checkpoint_of_another_shape_is_refused_before_any_weight_is_copied(tiny_model: Path, tmp_path: Path) -> None:
    # A third layer: the first two fit the served model, the third does not. Copying the ones that fit and
    # then failing would serve a mix of old and new weights under the old policy version.
    from prorl_cli.inference.tiny_model import make_tiny_model

    deeper = make_tiny_model(tmp_path / "deeper", seed=1, num_layers=3)
    before, error, after = serve_reload_serve(tiny_model, deeper)
    assert error is not None
    assert (after.output_ids, after.logprobs) == (before.output_ids, before.logprobs)
    assert "do not fit" in str(error) and "unchanged" in str(error) and "model.layers.2." in str(error)


def test_a_torn_checkpoint_is_refused_not_filled_with_random_weights(tiny_model: Path, tmp_path: Path) -> None:
    # from_pretrained fills a weight missing from the files with random values and only logs it.
    from safetensors.torch import load_file, save_file

    from prorl_cli.inference.transformers_engine import TransformersEngine

    torn = tmp_path / "torn"
    shutil.copytree(tiny_model, torn)
    weights = load_file(str(torn / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(torn / "model.safetensors"), metadata={"format": "pt"})

    before, error, after = serve_reload_serve(tiny_model, torn)
    assert error is not None and "model.layers.1.mlp.up_proj.weight" in str(error) and "lacks" in str(error)
    assert (after.output_ids, after.logprobs) == (before.output_ids, before.logprobs)

    # Started on it, the engine refuses it the same way.
    async def start() -> None:
        engine = TransformersEngine(torn)
        try:
            await engine.start()
        finally:
            await engine.close()

    with pytest.raises(InferenceError, match=r"lacks 1 of the model's weights.*up_proj"):
        asyncio.run(start())
