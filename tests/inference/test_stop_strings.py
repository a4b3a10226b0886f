"""``sampling.stop``: generation ends at the token whose text completes a stop string, that token included.

Each engine's handling (docs/inference.md, "Stop strings"): the transformers engine and vLLM stop there and
name the string; the simulated engine, whose ids have no text, goes on as without one. The matched string
travels back through the broker, and Search-R1's inline format sends its closing tags as stop strings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent import ChatTokens, run_tool_agent
from prorl_cli.agent.tools import get_tool_parser
from prorl_cli.exceptions import InferenceError
from prorl_cli.inference.contract import Generation, first_stop, stop_matcher
from prorl_cli.inference.openai_engine import OpenAIEngine, completions_body
from prorl_cli.inference.sim_engine import SimEngine, SimProfile
from prorl_cli.protocol import SamplingParams
from tests.fakes.canned_http import CannedHTTPServer
from tests.harness import Deployment
from tests.inference.conftest import start_bridge

PROMPT = [1, 1624, 201, 57, 74, 277, 316, 2, 201, 1, 2703, 201]
#: Sampled, not greedy: the tiny random model's greedy output is one token repeated. Seeded, a call with stop
#: strings samples the same tokens as one without, up to where it stops.
SAMPLED = {"max_tokens": 30, "temperature": 1.0, "seed": 3, "ignore_eos": True}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def decoder(tiny_model: Path) -> Callable[[list[int]], str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))


def straddling_stop(decode: Callable[[list[int]], str], ids: list[int], start: int = 6) -> tuple[str, int]:
    """A stop string that output id ``k`` (1-based) completes with text to spare, found nowhere before it: the
    last two characters of the text before that id and the first of its own. Returns ``(string, k)``."""
    for k in range(start, len(ids)):
        before, text = decode(ids[: k - 1]), decode(ids[:k])
        piece = text[len(before):]
        if not text.startswith(before) or len(before) < 2 or len(piece) < 2 or "\ufffd" in text:
            continue
        stop = before[-2:] + piece[0]
        if stop not in before:
            return stop, k
    raise AssertionError(f"no id of {ids} completes a string with text to spare")


def test_the_first_stop_is_the_one_that_ends_first_then_the_first_listed() -> None:
    assert first_stop("ab</search>cd</answer>", ["</answer>", "</search>"]) == "</search>"
    assert first_stop("xyz", ["yz", "xyz"]) == "yz"  # both end at the same character: the first listed
    assert first_stop("xyzw", ["yzw", "xyz"]) == "xyz"  # ends first, though it starts first too
    assert first_stop("abc", ["d"]) is None and first_stop("", ["a"]) is None


def test_matching_the_last_ids_finds_what_matching_the_whole_output_finds(chat: ChatTokens) -> None:
    """The engines check after every token by decoding only the output's last ids: at every token, that finds
    the string decoding the whole output finds (none, or the same one), on the real byte-level tokenizer, with
    text whose characters span several tokens (accents, CJK, emoji) and strings cut anywhere in it."""
    import random

    rng = random.Random(7)
    tok = chat.tokenizer

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False))

    words = ["the", " answer", " is", "</search>", " café", " 東京", " 🙂🙂", "\n\n", " <tool_call>", " x" * 3, "ß"]
    checked = 0
    for _ in range(150):
        text = "".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
        ids = tok.encode(text, add_special_tokens=False)
        full = decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            at, size = rng.randrange(len(full)), rng.randint(1, 12)
            stops.append(full[at:at + size])
        stops.append("never in this text")
        match = stop_matcher(decode, stops)
        for end in range(1, len(ids) + 1):
            expected = first_stop(decode(ids[:end]), stops)
            assert match(ids[:end]) == expected, (text, stops, end)
            checked += 1
            if expected is not None:
                break
    assert checked > 1000


def test_the_transformers_engine_stops_at_the_token_that_completes_the_string(tiny_model: Path) -> None:
    from prorl_cli.inference.transformers_engine import TransformersEngine

    engine = TransformersEngine(tiny_model, max_model_len=256, backend_id="tf")
    decode = decoder(tiny_model)
    full = run(engine.generate(PROMPT, SamplingParams(**SAMPLED)))
    assert len(full.output_ids) == 30 and full.stop_string is None
    stop, k = straddling_stop(decode, full.output_ids)
    later, _ = straddling_stop(decode, full.output_ids, start=k + 3)
    gen = run(engine.generate(PROMPT, SamplingParams(**SAMPLED, stop=[later, stop])))
    # Fewer ids than without the string, ending at the one that completes it: never cut inside that token,
    # whose text runs past the string.
    assert gen.output_ids == full.output_ids[:k] and len(gen.output_ids) < len(full.output_ids)
    assert gen.logprobs == full.logprobs[:k]
    assert (gen.finish_reason, gen.stop_string) == ("stop", stop)
    text = decode(gen.output_ids)
    assert stop in text and not text.endswith(stop) and stop not in decode(gen.output_ids[:-1])
    # A string the output never completes changes nothing.
    assert run(engine.generate(PROMPT, SamplingParams(**SAMPLED, stop=["\u2603never"]))).output_ids == full.output_ids


def test_a_transformers_model_without_a_tokenizer_refuses_stop_strings(tiny_model: Path, tmp_path: Path) -> None:
    from prorl_cli.inference.transformers_engine import TransformersEngine

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (tiny_model / name).exists():
            shutil.copy(tiny_model / name, bare / name)
    engine = TransformersEngine(bare, max_model_len=256)
    assert len(run(engine.generate(PROMPT, SamplingParams(max_tokens=2))).output_ids) <= 2  # no stop: served
    with pytest.raises(InferenceError, match=r"sampling.stop needs the model's tokenizer .* holds none"):
        run(engine.generate(PROMPT, SamplingParams(max_tokens=2, stop=["x"])))


def _openai_call(answer: dict[str, Any], sampling: SamplingParams) -> Generation:
    async def call() -> Generation:
        server = await asyncio.start_server(CannedHTTPServer(200, json.dumps(answer).encode()).handle, "127.0.0.1", 0)
        engine = OpenAIEngine(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", model="m")
        try:
            return await engine.generate(PROMPT, sampling)
        finally:
            await engine.close()
            server.close()

    return run(call())


def test_the_openai_engine_sends_the_strings_and_reads_which_one_stopped() -> None:
    body = completions_body("m", PROMPT, SamplingParams(stop=["</search>", "</answer>"]))
    assert body["stop"] == ["</search>", "</answer>"] and body["include_stop_str_in_output"] is True
    assert "stop" not in completions_body("m", PROMPT, SamplingParams())
    choice = {"token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -0.25]}, "finish_reason": "stop"}
    sampling = SamplingParams(stop=["</search>"])
    assert _openai_call({"choices": [{**choice, "stop_reason": "</search>"}]}, sampling).stop_string == "</search>"
    # An end-of-sequence id (vLLM names it by number, or not at all) or a string not asked for is no stop string.
    for reason in (151645, None, "</other>"):
        gen = _openai_call({"choices": [{**choice, "stop_reason": reason}]}, sampling)
        assert (gen.finish_reason, gen.stop_string, gen.output_ids) == ("stop", None, [7, 8])


def test_the_sim_engine_goes_on_as_without_stop_strings_and_says_so_once(caplog: Any) -> None:
    async def calls() -> list[Generation]:
        engine = SimEngine(SimProfile(speedup=1000.0, output_tokens_median=20.0))
        try:
            return [await engine.generate(PROMPT, SamplingParams(max_tokens=64, seed=5, stop=stop))
                    for stop in ([], ["</search>"], ["</search>"])]
        finally:
            await engine.close()

    with caplog.at_level(logging.INFO, logger="prorl_cli.inference.sim_engine"):
        plain, stopped, again = run(calls())
    assert plain.output_ids == stopped.output_ids == again.output_ids and stopped.stop_string is None
    assert caplog.text.count("sampling.stop is not matched") == 1


def test_the_matched_string_travels_node_broker_bridge_and_back(deployment: Deployment, tiny_model: Path) -> None:
    """The real path: a job's call through the broker to a transformers bridge stops at the string, and the
    reply names it; a call without stop strings runs on and names none."""
    start_bridge(deployment, "b-stop", "--engine", "transformers", "--model", str(tiny_model))
    decode = decoder(tiny_model)
    instance = {"prompt_ids": PROMPT}
    (plain,) = deployment.client.wait(deployment.client.submit("onecall", [instance], sampling=SAMPLED,
                                                               timeout_s=120), timeout_s=180)
    assert plain.ok and plain.output["stop_string"] is None, plain.error
    full = plain.output["output_ids"]
    stop, k = straddling_stop(decode, full)
    (stopped,) = deployment.client.wait(deployment.client.submit("onecall", [instance], sampling={
        **SAMPLED, "stop": [stop]}, timeout_s=120), timeout_s=180)
    assert stopped.ok, stopped.error
    assert stopped.output["output_ids"] == full[:k] and len(full[:k]) < len(full)
    assert (stopped.output["finish_reason"], stopped.output["stop_string"]) == ("stop", stop)


class StopHonouring:
    """A model that writes the scripted texts and honours ``sampling.stop`` as the contract says: the output
    ends at the id that completes the first stop string (the ids as the tokenizer wrote them, never cut)."""

    def __init__(self, chat: ChatTokens, texts: list[str]) -> None:
        self.chat = chat
        self.outputs = [chat.encode(t) + chat.stop_token_ids[-1:] for t in texts]
        self.samplings: list[SamplingParams] = []
        self.generated = 0

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        ids = self.outputs[min(len(self.samplings), len(self.outputs) - 1)]
        self.samplings.append(sampling)
        keep = self.chat.shortest_prefix(ids, lambda text: first_stop(text, sampling.stop) is not None)
        stop_string = first_stop(self.chat.decode(ids[:keep]), sampling.stop) if keep is not None else None
        ids = ids[:keep] if keep is not None else ids
        self.generated += len(ids)
        return Generation(ids, [-0.5] * len(ids), "stop", "scripted", stop_string=stop_string)


def test_search_r1_sends_its_closing_tags_as_stop_strings_and_generates_no_further(chat: ChatTokens) -> None:
    turns = ["<think>look it up</think><search> penicillin </search>\n\n<information>made up</information>"
             "<answer>Pasteur</answer>", "<answer> Fleming </answer> and then more text"]
    model = StopHonouring(chat, turns)
    traj = run(run_tool_agent(model, chat, [{"role": "user", "content": "Who discovered penicillin?"}],
                              {"search": lambda query: "Fleming did."}, sampling=SamplingParams(max_tokens=64,
                              stop=["STOP"]), parser=get_tool_parser("search_r1"), record_into=None))
    # Every call asked the engine to stop at the tags (the caller's own string kept), and the engine did.
    assert [s.stop for s in model.samplings] == [["STOP", "</search>", "</answer>"]] * 2
    first, second = traj.calls
    assert first.text.endswith("</search>") and second.text.rstrip().endswith("</answer>")
    assert (first.finish_reason, second.finish_reason) == ("stop", "stop")
    assert (first.stop_string, second.stop_string) == ("</search>", "</answer>")  # recorded with each call
    # What the model wrote past each tag was never generated: the trajectory holds every id the engine made.
    assert sum(len(c.output_ids) for c in traj.calls) == model.generated
    assert model.generated < sum(len(ids) for ids in model.outputs)
    assert traj.stop_reason == "stop" and traj.token_exact


def test_a_tool_format_without_inline_actions_sends_no_stop_strings(chat: ChatTokens) -> None:
    model = StopHonouring(chat, ["no tools needed"])
    run(run_tool_agent(model, chat, [{"role": "user", "content": "hi"}], {}, sampling=SamplingParams(max_tokens=8),
                       record_into=None))
    assert model.samplings[0].stop == []


@pytest.mark.vllm
def test_vllm_stops_at_the_token_that_completes_the_string(vllm_server: Any, tiny_model: Path) -> None:
    """vLLM (0.32, CPU) keeps the ids up to the one completing the string, with their log-probs, and names it."""
    engine = OpenAIEngine(vllm_server.url, backend_id="v")
    decode = decoder(tiny_model)
    full = run(engine.generate(PROMPT, SamplingParams(**SAMPLED)))
    stop, k = straddling_stop(decode, full.output_ids)
    gen = run(engine.generate(PROMPT, SamplingParams(**SAMPLED, stop=[stop])))
    assert gen.output_ids == full.output_ids[:k] and len(gen.output_ids) < len(full.output_ids)
    assert gen.logprobs == full.logprobs[:k]
    assert (gen.finish_reason, gen.stop_string) == ("stop", stop)
    assert not decode(gen.output_ids).endswith(stop)  # the last id's text runs past the string: kept whole
