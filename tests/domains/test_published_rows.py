"""Rows as their sources publish them that the loaders used to refuse unclearly or read wrongly: PrimeIntellect's
verifiable-coding-problems (``verification_info``) and open-r1's copy of it, HumanEval / MBPP / KodCode rows
(assertion tests, refused naming the field), PopQA (``possible_answers`` as JSON text) and search questions that
are not text; and right answers the math grader scored 0 (option-letter lists, digit groups set off by ``\\,``)."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.config import ProrlConfig
from prorl_cli.domains.code_judge import RUNNER, classify, runner_spec
from prorl_cli.domains.code_judge import TestCase as JudgeCase  # not collected as a test class
from prorl_cli.domains.datasets import load_instances
from prorl_cli.exceptions import DatasetError
from prorl_cli.handlers.math_domain import MathHandler
from prorl_cli.node.handler import JobContext, Services
from prorl_cli.protocol import JobSpec

SUM_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def _jsonl(path: Path, rows: Sequence[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _verdicts(program: str, tests: list[dict[str, str]], tmp_path: Path) -> list[str]:
    """The judge runner's verdict of ``program`` on each test, run here as EVAL runs it in a sandbox."""
    (tmp_path / "solution.py").write_text(program)
    out = []
    for t in tests:
        case = JudgeCase(t["input"], t["output"])
        (tmp_path / "input.txt").write_text(case.input)
        spec = runner_spec(case, time_limit_s=30.0, mem_mb=512, workdir=str(tmp_path),
                           command=[sys.executable, str(tmp_path / "solution.py")])
        (tmp_path / "judge.json").write_text(json.dumps(spec))
        subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "judge.json")], check=True, timeout=120)
        out.append(classify(json.loads((tmp_path / "report.json").read_text()), case.output)[0])
    return out


# PrimeIntellect/verifiable-coding-problems: verification_info and metadata are JSON text.
PRIME_ROW = {
    "source": "codeforces", "task_type": "verifiable_code", "in_source_id": "1_A",
    "prompt": "Solve the following coding problem using the programming language python:\n\nRead two integers a and b "
              "and print a + b.",
    "gold_standard_solution": "```python\n" + SUM_PROGRAM + "```",
    "verification_info": json.dumps({"language": "python", "test_cases": [
        {"fn_name": None, "input": "1 2\n", "output": "3\n", "type": "stdin_stdout"},
        {"fn_name": None, "input": "40 2\n", "output": "42\n", "type": "stdin_stdout"}]}),
    "metadata": json.dumps({"difficulty": "7", "memory_limit": None, "memory_limit_bytes": None, "problem_url": None,
                            "time_limit": "1 second"}),
    "problem_id": "vfc_0_a1b2c3",
}


