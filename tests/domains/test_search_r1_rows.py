"""Published-shape rows end to end: read by the real loader, run on a real node with a scripted model, scored by
the handlers' EVAL. Search-R1 Parquet rows whose model answers in ``<answer>`` tags (as Search-R1's prompt asks),
a Bamboogle row (capitalised columns) and a DAPO-Math-17k row answered with DAPO's ``Answer:`` line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent.chat import ChatTokens
from prorl_cli.domains.datasets import load_instances
from prorl_cli.handlers.search_domain import SEARCH_R1_PROMPT as SEARCH_R1_TEMPLATE
from prorl_cli.testing.scripted_engine import calls_path_for
from tests.domains.conftest import ScriptedStack, turn
from tests.harness import need_module


def _search_r1_row(index: int, question: str, golden: list[str], *, keep_source_columns: bool) -> dict[str, Any]:
    """A row as Search-R1's scripts/data_process/nq_search.py writes it (FlashRAG's columns kept, or verl's only)."""
    row: dict[str, Any] = {
        "data_source": "nq", "prompt": [{"content": SEARCH_R1_TEMPLATE.replace("{question}", question), "role": "user"}],
        "ability": "fact-reasoning", "reward_model": {"ground_truth": {"target": golden}, "style": "rule"},
        "extra_info": {"index": index, "split": "test"},
    }
    if keep_source_columns:
        row = {"id": f"test_{index}", "question": question, "golden_answers": golden, "metadata": None, **row}
    return row


def test_search_r1_bamboogle_and_dapo_rows_score_their_gold_answers(stack: ScriptedStack, tmp_path: Path) -> None:
    need_module("bm25s", "domains")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    stack.add("SR1-full:", turn("", ("search", {"query": "penicillin discovered"})),
              "<think>The document says Alexander Fleming.</think>\n<answer> Alexander Fleming </answer>")
    stack.add("SR1-verl:", turn("", ("search", {"query": "creator of the Python programming language"})),
              "<think>Guido.</think><answer>Guido van Rossum</answer>")
    stack.add("SR1-wrong:", "<answer>Louis Pasteur</answer>")
    stack.add("BAMBOO:", turn("", ("search", {"query": "penicillin discovered"})), "\\boxed{\\text{Alexander Fleming}}")
    stack.add("DAPO: What is", "17 times 23 is 391.\n\nAnswer: 391")
    stack.start_model()

    search_r1 = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist([
        _search_r1_row(0, "SR1-full: who discovered penicillin?", ["Alexander Fleming"], keep_source_columns=True),
        _search_r1_row(1, "SR1-wrong: who discovered penicillin?", ["Alexander Fleming"], keep_source_columns=True),
    ]), search_r1)
    verl_only = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([
        _search_r1_row(7, "SR1-verl: who created python?", ["Guido van Rossum"], keep_source_columns=False)]), verl_only)
    bamboogle = tmp_path / "bamboogle.parquet"
    pq.write_table(pa.Table.from_pylist([{"Question": "BAMBOO: Who discovered penicillin?",
                                          "Answer": "Alexander Fleming"}]), bamboogle)
    dapo = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "math_dapo",
        "prompt": [{"content": "Solve the following math problem step by step. The last line of your response should "
                               "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
                               "problem.\n\nDAPO: What is $17 \\times 23$?\n\nRemember to put your answer on its own "
                               "line after \"Answer:\".", "role": "user"}],
        "ability": "MATH", "reward_model": {"ground_truth": "391", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "b1c2d3e4-0000-4000-8000-000000000001"}}]), dapo)

    searches = [*load_instances("search", search_r1), *load_instances("search", verl_only),
                *load_instances("search", bamboogle)]
    assert [i.get("id") for i in searches] == ["test_0", "test_1", 7, None]
    full, wrong, verl, bamboo = stack.run("search", searches)
    [math] = stack.run("math", load_instances("math", dapo))
    for result in (full, wrong, verl, bamboo, math):
        assert result.state == "done", result.error
    assert (full.reward, full.output["predicted"]) == (1.0, "Alexander Fleming")
    assert (verl.reward, verl.output["predicted"]) == (1.0, "Guido van Rossum")
    assert (wrong.reward, wrong.output["predicted"]) == (0.0, "Louis Pasteur")
    assert (bamboo.reward, bamboo.output["predicted"]) == (1.0, "Alexander Fleming")
    assert (math.reward, math.output["predicted"]) == (1.0, "391")


def test_a_rows_own_prompt_reaches_the_model_as_written(stack: ScriptedStack, tmp_path: Path) -> None:
    """A row whose prompt is not Search-R1's template (a translation, with a system message) is what the model is
    prompted with under tool_format search_r1: the ids the engine received decode to the chat template over the
    row's own messages, and the default template's words are nowhere in them."""
    need_module("bm25s", "domains")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    own = [{"role": "system", "content": "Tu réponds en français."},
           {"role": "user", "content": "Raisonne dans <think> </think>, cherche avec <search> requête </search> et "
                                       "réponds dans <answer> </answer>. SR1-own: qui a découvert la pénicilline ?"}]
    stack.add("SR1-own:", "<think>Fleming.</think>\n<answer> Alexander Fleming </answer>")
    stack.start_model()
    path = tmp_path / "fr.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "nq_fr", "prompt": own, "ability": "fact-reasoning",
        "reward_model": {"ground_truth": {"target": ["Alexander Fleming"]}, "style": "rule"},
        "extra_info": {"index": 11, "split": "test"}}]), path)
    [instance] = load_instances("search", path)
    assert instance["prompt"] == own
    [result] = stack.run("search", [{**instance, "settings": {"tool_format": "search_r1"}}])
    assert result.state == "done", result.error
    assert (result.reward, result.output["predicted"]) == (1.0, "Alexander Fleming")
    [call] = result.output["trajectory"]["calls"]
    chat = ChatTokens.from_pretrained(stack.tiny_model)
    sent = [json.loads(line)["prompt_ids"] for line in calls_path_for(stack.script_path).read_text().splitlines()]
    assert call["prompt_ids"] in sent  # what the engine was sent, not only what the node recorded
    prompt = chat.decode(call["prompt_ids"])
    assert prompt == chat.tokenizer.apply_chat_template(own, tokenize=False, add_generation_prompt=True)
    assert "Answer the given question" not in prompt and "<tools>" not in prompt


def test_the_default_format_says_once_that_rows_search_r1_prompts_go_unused(stack: ScriptedStack) -> None:
    """Under hermes a row's Search-R1 prompt (asking for <search> tags this format does not read) is not used; the
    node says so once, naming the setting that would use it."""
    need_module("bm25s", "domains")
    stack.add("SR1-unused", "\\boxed{Alexander Fleming}")
    stack.start_model()
    row = _search_r1_row(21, "SR1-unused: who discovered penicillin?", ["Alexander Fleming"], keep_source_columns=False)
    jobs = [{"prompt": row["prompt"], "question": f"SR1-unused {n}: who discovered penicillin?",
             "answers": ["Alexander Fleming"]} for n in range(2)]
    for result in stack.run("search", jobs):
        assert (result.state, result.reward) == ("done", 1.0), result.error
        assert "<tools>" in ChatTokens.from_pretrained(stack.tiny_model).decode(
            result.output["trajectory"]["calls"][0]["prompt_ids"])  # the task's own prompt and tools
    log = (stack.d.logs / "n1.log").read_text()
    assert log.count("carries its own prompt asking for Search-R1's <search>/<answer> tags") == 1, log[-3000:]
    assert "Set tool_format: search_r1" in log
