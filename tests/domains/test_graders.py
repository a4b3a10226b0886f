"""Graders and loaders on dataset rows exactly as their sources publish them (GSM8K, DAPO-Math-17k, AIME,
APPS/TACO, LiveCodeBench, CodeContests, DeepCoder, Eurus, TriviaQA, MuSiQue, FlashRAG corpora) and answers as
models write them: a right answer scores 1, a wrong one 0, and a row's fields are read as the source means."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import pickle
import subprocess
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.config import ProrlConfig
from prorl_cli.domains.answers import math_equal_bounded
from prorl_cli.domains.code_judge import RUNNER, classify, runner_spec
from prorl_cli.domains.code_judge import TestCase as JudgeCase  # not collected as a test class
from prorl_cli.domains.datasets import load_instances
from prorl_cli.domains.search_index import Document, SearchIndex, read_corpus
from prorl_cli.exceptions import DatasetError
from prorl_cli.handlers.code_domain import last_python_block
from prorl_cli.handlers.math_agent import MathAgentHandler
from prorl_cli.handlers.math_domain import MathHandler
from prorl_cli.handlers.search_domain import SearchHandler
from prorl_cli.node.handler import AgentHandler, JobContext, Services
from prorl_cli.protocol import JobSpec

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def _jsonl(path: Path, rows: Sequence[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eval(handler: AgentHandler, instance: dict[str, Any], final_turn: str, tmp_path: Path) -> JobContext:
    """The handler's EVAL on a trajectory whose last turn (no tool call) is ``final_turn``."""
    ctx = JobContext(spec=JobSpec(job_id="j", task=handler.name), instance=instance, node_id="n", run_dir=tmp_path,
                     config=ProrlConfig(), services=Services(), log=logging.getLogger("test"), handler=handler)
    ctx.trajectory = Trajectory(calls=[ModelCall(prompt_ids=[1], output_ids=[2], logprobs=[0.0], finish_reason="stop",
                                                 text=final_turn)], stop_reason="stop")
    asyncio.run(handler.eval(ctx))
    return ctx


@pytest.mark.parametrize(("answer", "final_turn", "reward"), [
    (GSM8K_ANSWER, "She sold 72 clips.", 1.0),       # a GSM8K row as published: the gold is the number after ####
    (GSM8K_ANSWER, "She sold 24 clips.", 0.0),
    ("1000", "The total is 1,000.", 1.0),            # not its last group "000"
    ("1,000", "The total is 1000 dollars.", 1.0),
    ("18", "So she makes $18.00 every day.", 1.0),
    ("391", "17 * 23 = 391", 1.0),
    ("391", "17 * 23 = 392", 0.0),
])
def test_math_agent_scores_gsm8k_answers_and_thousands_separators(answer: str, final_turn: str, reward: float,
                                                                    tmp_path: Path) -> None:
    ctx = _eval(MathAgentHandler(), {"question": "q", "answer": answer}, final_turn, tmp_path)
    assert ctx.reward == reward, (answer, final_turn, ctx.output)


@pytest.mark.parametrize(("final_turn", "reward"), [
    ("\\boxed{\\text{Maurice Koechlin}}", 1.0),
    ("It was \\boxed{\\textbf{\\text{Maurice~Koechlin}}}.", 1.0),
    ("\\boxed{\\mathrm{Maurice\\ Koechlin}}", 1.0),
    ("\\boxed{\\text{Gustave Eiffel}}", 0.0),
    ("Maurice Koechlin", 1.0),
])
def test_search_scores_a_boxed_text_answer_by_its_words(final_turn: str, reward: float, tmp_path: Path) -> None:
    ctx = _eval(SearchHandler(), {"question": "q", "answers": ["Maurice Koechlin"]}, final_turn, tmp_path)
    assert ctx.reward == reward, (final_turn, ctx.output)


def test_gsm8k_rows_load_with_the_number_after_the_marks(tmp_path: Path) -> None:
    rows = [{"question": "How many clips?", "answer": GSM8K_ANSWER},
            {"question": "How much?", "answer": "He paid 2*500=<<2*500=1000>>1000.\n#### 1,000"}]
    assert [i["answer"] for i in load_instances("math", _jsonl(tmp_path / "gsm8k.jsonl", rows))] == ["72", "1000"]


def test_apps_rows_with_line_lists_and_function_call_tests(tmp_path: Path) -> None:
    # APPS/TACO give some stdin tests as lists of lines; their own judge joins them.
    io = {"inputs": [["2", "1 2"], "3\n"], "outputs": [["3", "ok"], "4\n"]}
    (inst,) = load_instances("code", _jsonl(tmp_path / "apps.jsonl", [{"question": "q", "input_output": json.dumps(io)}]))
    assert inst["tests"] == [{"input": "2\n1 2", "output": "3\nok"}, {"input": "3\n", "output": "4\n"}]
    with pytest.raises(DatasetError, match=r"empty\.jsonl:1: input_output is empty: the row has no tests"):
        load_instances("code", _jsonl(tmp_path / "empty.jsonl", [{"question": "q", "input_output": ""}]))
    calls = {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}
    with pytest.raises(DatasetError, match=r"calls\.jsonl:1: .*function-call tests \(fn_name 'add'\)"):
        load_instances("code", _jsonl(tmp_path / "calls.jsonl", [{"question": "q", "input_output": json.dumps(calls)}]))


