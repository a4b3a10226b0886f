"""All four domains on one node at once, jobs interleaved; the search index is built once per node."""

from __future__ import annotations

import json
from pathlib import Path

from prorl_cli.domains.tinyrepo import make_tinyrepo
from tests.domains.conftest import ScriptedStack, turn
from tests.harness import need_module


def test_four_domains_interleaved_on_one_node(stack: ScriptedStack, tmp_path: Path, domain_image: str) -> None:
    need_module("bm25s", "domains")
    need_module("swebench", "swe")
    repo = make_tinyrepo(tmp_path / "tinycalc")
    stack.add("Q-found: Who created", turn("", ("search", {"query": "creator of the Python programming language", "k": 3})),
              turn("", ("open", {"doc_id": "python"})), "It was \\boxed{Guido van Rossum}.")
    stack.add("Q-found: Who discovered", turn("", ("search", {"query": "penicillin discovered"})), "\\boxed{Alexander Fleming}")
    stack.add("Q-partial", turn("", ("search", {"query": "Eiffel Tower structure designed"})), "\\boxed{Gustave Koechlin}")
    stack.add("Q-bad", turn("", ("open", {"doc_id": "no-such-doc"})), "<tool_call>[1, 2]</tool_call>", "\\boxed{Canberra}")
    stack.add("M-right", "\\boxed{391}")
    stack.add("K-right", "```python\nprint(sum(map(int, input().split())))\n```")
    stack.add("[W-fix]", turn("", ("editor", {"command": "str_replace", "path": "/testbed/tinycalc/stats.py",
                                               "old_str": "(len(xs) - 1)", "new_str": "len(xs)"})), "Done.")
    stack.start_model()
    swe = {**repo.instance, "problem_statement": f"[W-fix] {repo.instance['problem_statement']}", "repo_path": str(repo.path)}
    client = stack.d.client
    jobs = [
        ("search", {"question": "Q-found: Who created the Python programming language?", "answers": ["Guido van Rossum"]}),
        ("math", {"problem": "M-right: 17 * 23", "answer": "391"}),
        ("search", {"question": "Q-found: Who discovered penicillin?", "answer": "Alexander Fleming"}),
        ("code", {"question": "K-right: sum", "tests": [{"input": "1 2\n", "output": "3\n"}]}),
        ("swe", swe),
        ("search", {"question": "Q-partial: Who designed the Eiffel Tower's structure?", "answers": ["Maurice Koechlin"]}),
        ("search", {"question": "Q-bad: What is the capital of Australia?", "answers": ["Canberra"]}),
    ]
    ids = [client.submit(task, [inst], timeout_s=200)[0] for task, inst in jobs]  # interleaved, one by one
    results = {r.job_id: r for r in client.wait(ids, timeout_s=300)}
    found, math, found2, code, swe_result, partial, bad = (results[i] for i in ids)
    assert all(r.state == "done" for r in results.values()), [r.error for r in results.values()]
    assert (math.reward, code.reward, swe_result.reward) == (1.0, 1.0, 1.0), (math.output, code.output, swe_result.output)

    assert found.reward == 1.0 and found2.reward == 1.0 and found.output["f1"] == 1.0
    first_search = found.output["trajectory"]["messages"][3]["content"]
    assert json.loads(first_search.splitlines()[0])["id"] == "python"  # BM25 ranked the right document first
    opened = found.output["trajectory"]["messages"][5]["content"]
    assert opened.startswith("Python (programming language)") and "Guido van Rossum" in opened
    assert partial.reward == 0.0 and 0.0 < partial.output["f1"] < 1.0  # "Gustave Koechlin" vs "Maurice Koechlin"
    bad_tools = [m["content"] for m in bad.output["trajectory"]["messages"] if m["role"] == "tool"]
    assert bad_tools[0].startswith("error: DomainError: open: no document 'no-such-doc'")
    assert bad_tools[1].startswith("error: tool call must be a JSON object")
    assert bad.reward == 1.0

    # One index for the node, however many search jobs ran on it (an earlier test on the shared node may have
    # built it: then none of these did).
    searches = [found, found2, partial, bad]
    assert {r.output["index"]["builds_on_node"] for r in searches} == {1}
    assert sum(r.output["index"]["built_by_this_job"] for r in searches) <= 1
    assert {r.output["index"]["docs"] for r in searches} == {40}
