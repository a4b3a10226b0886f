"""Search-R1's tag protocol (``tool_format: search_r1``): ``<search>`` cuts the model's output, the passages follow in
``<information>`` inside the same assistant turn, token-exactly and masked, and ``<answer>`` ends the rollout.

The parser and the loop are checked on the tiny tokenizer; the search task end to end on a real node with a scripted
model (``tests/domains/conftest.py``), beside the default Hermes protocol, which stays as it was."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent import run_tool_agent
from prorl_cli.agent.chat import ChatTokens
from prorl_cli.agent.loop import TokenSession
from prorl_cli.agent.tools import (
    SEARCH_R1_INVALID,
    InlineToolParser,
    SearchR1ToolParser,
    get_tool_parser,
)
from prorl_cli.exceptions import AgentLoopError
from prorl_cli.inference import Generation
from prorl_cli.protocol import SamplingParams
from prorl_cli.testing.scripted_engine import calls_path_for
from tests.domains.conftest import ScriptedStack, turn
from tests.harness import need_module

PASSAGE = "Alexander Fleming discovered penicillin in 1928 at St Mary's Hospital."
INFORMATION = f'\n\n<information>Doc 1(Title: "SR1P Penicillin") {PASSAGE}</information>\n\n'
# What a model not stopped at </search> goes on to write: its own made-up results and a wrong answer.
SEARCH_TURN = ("<think>I need to look it up.</think>\n<search> penicillin discovered </search>\n\n"
               "<information>Doc 1(Title: made up) Louis Pasteur did.</information>\n\n<answer>Louis Pasteur</answer>")


@pytest.fixture(scope="module")
def chat(tiny_model: Path) -> ChatTokens:
    return ChatTokens.from_pretrained(tiny_model)


def test_the_parser_reads_the_first_action_as_search_r1_does() -> None:
    parser = get_tool_parser("search_r1")
    assert isinstance(parser, SearchR1ToolParser) and isinstance(parser, InlineToolParser)
    text = "<think>x</think><search> who </search> then <answer>a</answer>"
    assert parser.action_end(text) == text.index("</search>") + len("</search>")
    [call] = parser.parse(text[: parser.action_end(text)])
    assert (call.name, call.arguments, call.error) == ("search", {"query": "who"}, None)
    assert parser.parse("<answer> Paris </answer>") == []                       # an answer ends the rollout
    assert parser.action_end("no closing </search> before an opening") is None  # a close with nothing opened
    assert parser.action_end("<search>q</answer>") is None                      # tags must pair
    [bad] = parser.parse("<search> never closed")
    assert bad.error and bad.name == ""
    # An answer closed inside an unclosed search is the action that completed first.
    text = "<search>q <answer>b</answer> and </search>"
    assert parser.parse(text[: parser.action_end(text)]) == []
    assert parser.observation([call, bad], ["Doc 1(Title: T) t\n", "error: no"]) == (
        "\n\n<information>Doc 1(Title: T) t</information>\n\n" + SEARCH_R1_INVALID)


class Scripted:
    """A model answering the scripted texts (the end-of-turn id appended), one per call."""

    def __init__(self, chat: ChatTokens, texts: list[str]) -> None:
        self.outputs = [chat.encode(t) + chat.stop_token_ids[-1:] for t in texts]
        self.prompts: list[list[int]] = []

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.outputs[min(len(self.prompts) - 1, len(self.outputs) - 1)]
        return Generation(ids, [-0.5 - 0.01 * k for k in range(len(ids))], "stop", "scripted")


def test_the_loop_cuts_at_the_search_and_continues_the_same_turn(chat: ChatTokens) -> None:
    model = Scripted(chat, [SEARCH_TURN, "<answer> Alexander Fleming </answer> and more"])
    queries: list[str] = []

    def search(query: str) -> str:
        queries.append(query)
        return f'Doc 1(Title: "SR1P Penicillin") {PASSAGE}\n'

    messages = [{"role": "user", "content": "Question: who discovered penicillin?\n"}]
    traj = asyncio.run(run_tool_agent(model, chat, messages, {"search": search}, sampling=SamplingParams(max_tokens=256),
                                      parser=get_tool_parser("search_r1"), record_into=None))
    first, second = traj.calls
    assert queries == ["penicillin discovered"] and traj.stop_reason == "stop"
    # The kept output is the shortest prefix of what was sampled that holds the whole </search>, log-probs and all.
    sampled = model.outputs[0]
    assert first.output_ids == sampled[: len(first.output_ids)] and len(first.output_ids) < len(sampled)
    assert "</search>" in chat.decode(first.output_ids) and "</search>" not in chat.decode(first.output_ids[:-1])
    assert first.logprobs == [-0.5 - 0.01 * k for k in range(len(first.output_ids))]
    assert "Louis Pasteur" not in chat.decode(traj.sequence_ids)
    # The next prompt is exactly the last prompt + kept output + the ids of the observation alone: what the model saw.
    assert model.prompts[1] == second.prompt_ids == first.prompt_ids + first.output_ids + chat.encode(INFORMATION)
    observation = len(chat.encode(INFORMATION))
    assert traj.sequence_ids == second.prompt_ids + second.output_ids
    assert traj.loss_mask == ([0] * len(first.prompt_ids) + [1] * len(first.output_ids) + [0] * observation
                              + [1] * len(second.output_ids))
    assert second.text.endswith("</answer>") and second.finish_reason == "stop"
    # One assistant turn, as the model wrote and read it.
    assert [m["role"] for m in traj.messages] == ["user", "assistant"]
    assert traj.messages[-1]["content"] == first.text + INFORMATION + second.text
    assert traj.token_exact


def test_a_turn_without_an_action_gets_the_note_and_max_turns_ends_the_loop(chat: ChatTokens) -> None:
    model = Scripted(chat, ["<search> never closed"])
    traj = asyncio.run(run_tool_agent(model, chat, [{"role": "user", "content": "q"}], {"search": lambda query: "x"},
                                      sampling=SamplingParams(max_tokens=64), max_turns=3,
                                      parser=get_tool_parser("search_r1"), record_into=None))
    assert traj.stop_reason == "max_turns" and len(traj.calls) == 3
    first, second, _ = traj.calls
    # The end-of-turn id is dropped (Search-R1's sequences carry none mid-turn) and the note follows.
    assert first.output_ids == model.outputs[0][:-1]
    assert second.prompt_ids == first.prompt_ids + first.output_ids + chat.encode(SEARCH_R1_INVALID)


def test_cut_and_continue_need_a_generate_first(chat: ChatTokens) -> None:
    session = TokenSession(chat, Scripted(chat, ["x"]), [{"role": "user", "content": "q"}])
    with pytest.raises(AgentLoopError, match="follows a generate"):
        session.continue_turn("obs")
    with pytest.raises(AgentLoopError, match="follows a generate"):
        session.cut_output(0)
    asyncio.run(session.generate(SamplingParams(max_tokens=8)))
    with pytest.raises(AgentLoopError, match=r"cut_output\(99\)"):
        session.cut_output(99)


def _corpus(path: Path) -> Path:
    """A FlashRAG-shaped corpus ({id, contents}, the quoted title on the first line)."""
    rows = [{"id": "p1", "contents": f'"SR1P Penicillin"\n{PASSAGE}'},
            {"id": "p2", "contents": '"SR1P Python"\nGuido van Rossum created the Python programming language.'},
            {"id": "p3", "contents": '"SR1P Eiffel"\nMaurice Koechlin designed the structure of the Eiffel Tower.'}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_search_r1_protocol_end_to_end_beside_the_default(stack: ScriptedStack, tmp_path: Path) -> None:
    need_module("bm25s", "domains")
    chat = ChatTokens.from_pretrained(stack.tiny_model)
    corpus = str(_corpus(tmp_path / "wiki.jsonl"))
    # The first entry whose match is in the prompt answers; the whole rollout is one assistant turn, so the turn
    # after a search is chosen by the passage the prompt now holds.
    stack.add('(Title: "SR1P Penicillin")', "<think>Fleming.</think>\n<answer> Alexander Fleming </answer>")
    stack.add("SR1P-full:", SEARCH_TURN)
    stack.add("SR1P-loop:", "<search>python creator</search>")
    stack.add("SR1P-open:", "<think>hmm</think><search> penicillin discovered")
    stack.add("SR1P-hermes:", turn("", ("search", {"query": "penicillin discovered"})), "\\boxed{Alexander Fleming}")
    stack.add("SR1P-tags:", "<search>penicillin discovered</search>")
    stack.start_model()

    def job(question: str, **settings: Any) -> dict[str, Any]:
        return {"question": question, "answers": ["Alexander Fleming"], "settings": {"corpus": corpus, **settings}}

    full, loop, unclosed, hermes, tags, bad = stack.run("search", [
        job("SR1P-full: who discovered penicillin?", tool_format="search_r1"),
        job("SR1P-loop: who discovered penicillin?", tool_format="search_r1", max_turns=2),
        job("SR1P-open: who discovered penicillin?", tool_format="search_r1", max_turns=2),
        job("SR1P-hermes: who discovered penicillin?"),
        job("SR1P-tags: who discovered penicillin?"),
        job("SR1P-bad: who discovered penicillin?", tool_format="searchr1"),
    ])
    for result in (full, loop, unclosed, hermes, tags):
        assert result.state == "done", result.error

    # Search-R1: searched, read the passage in <information>, answered; the made-up tail after </search> is gone.
    assert (full.reward, full.output["predicted"], full.output["searches"]) == (
        1.0, "Alexander Fleming", ["penicillin discovered"])
    traj = full.output["trajectory"]
    first, second = traj["calls"]
    kept = len(first["prompt_ids"]) + len(first["output_ids"])
    assert second["prompt_ids"][:kept] == first["prompt_ids"] + first["output_ids"]
    assert chat.decode(second["prompt_ids"][kept:]) == INFORMATION
    assert traj["sequence_ids"] == second["prompt_ids"] + second["output_ids"]
    assert traj["loss_mask"] == ([0] * len(first["prompt_ids"]) + [1] * len(first["output_ids"])
                                 + [0] * (len(second["prompt_ids"]) - kept) + [1] * len(second["output_ids"]))
    assert "Louis Pasteur" not in chat.decode(traj["sequence_ids"]) and traj["stop_reason"] == "stop"
    # The ids the model was sent are the trajectory's, call for call.
    sent = [json.loads(line)["prompt_ids"] for line in calls_path_for(stack.script_path).read_text().splitlines()]
    assert first["prompt_ids"] in sent and second["prompt_ids"] in sent
    # Its prompt: Search-R1's instruction around the question, no system prompt, no tool schemas.
    prompt = chat.decode(first["prompt_ids"])
    assert "call a search engine by <search> query </search>" in prompt
    assert "Question: SR1P-full: who discovered penicillin?\n" in prompt
    assert "<tools>" not in prompt and "\\boxed" not in prompt

    # max_turns counts searches; one that searches on and on, or never closes its tag, ends cleanly at the limit.
    assert (loop.reward, loop.output["stop_reason"], loop.output["turns"]) == (0.0, "max_turns", 3)
    assert loop.output["searches"] == ["python creator"] * 2
    assert (unclosed.reward, unclosed.output["stop_reason"], unclosed.output["searches"]) == (0.0, "max_turns", [])
    notes = unclosed.output["trajectory"]["calls"][1]["prompt_ids"]
    assert chat.decode(notes).endswith(SEARCH_R1_INVALID)

    # The default (Hermes) is as it was: tool schemas in the prompt, calls as <tool_call>, and <search> plain text.
    assert (hermes.reward, hermes.output["predicted"], hermes.output["searches"]) == (
        1.0, "Alexander Fleming", ["penicillin discovered"])
    assert "<tools>" in chat.decode(hermes.output["trajectory"]["calls"][0]["prompt_ids"])
    assert (tags.reward, tags.output["turns"], tags.output["searches"]) == (0.0, 1, [])

    # A format that does not exist fails the job, naming the setting and the choices.
    assert bad.state == "failed" and bad.error is not None, bad
    message = bad.error["message"]
    assert "tool_format" in message and "'searchr1'" in message and "search_r1" in message, bad.error
