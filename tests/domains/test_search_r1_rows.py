"""Published-shape rows end to end: read by the real loader, run on a real node with a scripted model, scored by
the handlers' EVAL. Search-R1 Parquet rows whose model answers in ``<answer>`` tags (as Search-R1's prompt asks),
a Bamboogle row (capitalised columns) and a DAPO-Math-17k row answered with DAPO's ``Answer:`` line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prorl_cli.domains.datasets import load_instances
from prorl_cli.handlers.search_domain import SEARCH_R1_PROMPT as SEARCH_R1_TEMPLATE
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
