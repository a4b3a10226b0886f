"""Rows as their sources publish them that the loaders used to refuse unclearly or read wrongly: PrimeIntellect's
verifiable-coding-problems (``verification_info``) and open-r1's copy of it, HumanEval / MBPP / KodCode rows
(assertion tests, refused naming the field), PopQA (``possible_answers`` as JSON text) and search questions that
are not text; and right answers the math grader scored 0 (option-letter lists, digit groups set off by ``\\,``).
Search-R1 / FlashRAG / Bamboogle rows and the answer formats their prompts ask for (``<answer>`` tags; DAPO's
``Answer:`` line, GSM8K's ``####``) are scored through the real loader and the real handlers' EVAL."""

from __future__ import annotations

import asyncio
import json
import logging
import re
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
from prorl_cli.exceptions import DatasetError, DomainError
from prorl_cli.handlers.math_domain import MathHandler
from prorl_cli.handlers.search_domain import SEARCH_R1_PROMPT as SEARCH_R1_TEMPLATE
from prorl_cli.handlers.search_domain import SearchHandler, search_r1_messages
from prorl_cli.node.handler import AgentHandler, JobContext, Services
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


def _reward(handler: AgentHandler, instance: dict[str, Any], final_turn: str, tmp_path: Path) -> float | None:
    """``handler``'s EVAL on a trajectory whose last turn (no tool call) is ``final_turn``."""
    ctx = JobContext(spec=JobSpec(job_id="j", task=handler.name), instance=instance, node_id="n", run_dir=tmp_path,
                     config=ProrlConfig(), services=Services(), log=logging.getLogger("test"), handler=handler)
    ctx.trajectory = Trajectory(calls=[ModelCall(prompt_ids=[1], output_ids=[2], logprobs=[0.0], finish_reason="stop",
                                                 text=final_turn)], stop_reason="stop")
    asyncio.run(handler.eval(ctx))
    return ctx.reward


def _math_reward(instance: dict[str, Any], final_turn: str, tmp_path: Path) -> float | None:
    """The math handler's EVAL on a trajectory whose last turn (no tool call) is ``final_turn``."""
    return _reward(MathHandler(), instance, final_turn, tmp_path)


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


# --- search: Search-R1, FlashRAG, Bamboogle ------------------------------------------------------------------

# Search-R1's scripts/data_process/nq_search.py: FlashRAG's nq row (id, question, golden_answers) mapped by
# datasets' map, which keeps the source columns and adds verl's; its prompt asks for <answer> tags.
SEARCH_R1_PROMPT = SEARCH_R1_TEMPLATE.replace("{question}", "who got the first nobel prize in physics?")
SEARCH_R1_ROW: dict[str, Any] = {
    "id": "test_0", "question": "who got the first nobel prize in physics?",
    "golden_answers": ["Wilhelm Conrad Röntgen"], "data_source": "nq",
    "prompt": [{"content": SEARCH_R1_PROMPT, "role": "user"}], "ability": "fact-reasoning",
    "reward_model": {"ground_truth": {"target": ["Wilhelm Conrad Röntgen"]}, "style": "rule"},
    "extra_info": {"index": 0, "split": "test"},
}


@pytest.mark.parametrize(("final_turn", "reward"), [
    ("<think>The first Nobel prize in physics went to Röntgen.</think>\n<answer> Wilhelm Conrad Röntgen </answer>", 1.0),
    ("<answer>Wilhelm Conrad Röntgen</answer>", 1.0),
    ("<answer>Lorentz</answer> no, <answer>Wilhelm Conrad Röntgen</answer>", 1.0),    # the last pair
    ("<answer>Wilhelm Conrad Röntgen</answer> no, <answer>Lorentz</answer>", 0.0),
    ("<answer>\\boxed{\\text{Wilhelm Conrad Röntgen}}</answer>", 1.0),
    ("\\boxed{Lorentz} on reflection: <answer>Wilhelm Conrad Röntgen</answer>", 1.0),  # the later answer counts
    ("<answer>Lorentz</answer> on reflection: \\boxed{Wilhelm Conrad Röntgen}", 1.0),
    ("\\boxed{Wilhelm Conrad Röntgen}", 1.0),                                            # \\boxed{} still read
    ("<answer>Hendrik Lorentz</answer>", 0.0),
    ("<answer></answer>", 0.0),
])
def test_search_r1_rows_score_their_answer_tags(tmp_path: Path, final_turn: str, reward: float) -> None:
    [instance] = load_instances("search", _parquet(tmp_path / "test.parquet", [SEARCH_R1_ROW]))
    assert instance == {"question": "who got the first nobel prize in physics?", "id": "test_0",
                        "answers": ["Wilhelm Conrad Röntgen"], "prompt": SEARCH_R1_ROW["prompt"]}
    assert _reward(SearchHandler(), instance, final_turn, tmp_path) == reward


