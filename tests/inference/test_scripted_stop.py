"""The scripted test engine honours ``sampling.stop`` as the transformers engine does: a scripted turn ends at the
token whose text completes a stop string, named in ``Generation.stop_string`` (the generate contract, docs/inference.md
"Stop strings"), and the calls record holds the ids it returned."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from prorl_cli.protocol import SamplingParams
from prorl_cli.testing.scripted_engine import ScriptedEngine, calls_path_for

TURN = "<search> who wrote it </search>\n\n<information>made up</information> END and more"


@pytest.fixture
def engine(tmp_path: Path, tiny_model: Path) -> ScriptedEngine:
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"match": "STOPQ", "turns": [TURN]}]))
    return ScriptedEngine(script, str(tiny_model))


def _prompt(engine: ScriptedEngine) -> list[int]:
    text = "<|im_start|>user\nSTOPQ<|im_end|>\n<|im_start|>assistant\n"
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def _decode(engine: ScriptedEngine, ids: list[int]) -> str:
    return str(engine.tokenizer.decode(ids, skip_special_tokens=False))


def test_a_stop_string_ends_the_scripted_turn_at_the_token_that_completes_it(engine: ScriptedEngine) -> None:
    whole = asyncio.run(engine.generate(_prompt(engine), SamplingParams()))
    assert _decode(engine, whole.output_ids) == TURN + "<|im_end|>" and whole.stop_string is None

    # Of the strings the output holds, the one ending first wins, whatever the order given.
    gen = asyncio.run(engine.generate(_prompt(engine), SamplingParams.from_given(stop=["END", "</search>"])))
    assert (gen.finish_reason, gen.stop_string) == ("stop", "</search>")
    assert gen.output_ids == whole.output_ids[: len(gen.output_ids)]  # never re-tokenized: a prefix of the turn
    assert "</search>" in _decode(engine, gen.output_ids)
    assert "</search>" not in _decode(engine, gen.output_ids[:-1])    # the last token completed it
    assert "<information>" not in _decode(engine, gen.output_ids)
    assert len(gen.logprobs) == len(gen.output_ids)
    recorded = [json.loads(line) for line in calls_path_for(engine.script_path).read_text().splitlines()]
    assert recorded[-1]["output_ids"] == gen.output_ids and recorded[-1]["sampling"]["stop"] == ["END", "</search>"]


def test_a_stop_string_past_max_tokens_or_absent_does_not_stop(engine: ScriptedEngine) -> None:
    absent = asyncio.run(engine.generate(_prompt(engine), SamplingParams.from_given(stop=["never there"])))
    assert (absent.finish_reason, absent.stop_string) == ("stop", None)
    assert _decode(engine, absent.output_ids) == TURN + "<|im_end|>"

    cut = asyncio.run(engine.generate(_prompt(engine), SamplingParams.from_given(stop=["END"], max_tokens=3)))
    assert (cut.finish_reason, cut.stop_string, len(cut.output_ids)) == ("length", None, 3)