def test_verifiable_coding_problems_rows_load_and_grade(tmp_path: Path) -> None:
    [instance] = load_instances("code", _jsonl(tmp_path / "prime.jsonl", [PRIME_ROW]))
    assert instance["question"] == PRIME_ROW["prompt"]
    assert instance["id"] == "vfc_0_a1b2c3"
    assert instance["tests"] == [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42\n"}]
    assert _verdicts(SUM_PROGRAM, instance["tests"], tmp_path) == ["AC", "AC"]  # the gold solution: reward 1
    assert _verdicts("print(3)\n", instance["tests"], tmp_path) == ["AC", "WA"]  # a wrong one: reward 0
    with_format = load_instances("code", tmp_path / "prime.jsonl", "verification_info")
    assert with_format == [instance]


def test_open_r1_copy_with_struct_columns_in_parquet(tmp_path: Path) -> None:
    # open-r1/verifiable-coding-problems-python: the same rows, the statement as problem_statement and
    # verification_info / metadata as structs.
    row = {
        "source": "codeforces", "task_type": "verifiable_code", "in_source_id": "1_A",
        "problem_statement": "Read two integers a and b and print a + b.",
        "gold_standard_solution": "```python\n" + SUM_PROGRAM + "```", "problem_id": "vfc_0_a1b2c3",
        "metadata": {"difficulty": "7", "memory_limit": None, "memory_limit_bytes": None, "problem_url": None,
                     "time_limit": "1 second"},
        "verification_info": {"language": "python", "test_cases": [
            {"fn_name": None, "input": "1 2\n", "output": "3\n", "type": "stdin_stdout"}]},
    }
    [instance] = load_instances("code", _parquet(tmp_path / "train-00000-of-00001.parquet", [row]))
    assert instance == {"question": "Read two integers a and b and print a + b.",
                        "tests": [{"input": "1 2\n", "output": "3\n"}], "id": "vfc_0_a1b2c3"}


def test_verifiable_coding_problems_function_call_rows_are_refused(tmp_path: Path) -> None:
    row = {**PRIME_ROW, "verification_info": json.dumps({"language": "python", "test_cases": [
        {"fn_name": "add", "input": "[1, 2]", "output": "3", "type": "function_call"}]})}
    with pytest.raises(DatasetError, match=r"prime.jsonl:1: verification_info.test_cases has function-call tests only"):
        load_instances("code", _jsonl(tmp_path / "prime.jsonl", [row]))


HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "prompt": "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
              "    \"\"\" Check if in given list of numbers, are any two numbers closer to each other than\n"
              "    given threshold.\n    \"\"\"\n",
    "canonical_solution": "    for idx, elem in enumerate(numbers):\n        for idx2, elem2 in enumerate(numbers):\n"
                          "            if idx != idx2:\n                distance = abs(elem - elem2)\n"
                          "                if distance < threshold:\n                    return True\n\n"
                          "    return False\n",
    "test": "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\ndef check(candidate):\n"
            "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n",
    "entry_point": "has_close_elements",
}
MBPP_SANITIZED_ROW = {
    "source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 2,
    "prompt": "Write a function to find the shared elements from the given two lists.",
    "code": "def similar_elements(test_tup1, test_tup2):\n  res = tuple(set(test_tup1) & set(test_tup2))\n  return (res) ",
    "test_imports": [],
    "test_list": ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))"],
}
MBPP_FULL_ROW = {
    "task_id": 2, "text": "Write a function to find the similar elements from the given two tuple lists.",
    "code": "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n  return (res) ",
    "test_list": ["assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)"],
    "test_setup_code": "", "challenge_test_list": [],
}


@pytest.mark.parametrize(("row", "field", "source"), [
    (HUMANEVAL_ROW, "test", "HumanEval"),
    (MBPP_SANITIZED_ROW, "test_list", "MBPP"),
    (MBPP_FULL_ROW, "test_list", "MBPP"),
])
def test_assertion_test_rows_are_refused_naming_their_field(tmp_path: Path, row: dict[str, Any], field: str,
                                                            source: str) -> None:
    with pytest.raises(DatasetError) as raised:
        load_instances("code", _jsonl(tmp_path / "rows.jsonl", [row]))
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'rows.jsonl'}:1: field {field!r} holds assertion tests"), message
    assert source in message and "stdin/stdout programs only" in message


POPQA_ROW = {
    "id": 4222362, "subj": "George Rankin", "prop": "occupation", "obj": "politician", "subj_id": 1850297,
    "prop_id": 22, "obj_id": 2834605, "s_aliases": "[\"George James Rankin\"]",
    "o_aliases": "[\"political leader\",\"political figure\",\"polit.\",\"pol\"]",
    "s_uri": "http://www.wikidata.org/entity/Q5543720", "o_uri": "http://www.wikidata.org/entity/Q82955",
    "s_wiki_title": "George Rankin", "o_wiki_title": "Politician", "s_pop": 142, "o_pop": 25692,
    "question": "What is George Rankin's occupation?",
    "possible_answers": "[\"politician\", \"political leader\", \"political figure\", \"polit.\", \"pol\"]",
}


def test_popqa_possible_answers_are_the_gold_answers(tmp_path: Path) -> None:
    [instance] = load_instances("search", _parquet(tmp_path / "popqa.parquet", [POPQA_ROW]))
    assert instance == {"question": "What is George Rankin's occupation?", "id": 4222362,
                        "answers": ["politician", "political leader", "political figure", "polit.", "pol"]}