def test_search_r1_rows_with_only_verl_columns(tmp_path: Path) -> None:
    # Scripts that map with remove_columns keep verl's columns only: the question is the end of Search-R1's prompt,
    # the golden answers reward_model.ground_truth.target, the id extra_info.index.
    row = {k: SEARCH_R1_ROW[k] for k in ("data_source", "prompt", "ability", "reward_model", "extra_info")}
    [instance] = load_instances("search", _parquet(tmp_path / "train.parquet", [row]))
    assert instance == {"question": "who got the first nobel prize in physics?", "answers": ["Wilhelm Conrad Röntgen"],
                        "id": 0, "prompt": SEARCH_R1_ROW["prompt"]}
    assert _reward(SearchHandler(), instance, "<answer>Wilhelm Conrad Röntgen</answer>", tmp_path) == 1.0
    # A verl QA row of another recipe: its own prompt is the question, ground_truth the answers.
    other = {"prompt": [{"role": "user", "content": "Who wrote Hamlet?"}],
             "reward_model": {"ground_truth": ["William Shakespeare", "Shakespeare"], "style": "rule"}}
    [instance] = load_instances("search", _jsonl(tmp_path / "other.jsonl", [other]))
    assert instance == {"question": "Who wrote Hamlet?", "answers": ["William Shakespeare", "Shakespeare"],
                        "prompt": other["prompt"]}
    no_answers = {**row, "reward_model": {"style": "rule"}}
    with pytest.raises(DatasetError, match=r"none.jsonl:1: missing field 'answers' .*reward_model.ground_truth.target"):
        load_instances("search", _jsonl(tmp_path / "none.jsonl", [no_answers]))


def test_bamboogle_and_flashrag_rows_load_and_grade(tmp_path: Path) -> None:
    # chiayewken/bamboogle (the Hub copy of the paper's spreadsheet): capitalised 'Question' and 'Answer'.
    bamboogle = {"Question": "Who was president of the United States in the year that Citibank was founded?",
                 "Answer": "james madison"}
    [instance] = load_instances("search", _parquet(tmp_path / "test-00000-of-00001.parquet", [bamboogle]))
    assert instance == {"question": bamboogle["Question"], "answers": ["james madison"]}
    assert _reward(SearchHandler(), instance, "\\boxed{James Madison}", tmp_path) == 1.0
    assert _reward(SearchHandler(), instance, "<answer>Thomas Jefferson</answer>", tmp_path) == 0.0
    # FlashRAG_datasets JSONL: id, question, golden_answers, metadata.
    flashrag = {"id": "test_7", "question": "who sang i ran all the way home", "golden_answers": ["The Impalas"],
                "metadata": {}}
    [instance] = load_instances("search", _jsonl(tmp_path / "test.jsonl", [flashrag]))
    assert instance == {"question": "who sang i ran all the way home", "answers": ["The Impalas"], "id": "test_7"}
    assert _reward(SearchHandler(), instance, "<answer>the Impalas</answer>", tmp_path) == 1.0