def test_livecodebench_lite_compressed_private_tests(tmp_path: Path) -> None:
    private = [{"input": "5\n", "output": "25\n", "testtype": "stdin"}]
    packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    row = {"question_content": "square it", "public_test_cases": json.dumps([{"input": "2\n", "output": "4\n",
                                                                             "testtype": "stdin"}]),
           "private_test_cases": packed}
    (inst,) = load_instances("code", _jsonl(tmp_path / "lcb.jsonl", [row]))
    assert inst["tests"] == [{"input": "2\n", "output": "4\n"}, {"input": "5\n", "output": "25\n"}]

    class Code:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (print, ("ran",))

    row["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(Code()))).decode()
    with pytest.raises(DatasetError, match="lcb2.jsonl:1: field 'private_test_cases' .*refused builtins.print"):
        load_instances("code", _jsonl(tmp_path / "lcb2.jsonl", [row]))


def test_codecontests_rows(tmp_path: Path) -> None:
    row = {"name": "1_A", "description": "add", "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
           "private_tests": {"input": ["2 2\n"], "output": ["4\n"]}, "generated_tests": {"input": [], "output": []}}
    (inst,) = load_instances("code", _jsonl(tmp_path / "cc.jsonl", [row]))
    assert inst == {"question": "add", "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2\n", "output": "4\n"}],
                    "id": "1_A"}  # CodeContests' problem name is its id


def test_triviaqa_and_musique_answer_aliases(tmp_path: Path) -> None:
    row = {"question": "Which city?", "answer": {"value": "Paris", "aliases": ["Paris", "City of Light"],
                                                 "normalized_value": "paris"}}
    (inst,) = load_instances("search", _jsonl(tmp_path / "tqa.jsonl", [row]))
    assert inst["answers"] == ["Paris", "City of Light"]
    musique = {"id": "2hop_1", "question": "Who founded it?", "answer": "IBM", "answer_aliases": ["International Business Machines"],
               "answerable": True}
    (inst,) = load_instances("search", _jsonl(tmp_path / "musique.jsonl", [musique]))
    assert inst["answers"] == ["IBM", "International Business Machines"]


def test_verl_style_math_rows_dapo_and_gsm8k(tmp_path: Path) -> None:
    prompt = ("Solve the following math problem step by step. The last line of your response should be of the form "
              "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
              "What is $6 \\times 7$?\n\nRemember to put your answer on its own line after \"Answer:\".")
    rows = [{"data_source": "math_dapo", "prompt": [{"content": prompt, "role": "user"}], "ability": "MATH",
             "reward_model": {"ground_truth": "42", "style": "rule-lean"}, "extra_info": {"index": "a"}},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
             "reward_model": {"ground_truth": ["2"], "style": "rule"}},
            {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "How many clips? Let's think step "
                                                        "by step and output the final answer after \"####\"."}],
             "reward_model": {"ground_truth": "72", "style": "rule"}}]
    assert load_instances("math", _jsonl(tmp_path / "dapo.jsonl", rows)) == [
        {"problem": "What is $6 \\times 7$?", "answer": "42", "id": "a"}, {"problem": "1+1?", "answer": "2"},
        {"problem": "How many clips?", "answer": "72"}]


@pytest.mark.parametrize(("final_turn", "solution"), [
    # The closing fence of a bash block is not the opening of a bare one (that read "Then:" as the program).
    ("Run it:\n```bash\npython3 solution.py\n```\nThen:\n```python\nprint(1)\n```", "print(1)\n"),
    ("```python3\nprint(2)\n```", "print(2)\n"),
    ("```Python\nprint(3)\n```\nDone.", "print(3)\n"),
    ("```\nprint(4)\n```", "print(4)\n"),
    ("```bash\nls\n```", None),
])
def test_code_solution_from_the_final_message(final_turn: str, solution: str | None) -> None:
    assert last_python_block(final_turn) == solution


def test_a_right_answer_longer_than_a_mebibyte_is_accepted(tmp_path: Path) -> None:
    """The runner kept the first 1 MiB of output whatever the test expected: a right answer of 2 MB was WA."""
    program = tmp_path / "solution.py"
    program.write_text("n = int(input())\nprint('\\n'.join(str(i) for i in range(n)))\n")
    (tmp_path / "input.txt").write_text("300000\n")
    test = JudgeCase("300000\n", "\n".join(str(i) for i in range(300000)) + "\n")
    assert len(test.output) > 1 << 20
    spec = runner_spec(test, time_limit_s=30.0, mem_mb=512, workdir=str(tmp_path),
                       command=[sys.executable, str(program)])
    (tmp_path / "judge.json").write_text(json.dumps(spec))
    subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "judge.json")], check=True, timeout=120)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "exited", {**report, "stdout": "..."}
    assert classify(report, test.output) == ("AC", "")


