"""The ``math`` domain: equivalence scoring, the sandboxed Python tool, loop limits and stage fallbacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from prorl_cli.domains.answers import _sympy_equal, last_boxed, math_equal
from tests.domains.conftest import ScriptedStack, turn
from tests.harness import need_module

EQUIVALENT = [("\\frac{1}{2}", "0.5"), ("3", "x=3"), ("[0, \\frac{1}{2})", "[0, 0.5)"), ("\\{1,2\\}", "\\{2,1\\}"),
              ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"), ("\\left(-1, \\frac{3}{3}\\right)", "(-1, 1)")]
DIFFERENT = [("\\frac{1}{2}", "0.51"), ("(1,2]", "[1,2]"), ("3", "x=4"), ("5", "")]


@pytest.mark.parametrize(("gold", "pred"), EQUIVALENT)
def test_equivalent_answers_a_string_match_gets_wrong_score_1(gold: str, pred: str) -> None:
    need_module("math_verify", "domains")
    assert gold.replace(" ", "") != pred.replace(" ", "")
    assert math_equal(gold, pred).correct, (gold, pred)


@pytest.mark.parametrize(("gold", "pred"), DIFFERENT)
def test_non_equivalent_answers_score_0(gold: str, pred: str) -> None:
    need_module("math_verify", "domains")
    assert not math_equal(gold, pred).correct


def test_sympy_fallback_and_boxed_extraction() -> None:
    assert _sympy_equal("\\frac{1}{2}", "0.5") == (True, "0.500000000000000")
    assert _sympy_equal("x = 3", "3") == (True, "3")
    assert _sympy_equal("2", "3") == (False, "3")
    assert last_boxed("first \\boxed{1}, finally \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("unbalanced \\boxed{1") is None


def test_math_handler_end_to_end(stack: ScriptedStack) -> None:
    stack.add("P-correct", turn("Let me compute.", ("python", {"code": "from sympy import Rational\nx = Rational(1, 2) + Rational(1, 4)\nx"})),
              turn("", ("python", {"code": "print(x * 4)"})), "So the sum is \\boxed{0.75}")
    stack.add("P-wrong", "\\boxed{\\frac{2}{3}}")
    stack.add("P-malformed", "<tool_call>{not json</tool_call>", turn("", ("nosuchtool", {})), "\\boxed{x=3}")
    stack.add("P-budget", *[turn("", ("python", {"code": "1+1"}))] * 5)
    stack.start_model()
    correct, wrong, malformed, budget, no_answer, slow_run, slow_eval = stack.run("math", [
        {"problem": "P-correct: 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
        {"problem": "P-wrong: 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
        {"problem": "P-malformed: solve x + 1 = 4", "answer": "3"},
        {"problem": "P-budget: loop", "answer": "2", "settings": {"max_turns": 3}},
        {"problem": "P-init: no answer field"},
        {"problem": "P-correct again", "answer": "\\frac{3}{4}", "settings": {"run_timeout_s": 0.001}},
        {"problem": "P-correct: 1/2 + 1/4?", "answer": "\\frac{3}{4}", "settings": {"eval_timeout_s": 1e-6}},
    ])
    assert correct.state == "done" and correct.reward == 1.0, correct
    out = correct.output
    tool_msgs = [m["content"] for m in out["trajectory"]["messages"] if m["role"] == "tool"]
    assert tool_msgs == ["3/4", "3"]  # the persistent namespace kept x between calls
    assert out["predicted"] == "0.75" and out["verdict"]["method"] == "math_verify"
    assert wrong.reward == 0.0 and wrong.output["predicted"] == "\\frac{2}{3}"

    msgs = [m["content"] for m in malformed.output["trajectory"]["messages"] if m["role"] == "tool"]
    assert msgs[0].startswith("error: tool call is not valid JSON")
    assert msgs[1].startswith("error: unknown tool 'nosuchtool'")
    assert malformed.reward == 1.0  # the loop went on and "x=3" equals 3

    assert budget.output["stop_reason"] == "max_turns" and budget.output["turns"] == 3
    assert budget.reward == 0.0 and budget.output["predicted"] is None

    for result, stage in ((no_answer, "init"), (slow_run, "run"), (slow_eval, "eval")):
        assert result.reward == 0.0 and result.critical_error == stage, result
        failure = result.output["failure"]
        assert failure["stage"] == stage and failure["type"] in ("ValueError", "StageTimeout"), failure
    assert "limit of 0.001 s" in slow_run.output["failure"]["message"]
    records = stack.d.deployment_dir / "nodes" / "n1" / "sandboxes"
    assert list(records.glob("*.json")) == []  # every sandbox was stopped


def test_sympy_fallback_never_evaluates_code_in_an_answer(tmp_path: Path) -> None:
    """sympify runs its text through eval: a model's boxed answer reached the node's Python (sympy comes with
    torch, math-verify may be missing, and math-verify hands over any answer it cannot parse)."""
    marker = tmp_path / "ran"
    for pred in (f"__import__('os').system('touch {marker}')", f"open('{marker}', 'w').write('x')",
                 "().__class__.__base__", "S.true", "x(1)", "lambda: 1"):
        assert _sympy_equal("5", pred) is None, pred
        assert not math_equal("5", pred).correct
    assert not marker.exists()
    assert _sympy_equal("\\sqrt{2}", "2^{1/2}") == (True, "sqrt(2)")  # arithmetic and its functions still compare


def test_a_boxed_answer_without_braces() -> None:
    """TeX's \\boxed 5 boxes the one token: it is the answer, not "no answer" (a right answer scored 0)."""
    assert last_boxed("so the answer is $\\boxed 5$.") == "5"
    assert last_boxed("The answer is \\boxed 12.") == "12"
    assert last_boxed("\\boxed{1} at first, then \\boxed 7") == "7"
    assert last_boxed("\\boxed 7 at first, then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"


@pytest.mark.parametrize(("pred", "correct"), [
    ("June 20", True), ("june 20.", True), ("\\text{June 20}", True), ("\\textbf{June 20}", True),
    ("June 21", False), ("June", False), ("20", False),
])
def test_an_answer_in_words_equals_the_same_words_without_text(pred: str, correct: bool) -> None:
    # MATH writes answers in words as \text{...}: math-verify reads the bare words June 20 as a product of letters.
    need_module("math_verify", "domains")
    assert math_equal("\\text{June 20}", pred).correct is correct


@pytest.mark.parametrize(("gold", "pred", "correct"), [
    ("72", "72 clips", True), ("72", "\\text{72 clips}", True), ("72", "72 cups of flour.", True),
    ("18", "\\$18 dollars", True), ("1000", "1,000 people", True), ("72", "72.0 clips", True),
    ("-5", "-5 degrees", True), ("55", "55 km/h", True), ("72", "72 children's books", True),
    ("72", "7 or 72", False), ("72", "72 or 7", False),        # two numbers: neither is the answer
    ("72", "73 clips", False), ("72", "72 clips and 5 boxes", False),
    ("72", "72 thousand clips", False), ("72", "72 dozen", False), ("72", "72 and a half", False),
    ("72", "72 x", False), ("72", "72 xy", False),             # a variable, not a word
    ("72", "72clips", False), ("72", "72 \\times clips", False),
    ("\\frac{1}{2}", "0.5 cups", False),                      # the gold is no plain number
])
def test_a_number_followed_by_words_equals_a_plain_number_gold(gold: str, pred: str, correct: bool) -> None:
    """GSM8K's gold is a number (``#### 72``); a model boxes ``72 clips``. math-verify reads the words as a product of
    letters, so the count is compared alone, and only a single number followed by plain words."""
    need_module("math_verify", "domains")
    verdict = math_equal(gold, pred)
    assert verdict.correct is correct, verdict
    if correct:
        assert verdict.method in ("number_with_words", "math_verify"), verdict