def test_a_search_rows_chat_prompt_is_kept_as_written(tmp_path: Path) -> None:
    # Another template than Search-R1's, a system message beside it, and a key only one message has: a Parquet
    # struct column gives every message that key (null where it has none); the instance keeps role and content.
    prompt = [{"role": "system", "content": "Réponds en français.", "name": None},
              {"role": "user", "content": "Cherche avec <search> q </search>, réponds avec <answer> a </answer>.\n"
                                          "Question : qui a découvert la pénicilline ?", "name": "asker"}]
    row = {"prompt": prompt, "reward_model": {"ground_truth": {"target": ["Alexander Fleming"]}}, "extra_info": {"index": 3}}
    [instance] = load_instances("search", _parquet(tmp_path / "fr.parquet", [row]))
    assert instance["prompt"] == [{"role": m["role"], "content": m["content"]} for m in prompt]
    assert instance["answers"] == ["Alexander Fleming"] and instance["id"] == 3
    # A prompt given as text is a statement, not a conversation: not kept (the question column is the question).
    [plain] = load_instances("search", _jsonl(tmp_path / "text.jsonl", [
        {"question": "Who wrote Hamlet?", "answer": "Shakespeare", "prompt": "Who wrote Hamlet?"}]))
    assert plain == {"question": "Who wrote Hamlet?", "answers": ["Shakespeare"]}


@pytest.mark.parametrize(("prompt", "field", "problem"), [
    ([{"role": "user", "content": None}], "prompt[0].content", "is null, expected text"),
    ([{"role": "user", "content": "q"}, {"content": "hi"}], "prompt[1].role", "is null, expected text"),
    ([{"role": "user", "content": ["q"]}], "prompt[0].content", "is list, expected text"),
    (["Who wrote Hamlet?"], "prompt[0]", "is str, expected a message {role, content}"),
    ([], "prompt", "is an empty list, expected chat messages"),
    ({"role": "user", "content": "q"}, "prompt", "is mapping, expected chat messages"),
])
def test_a_malformed_search_prompt_is_refused_naming_the_row_and_field(
        tmp_path: Path, prompt: Any, field: str, problem: str) -> None:
    good = {"question": "Who wrote Hamlet?", "answer": "Shakespeare"}
    path = _jsonl(tmp_path / "bad.jsonl", [good, {**good, "prompt": prompt}])
    with pytest.raises(DatasetError, match=rf"bad.jsonl:2: field '{re.escape(field)}' {re.escape(problem)}"):
        load_instances("search", path)


def test_search_r1_format_prompts_with_an_instances_own_prompt_and_refuses_a_malformed_one(tmp_path: Path) -> None:
    own = [{"role": "user", "content": "Translate, then answer in <answer> tags: {question} stays as written"}]
    assert search_r1_messages({"question": "q", "prompt": own}, SEARCH_R1_TEMPLATE) == own
    assert search_r1_messages({"question": "q"}, SEARCH_R1_TEMPLATE) == [
        {"role": "user", "content": SEARCH_R1_TEMPLATE.replace("{question}", "q")}]
    # An instance submitted without the loader: its job fails before INIT, naming the message.
    bad = {"question": "q", "answers": ["a"], "prompt": [{"role": "user"}], "settings": {"tool_format": "search_r1"}}
    ctx = JobContext(spec=JobSpec(job_id="j", task="search"), instance=bad, node_id="n", run_dir=tmp_path,
                     config=ProrlConfig(), services=Services(), log=logging.getLogger("test"), handler=SearchHandler())
    with pytest.raises(DomainError, match=r"search: instance field 'prompt\[0\].content' is null, expected text"):
        SearchHandler().check_instance(ctx)
    # The default format does not prompt with it, so it is not checked there.
    ctx = JobContext(spec=JobSpec(job_id="j", task="search"), instance={**bad, "settings": {}}, node_id="n",
                     run_dir=tmp_path, config=ProrlConfig(), services=Services(), log=logging.getLogger("test"),
                     handler=SearchHandler())
    SearchHandler().check_instance(ctx)


# --- math: ids and the answer formats verl recipes ask for -----------------------------------------------------