def test_a_search_question_that_is_not_text_is_refused(tmp_path: Path) -> None:
    # A structured question ({text, tokens}, as tokenised QA releases keep it) must not reach the model as a repr.
    row = {"question": {"text": "who founded google", "tokens": ["who", "founded", "google"]},
           "answers": ["Larry Page"]}
    with pytest.raises(DatasetError, match=r"nq.jsonl:1: field 'question' is a mapping, expected the question text"):
        load_instances("search", _jsonl(tmp_path / "nq.jsonl", [row]))


def _math_reward(instance: dict[str, Any], final_turn: str, tmp_path: Path) -> float | None:
    """The math handler's EVAL on a trajectory whose last turn (no tool call) is ``final_turn``."""
    handler = MathHandler()
    ctx = JobContext(spec=JobSpec(job_id="j", task="math"), instance=instance, node_id="n", run_dir=tmp_path,
                     config=ProrlConfig(), services=Services(), log=logging.getLogger("test"), handler=handler)
    ctx.trajectory = Trajectory(calls=[ModelCall(prompt_ids=[1], output_ids=[2], logprobs=[0.0], finish_reason="stop",
                                                 text=final_turn)], stop_reason="stop")
    asyncio.run(handler.eval(ctx))
    return ctx.reward


@pytest.mark.parametrize(("final_turn", "reward"), [
    ("The invertible ones are $\\boxed{\\text{A, D}}$.", 1.0),
    ("The invertible ones are $\\boxed{A, D}$.", 1.0),          # the letters without \\text{}
    ("The invertible ones are $\\boxed{A,D}$.", 1.0),
    ("The invertible ones are $\\boxed{(A), (D)}$.", 1.0),
    ("The invertible ones are $\\boxed{A, C}$.", 0.0),
    ("The invertible ones are $\\boxed{A}$.", 0.0),
])
def test_option_letter_answers_score_by_their_letters(tmp_path: Path, final_turn: str, reward: float) -> None:
    pytest.importorskip("math_verify")
    # MATH-500's fields and types (level an int); its "enter the letters ..., separated by commas" answers are
    # \\text{} lists of letters.
    row = {"problem": "Which of the functions A-D have inverses? Enter the letters of the functions that have "
                      "inverses, separated by commas.",
           "solution": "Only A and D pass the horizontal line test, so the answer is $\\boxed{\\text{A, D}}.$",
           "answer": "\\text{A, D}", "subject": "Intermediate Algebra", "level": 2,
           "unique_id": "test/intermediate_algebra/0.json"}
    [instance] = load_instances("math", _jsonl(tmp_path / "math500.jsonl", [row]))
    assert _math_reward(instance, final_turn, tmp_path) == reward



def test_an_ordered_pair_of_letters_is_not_a_list_of_options() -> None:
    pytest.importorskip("math_verify")
    from prorl_cli.domains.answers import math_equal

    assert not math_equal("(A, B)", "(B, A)").correct
    assert math_equal("(A, B)", "(A,B)").correct


@pytest.mark.parametrize(("final_turn", "reward"), [
    ("\\boxed{10\\,000}", 1.0),        # LaTeX's thin space between digit groups: math-verify read it as 10*000
    ("\\boxed{10\\ 000}", 1.0),
    ("\\boxed{10000}", 1.0),
    ("\\boxed{10\\,001}", 0.0),
    ("\\boxed{1\\,000}", 0.0),
])
def test_digit_groups_set_off_by_a_latex_space(tmp_path: Path, final_turn: str, reward: float) -> None:
    pytest.importorskip("math_verify")
    row = {"problem": "How many positive integers are at most 10000?", "answer": "10000",
           "solution": "Each of $1, 2, \\ldots, 10000$ counts once: $\\boxed{10000}$."}  # DeepScaleR's fields
    [instance] = load_instances("math", _jsonl(tmp_path / "deepscaler.jsonl", [row]))
    assert _math_reward(instance, final_turn, tmp_path) == reward