def test_aime_rows_with_capitalised_fields(tmp_path: Path) -> None:
    rows = [{"ID": "2024-I-1", "Problem": "Every morning Aya walks...", "Solution": "... so $\\boxed{204}$.",
             "Answer": 204}]
    assert load_instances("math", _jsonl(tmp_path / "aime.jsonl", rows)) == [
        {"problem": "Every morning Aya walks...", "answer": "204", "id": "2024-I-1"}]


def test_a_tower_of_powers_is_judged_within_its_limit(tmp_path: Path) -> None:
    """sympy evaluates 9^{9^{9}} eagerly (hundreds of millions of digits): in the EVAL thread it ran for
    minutes past the stage limit, holding CPU and memory. It is judged in a child process killed at its limit."""
    pytest.importorskip("sympy")
    assert math_equal_bounded("5", "9^{9^{9}}", timeout_s=3.0).method == "timeout"
    tower = _eval(MathHandler(), {"problem": "p", "answer": "5", "settings": {"eval_timeout_s": 3.0}},
                  "So \\boxed{9^{9^{9}}}", tmp_path)
    assert tower.reward == 0.0 and tower.output["verdict"]["method"] == "timeout", tower.output
    small = _eval(MathHandler(), {"problem": "p", "answer": "256"}, "So \\boxed{2^{2^{3}}}", tmp_path)
    assert small.reward == 1.0 and small.output["verdict"]["correct"], small.output


@pytest.mark.parametrize(("stdout", "expected", "verdict"), [
    ("0.3333333333\n", "0.333333333\n", "AC"),           # more digits than the reference printed
    ("2.5 1\n", "2.500000 1\n", "AC"),
    ("1e-07\n", "0.000000\n", "AC"),
    ("0.33\n", "0.333333\n", "WA"),                       # outside 1e-6
    ("1.0\n", "1\n", "WA"),                               # an integer answer is matched exactly
    ("nan\n", "0.5\n", "WA"),
    ("YES\n", "yes\n", "WA"),
])
def test_real_numbers_in_the_output_within_the_checkers_tolerance(stdout: str, expected: str, verdict: str) -> None:
    report = {"status": "exited", "exit_code": 0, "signal": None, "time_s": 0.1, "stdout": stdout, "stderr": ""}
    assert classify(report, expected)[0] == verdict


def test_verl_style_code_rows(tmp_path: Path) -> None:
    row = {"data_source": "taco", "ability": "code",
           "prompt": [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "Add two numbers."}],
           "reward_model": {"style": "rule", "ground_truth": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})}}
    (inst,) = load_instances("code", _jsonl(tmp_path / "eurus.jsonl", [row]))
    assert inst == {"question": "Add two numbers.", "tests": [{"input": "1 2\n", "output": "3\n"}]}


def test_tests_as_json_text(tmp_path: Path) -> None:
    """DeepCoder ships ``tests`` as JSON text; the loader said the row had no 'tests'."""
    rows = [{"problem": "add", "tests": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
                                                   {"input": "f(1)", "output": "2", "testtype": "functional"}])},
            {"problem": "add", "tests": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})}]
    assert [i["tests"] for i in load_instances("code", _jsonl(tmp_path / "dc.jsonl", rows))] == [
        [{"input": "1 2\n", "output": "3\n"}]] * 2


def test_a_flashrag_corpus(tmp_path: Path) -> None:
    """FlashRAG / Search-R1 corpora are {id, contents} with the quoted title on the first line."""
    corpus = _jsonl(tmp_path / "wiki.jsonl", [
        {"id": "0", "contents": "\"Eiffel Tower\"\nMaurice Koechlin and Emile Nouguier designed its structure."},
        {"id": "1", "contents": "\"Louvre\"\nThe Louvre is the world's most-visited museum."}])
    docs = read_corpus(corpus)
    assert docs[0] == Document("0", "Eiffel Tower", "Maurice Koechlin and Emile Nouguier designed its structure.")
    pytest.importorskip("bm25s")
    assert SearchIndex(docs, str(corpus)).search("who designed the structure", k=1)[0].doc_id == "0"


@pytest.mark.parametrize(("final_turn", "reward"), [("So \\boxed{72}.", 1.0), ("So \\boxed{24}.", 0.0)])
def test_math_scores_a_gsm8k_row_given_as_published(final_turn: str, reward: float, tmp_path: Path) -> None:
    """The gold is the number after ####, also where a row reaches the handler without the loader (and the
    sympy fallback, which cannot read the worked solution, judges)."""
    ctx = _eval(MathHandler(), {"problem": "p", "answer": GSM8K_ANSWER}, final_turn, tmp_path)
    assert ctx.reward == reward, ctx.output