def test_openr1_math_and_matharena_ids_are_the_row_ids(tmp_path: Path) -> None:
    row = {"problem": "Compute $2+3$.", "solution": "It is $\\boxed{5}$.", "answer": "5", "problem_type": "Algebra",
           "question_type": "math-word-problem", "source": "olympiads", "uuid": "0c7b8e3f-4a5d-5e6f-8a9b-0c1d2e3f4a5b",
           "is_reasoning_complete": [True], "generations": ["... \\boxed{5}"], "correctness_math_verify": [True],
           "correctness_llama": None, "finish_reasons": None, "correctness_count": 1,
           "messages": [{"content": "Compute $2+3$.", "role": "user"}]}
    [instance] = load_instances("math", _parquet(tmp_path / "default.parquet", [row]))
    assert instance == {"problem": "Compute $2+3$.", "answer": "5", "id": "0c7b8e3f-4a5d-5e6f-8a9b-0c1d2e3f4a5b"}
    # MathArena's competitions (aime_2025, hmmt_feb_2025, ...): problem_idx, the problem's number in its competition.
    matharena = {"problem_idx": 1, "problem": "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor "
                                              "of $97_b$.", "answer": "70", "problem_type": ["Number Theory"]}
    [instance] = load_instances("math", _parquet(tmp_path / "train-00000-of-00001.parquet", [matharena]))
    assert instance == {"problem": matharena["problem"], "answer": "70", "id": 1}


DAPO_ROW: dict[str, Any] = {
    "data_source": "math_dapo",
    "prompt": [{"content": "Solve the following math problem step by step. The last line of your response should be "
                           "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
                           "What is $6 \\times 7$?\n\nRemember to put your answer on its own line after \"Answer:\".",
                "role": "user"}],
    "ability": "MATH", "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "a8f7ae5c-1b8e-4c1c-9a35-0c1e2d3f4a5b"},
}


@pytest.mark.parametrize(("final_turn", "reward"), [
    ("6 times 7 is 42.\n\nAnswer: 42", 1.0),          # the form DAPO's prompt asks for
    ("6 times 7 is 42.\n\n**Answer:** $42$", 1.0),
    ("Answer: 41\nWait, recheck.\nAnswer: 42", 1.0),  # the last such line
    ("6 times 7 is 42.\n\nAnswer: 43", 0.0),
    ("\\boxed{42}", 1.0),
    ("Answer: 43, which is \\boxed{42}", 1.0),         # a \\boxed{} answer comes first
    ("<answer>42</answer>", 1.0),                      # answer tags, as the search task reads them
    ("6 times 7 is 42.", 0.0),                         # no answer given in any form
])
def test_dapo_rows_score_an_answer_line(tmp_path: Path, final_turn: str, reward: float) -> None:
    pytest.importorskip("math_verify")
    [instance] = load_instances("math", _parquet(tmp_path / "dapo-math-17k.parquet", [DAPO_ROW]))
    assert instance == {"problem": "What is $6 \\times 7$?", "answer": "42", "id": "a8f7ae5c-1b8e-4c1c-9a35-0c1e2d3f4a5b"}
    assert _math_reward(instance, final_turn, tmp_path) == reward


@pytest.mark.parametrize(("final_turn", "reward"), [
    ("48 + 24 = 72\n#### 72", 1.0),        # GSM8K's own answer format
    ("48 + 24 = 72, less 48 is\n#### 24", 0.0),
    ("\\boxed{72}", 1.0),
    ("She sold \\boxed{72 clips} in all.", 1.0),        # the count with what it counts, in the box
    ("\\boxed{\\text{72 clips}}", 1.0),
    ("\\boxed{7 or 72}", 0.0),                          # two numbers: not an answer of 72
    ("\\boxed{24 clips}", 0.0),
])
def test_gsm8k_rows_score_the_number_after_the_marks(tmp_path: Path, final_turn: str, reward: float) -> None:
    pytest.importorskip("math_verify")
    row = {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                       "How many clips did Natalia sell altogether in April and May?",
           "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                     "altogether in April and May.\n#### 72"}
    [instance] = load_instances("math", _jsonl(tmp_path / "gsm8k.jsonl", [row]))
    assert instance["answer"] == "72"
    assert _math_reward(instance, final_turn, tmp_path) == reward
