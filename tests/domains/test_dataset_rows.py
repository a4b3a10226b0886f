"""Public rows the loaders once took silently and scored 0 (or refused with the wrong reason).

Each row is written as its public source publishes it: a row that cannot be scored is refused naming the
file, the line and the field; one that can is loaded as a model would be scored against it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.domains.datasets import load_instances
from prorl_cli.exceptions import DatasetError


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one(tmp_path: Path, task: str, row: Mapping[str, object], fmt: str | None = None) -> dict[str, Any]:
    (inst,) = load_instances(task, _jsonl(tmp_path / "rows.jsonl", [row]), fmt)
    assert isinstance(inst, dict)
    return inst


def _refused(tmp_path: Path, task: str, row: Mapping[str, object], match: str) -> None:
    """The row, second in its file after a good one, is refused at line 2 with ``match``."""
    good = {"math": {"problem": "1+1?", "answer": "2"},
            "code": {"question": "q", "tests": [{"input": "1\n", "output": "1\n"}]},
            "search": {"question": "q", "answer": "a"}}[task]
    with pytest.raises(DatasetError, match=r"rows\.jsonl:2: " + match):
        load_instances(task, _jsonl(tmp_path / "rows.jsonl", [good, row]))


# --- code: function-call tests -------------------------------------------------------------------------------

# DeepCoder-Preview (primeintellect subset): 'tests' is JSON text; these are calls of fn_name, not programs.
DEEPCODER_CALLS = {
    "problem": "Write a function sum_pair that returns the sum of the two numbers in the list.",
    "tests": "[{\"type\": \"function_call\", \"fn_name\": \"sum_pair\", \"input\": [[1, 2]], \"output\": [3]}, "
             "{\"type\": \"function_call\", \"fn_name\": \"sum_pair\", \"input\": [[5, 5]], \"output\": [10]}]",
    "solutions": ["def sum_pair(xs):\n    return xs[0] + xs[1]\n"],
}
DEEPCODER_STDIN = {
    "problem": "Read two integers and print their sum.",
    "tests": "[{\"type\": \"stdin_stdout\", \"input\": \"1 2\\n\", \"output\": \"3\\n\"}]",
    "solutions": ["print(sum(map(int, input().split())))\n"],
}
# DeepCoder-Preview (lcbv5 subset), 'tests' as a list once read: LiveCodeBench's LeetCode items.
LCB_FUNCTIONAL = [{"input": "[2, 3, 1]\n1", "output": "3", "testtype": "functional", "metadata": {"func_name": "maxSum"}}]


def test_deepcoder_function_call_tests_are_refused_not_fed_to_stdin(tmp_path: Path) -> None:
    _refused(tmp_path, "code", DEEPCODER_CALLS, r"tests has function-call tests only \(fn_name 'sum_pair'.*leave such rows out")
    _refused(tmp_path, "code", {**DEEPCODER_CALLS, "tests": json.loads(str(DEEPCODER_CALLS["tests"]))},
             r"tests has function-call tests only \(fn_name 'sum_pair'")
    assert _one(tmp_path, "code", DEEPCODER_STDIN)["tests"] == [{"input": "1 2\n", "output": "3\n"}]


def test_livecodebench_functional_items_in_a_tests_list(tmp_path: Path) -> None:
    row = {"problem": "Return the largest sum.", "tests": LCB_FUNCTIONAL}
    _refused(tmp_path, "code", row, r"tests has function-call tests only \(testtype 'functional'; LiveCodeBench's LeetCode rows")
    # Mixed items: the stdin tests are kept, as for 'tests' given as JSON text.
    stdin = {"input": "3\n2 3 1\n", "output": "5\n", "testtype": "stdin"}
    for tests in ([stdin, *LCB_FUNCTIONAL], json.dumps([stdin, *LCB_FUNCTIONAL])):
        assert _one(tmp_path, "code", {"problem": "p", "tests": tests})["tests"] == [{"input": "3\n2 3 1\n", "output": "5\n"}]


def test_livecodebench_leetcode_rows_say_their_tests_are_all_functional(tmp_path: Path) -> None:
    row = {"question_title": "maximum-sum", "question_content": "Return the largest sum.", "platform": "leetcode",
           "question_id": "3000", "contest_id": "weekly-contest-380", "contest_date": "2024-01-13T00:00:00",
           "starter_code": "class Solution:\n    def maxSum(self, nums: List[int], k: int) -> int:\n        ",
           "difficulty": "easy", "public_test_cases": "[{\"input\": \"[2, 3, 1]\\n1\", \"output\": \"3\", \"testtype\": \"functional\"}]",
           "private_test_cases": "[]", "metadata": "{\"func_name\": \"maxSum\"}"}
    _refused(tmp_path, "code", row, r"public_test_cases/private_test_cases has function-call tests only \(testtype 'functional'")


# --- code: each test item checked when the file is read ------------------------------------------------------

@pytest.mark.parametrize(("tests", "problem"), [
    ([{"in": "1"}], r"tests\[0\]: missing field 'input'"),
    ([{"input": "1 2\n", "output": "3\n"}, "1 2"], r"tests\[1\] is a str, expected a test \{input, output\}"),
    ([{"input": "1 2\n"}], r"tests\[0\]: missing field 'output'"),
    ([{"input": None, "output": "3\n"}], r"tests\[0\]\.input is null"),
    ([{"input": "1\n", "output": {"value": 3}}], r"tests\[0\]\.output is a mapping"),
])
def test_a_malformed_tests_list_is_refused_at_load(tmp_path: Path, tests: list[object], problem: str) -> None:
    _refused(tmp_path, "code", {"question": "Add two numbers.", "tests": tests}, problem)


def test_numbers_in_a_tests_list_become_text_as_on_the_other_paths(tmp_path: Path) -> None:
    row = {"question": "Add two numbers.", "tests": [{"input": "1 2", "output": 3}, {"input": ["2", "2"], "output": "4"}]}
    assert _one(tmp_path, "code", row)["tests"] == [{"input": "1 2", "output": "3"}, {"input": "2\n2", "output": "4"}]
    io = {"question": "Add two numbers.", "inputs": ["1 2"], "outputs": [3]}
    assert _one(tmp_path, "code", io)["tests"] == [{"input": "1 2", "output": "3"}]
    _refused(tmp_path, "code", {"question": "q", "inputs": ["1 2"], "outputs": [None]}, r"outputs\[0\] is null")


# --- code: open-r1/codeforces --------------------------------------------------------------------------------

CODEFORCES = {
    "id": "1/A", "aliases": None, "contest_id": "1", "contest_name": "Codeforces Beta Round 1", "contest_type": "CF",
    "contest_start": 1266580800, "contest_start_year": 2010, "index": "A", "time_limit": 1.0, "memory_limit": 256.0,
    "title": "Theatre Square",
    "description": "Theatre Square in the capital city of Berland has a rectangular shape with the size n × m meters. "
                   "What is the least number of flagstones needed to pave the Square?",
    "input_format": "The input contains three positive integer numbers in the first line: n,  m and a (1 ≤  n, m, a ≤ 10^9).",
    "output_format": "Write the needed number of flagstones.",
    "interaction_format": None, "note": None,
    "examples": [{"input": "6 6 4", "output": "4"}],
    "editorial": None, "rating": 1000, "tags": ["math"], "testset_size": 2,
    "official_tests": [{"input": "6 6 4\n", "output": "4\n"}, {"input": "1 1 1\n", "output": "1\n"}],
    "official_tests_complete": True, "input_mode": "stdio", "generated_checker": None, "executable": True,
    "generated_tests": 0,
}


def test_open_r1_codeforces_rows_load_with_the_whole_statement(tmp_path: Path) -> None:
    inst = _one(tmp_path, "code", CODEFORCES)
    assert inst["tests"] == [{"input": "6 6 4\n", "output": "4\n"}, {"input": "1 1 1\n", "output": "1\n"}]
    question = str(inst["question"])
    assert question.startswith("Theatre Square in the capital city")
    assert "## Input\n\nThe input contains three positive integer numbers" in question
    assert "## Output\n\nWrite the needed number of flagstones." in question
    assert "## Note" not in question  # null note
    # No official tests: the statement's examples are the tests.
    assert _one(tmp_path, "code", {**CODEFORCES, "official_tests": []})["tests"] == [{"input": "6 6 4", "output": "4"}]
    assert _one(tmp_path, "code", CODEFORCES, "codeforces") == inst
    _refused(tmp_path, "code", {**CODEFORCES, "interaction_format": "Interact with the jury."}, "the row is an interactive problem")


def test_an_int_generated_tests_is_not_read_as_codecontests(tmp_path: Path) -> None:
    row = {k: v for k, v in CODEFORCES.items() if k not in ("official_tests", "examples")}
    _refused(tmp_path, "code", row, r"missing field 'tests' .*'generated_tests' here is a count")
    _refused(tmp_path, "code", {**row, "public_tests": {"input": ["1\n"], "output": ["1\n"]}},
             r"generated_tests is an int, expected CodeContests' \{input, output\} lists \(open-r1/codeforces")


# --- math: rows with no checkable answer, float answers ------------------------------------------------------

NUMINA = {"problem": "Prove that for every positive integer n, n^3 - n is divisible by 6.",
          "solution": "n^3 - n = (n-1)n(n+1), a product of three consecutive integers.",
          "answer": "proof", "problem_type": "Number Theory", "question_type": "proof", "source": "olympiads",
          "uuid": "0a1b2c3d-0000-0000-0000-000000000000", "is_reasoning_complete": [True],
          "generations": ["..."], "correctness_math_verify": [True], "correctness_llama": None,
          "finish_reasons": None, "correctness_count": 1, "messages": []}


@pytest.mark.parametrize("answer", ["proof", "notfound"])
def test_numinamath_placeholder_answers_are_refused(tmp_path: Path, answer: str) -> None:
    _refused(tmp_path, "math", {**NUMINA, "answer": answer},
             rf"field 'answer' is '{answer}', NuminaMath's placeholder for a row with no checkable answer")


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinite_answers_are_refused(tmp_path: Path, text: str) -> None:
    f = tmp_path / "rows.jsonl"
    f.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "P", "answer": ' + text + "}\n")  # as json.dumps writes them
    with pytest.raises(DatasetError, match=r"rows\.jsonl:2: field 'answer' is .*NaN or infinity.*no checkable answer"):
        load_instances("math", f)


def test_integral_float_answers_are_written_as_integers(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    # pandas makes an int column with a null float64: 142 is written as 142.0.
    frame = pd.DataFrame({"problem": ["a", "b", "c", "d"], "answer": [142, 10**15, None, -3],
                          "solution": ["", "", "so \\boxed{7}", ""]})
    assert str(frame["answer"].dtype) == "float64"
    frame.to_parquet(tmp_path / "amc.parquet")
    answers = [i["answer"] for i in load_instances("math", tmp_path / "amc.parquet")]
    assert answers == ["142", "1000000000000000", "7", "-3"]
    assert _one(tmp_path, "math", {"problem": "p", "answer": 0.5})["answer"] == "0.5"


@pytest.mark.parametrize("answer", ["1.2345678901234568e16", "1e20"])
def test_float_answers_too_large_to_be_exact_are_refused(tmp_path: Path, answer: str) -> None:
    f = tmp_path / "rows.jsonl"
    f.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "P", "answer": ' + answer + "}\n")
    with pytest.raises(DatasetError, match=r"rows\.jsonl:2: field 'answer' is the float .*too large for a float"):
        load_instances("math", f)


# --- search: gold answers ------------------------------------------------------------------------------------

def test_numbers_and_booleans_as_search_answers(tmp_path: Path) -> None:
    # StrategyQA: a yes/no question with a boolean answer.
    strategyqa = {"qid": "b8677742616fef051f00", "term": "Genghis Khan",
                  "description": "founder and first Great Khan of the Mongol Empire",
                  "question": "Are more people today related to Genghis Khan than Julius Caesar?", "answer": True,
                  "facts": ["Julius Caesar had three children.", "Genghis Khan had sixteen children."],
                  "decomposition": ["How many kids did Julius Caesar have?", "How many kids did Genghis Khan have?"]}
    assert _one(tmp_path, "search", strategyqa)["answers"] == ["yes"]
    assert _one(tmp_path, "search", {**strategyqa, "answer": False})["answers"] == ["no"]
    assert _one(tmp_path, "search", {"question": "What year?", "answer": 1997})["answers"] == ["1997"]
    assert _one(tmp_path, "search", {"question": "What year?", "answers": [1997, "1997 AD"]})["answers"] == ["1997", "1997 AD"]


def test_an_answer_starting_with_a_bracket_is_one_answer(tmp_path: Path) -> None:
    assert _one(tmp_path, "search", {"question": "Q", "answer": "[citation needed]"})["answers"] == ["[citation needed]"]
    assert _one(tmp_path, "search", {"question": "Q", "answer": "[1, 2]"})["answers"] == ["[1, 2]"]
    assert _one(tmp_path, "search", {"question": "Q", "answer": '["Paris", "Paris, France"]'})["answers"] == [
        "Paris", "Paris, France"]
    _refused(tmp_path, "search", {"question": "Q", "golden_answers": "[citation needed]"},
             r"field 'golden_answers' is a string but not JSON")


def test_null_nested_and_empty_gold_lists(tmp_path: Path) -> None:
    _refused(tmp_path, "search", {"question": "Q", "answers": [None, "x"]}, r"field 'answers\[0\]' is null")
    # Natural Questions: one list of short answers per annotation.
    nq = {"question": "who sang it", "answers": [["Linda Davis", "Reba McEntire"], ["Reba McEntire"]]}
    assert _one(tmp_path, "search", nq)["answers"] == ["Linda Davis", "Reba McEntire"]
    _refused(tmp_path, "search", {"question": "Q", "answers": [["a", None]]}, r"field 'answers\[0\]\[1\]' is null")
    assert _one(tmp_path, "search", {"question": "Q", "answers": [], "answer": "x"})["answers"] == ["x"]
    squad_v2 = {"id": "5ad39d53604f3c001a3fe8d1", "title": "Normans", "context": "The Normans ...",
                "question": "What is France a region of?", "answers": {"text": [], "answer_start": []}}
    _refused(tmp_path, "search", squad_v2, r"field 'answers' has no answer text \(an unanswerable row")


# --- wording and non-text questions --------------------------------------------------------------------------

def test_type_names_take_their_article_and_code_questions_must_be_text(tmp_path: Path) -> None:
    _refused(tmp_path, "math", {"problem": 5, "answer": "5"}, r"field 'problem' is an int, expected the problem text")
    _refused(tmp_path, "code", {"question": {"en": "Add two numbers."}, "inputs": ["1 2\n"], "outputs": ["3\n"]},
             r"field 'question' is a mapping, expected the problem statement text")
    _refused(tmp_path, "code", {"question": 7, "inputs": ["1 2\n"], "outputs": ["3\n"]}, r"field 'question' is an int")


# --- verl ground truths --------------------------------------------------------------------------------------

VERL_PROMPT = [{"role": "user", "content": "What is $1+1$? Let's think step by step and output the final answer "
                                           "within \\boxed{}."}]


def test_a_verl_ground_truth_as_json_text_of_a_list_is_its_answer(tmp_path: Path) -> None:
    # Some verl recipes write ground_truth as JSON text of a list of answers: as gold, '["2"]' would score 2 wrong.
    row = {"prompt": VERL_PROMPT, "reward_model": {"ground_truth": '["2"]', "style": "rule"}}
    assert _one(tmp_path, "math", row)["answer"] == "2"
    assert _one(tmp_path, "math", {**row, "reward_model": {"ground_truth": 2.0}})["answer"] == "2"
    # Interval answers are not JSON lists of strings: kept as written.
    assert _one(tmp_path, "math", {**row, "reward_model": {"ground_truth": "[1, 2]"}})["answer"] == "[1, 2]"


def test_a_verl_ground_truth_of_several_answers_is_refused_naming_it(tmp_path: Path) -> None:
    row = {"prompt": VERL_PROMPT, "reward_model": {"ground_truth": ["2", "two"], "style": "rule"}}
    _refused(tmp_path, "math", row, r"field 'reward_model.ground_truth' holds 2 answers \('2', 'two'\): the math "
                                    r"task scores against one")
    _refused(tmp_path, "math", {**row, "reward_model": {"ground_truth": '["2", "two"]'}},
             r"field 'reward_model.ground_truth' holds 2 answers")
    assert _one(tmp_path, "math", {**row, "answer": "2"})["answer"] == "2"  # an 'answer' beside it is the gold
