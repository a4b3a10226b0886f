"""Answer extraction and scoring: ``\\boxed{}``, ``<answer>`` tags, ``Answer:`` lines, mathematical equivalence,
SQuAD EM and F1.

Mathematical equivalence uses ``math-verify`` (LaTeX, fractions, intervals,
sets, equations such as ``x=3`` against ``3``); without it, or when it cannot
parse an answer, a sympy comparison of the two expressions (plain arithmetic
only: sympify evaluates its text, and an answer is model output); failing
that, normalised string equality. Digit groups set off by a LaTeX space (``10\\,000``) are joined first, and
two lists of option letters (``\\text{A, C}``, ``A, C``) compare as sets of letters, and an answer in words
(``\\text{June 20}``) equals the same words without the ``\\text{}`` (case aside); against a gold that is a plain
number, a number followed by the words it counts (``72 clips``) is compared by that number. Install with
``pip install 'prorl[domains]'``.
"""

from __future__ import annotations

import ast
import collections
import importlib.util
import json
import logging
import os
import re
import string
import subprocess
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

log = logging.getLogger(__name__)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; a last
    ``\\boxed 5`` without braces (TeX takes the one token) gives ``5``."""
    found = _last_boxed_at(text)
    return found[1] if found is not None else None


def _last_boxed_at(text: str) -> tuple[int, str | None] | None:
    """``(where, content)`` of the last ``\\boxed`` of ``text`` (content ``None`` when its braces do not close),
    or ``None`` when there is none."""
    starts = list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))
    bare = list(re.finditer(r"\\boxed\s+([^\s{}$\\]+)", text))
    if bare and (not starts or bare[-1].start() > starts[-1].start()):
        return bare[-1].start(), bare[-1].group(1).rstrip(".,;") or None
    if not starts:
        return None
    start = starts[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return starts[-1].start(), text[start:i].strip()
    return starts[-1].start(), None  # unbalanced: no answer


# Search-R1 (and the verl recipes built on it) ask for the answer between <answer> and </answer>; its own reward
# reads the last such pair.
_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def final_answer(text: str) -> str | None:
    """The answer a model gave last in ``text``: the last ``<answer>...</answer>`` (Search-R1's format) or the last
    ``\\boxed{}``, whichever comes later; a ``\\boxed{}`` inside the tags gives its content. ``None`` when there
    is neither (or the last ``\\boxed{`` never closes)."""
    tags = list(_ANSWER_TAGS.finditer(text))
    boxed = _last_boxed_at(text)
    if tags and (boxed is None or boxed[0] < tags[-1].end()):  # a \boxed{} after them answers later
        inside = tags[-1].group(1).strip()
        return last_boxed(inside) or inside
    return boxed[1] if boxed is not None else None


# DAPO-Math-17k's prompt asks for a last line "Answer: $Answer", and verl's GSM8K one for the number after
# "####": a model trained on those rows answers so even when asked for \boxed{}.
_ANSWER_LINE = re.compile(r"^[ \t*#]*(?:final[ \t]+)?answer[ \t*]*:[ \t*]*(.+?)[ \t*]*$", re.IGNORECASE | re.MULTILINE)
_HASHES = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def math_answer(text: str) -> str | None:
    """A math answer from a model's final turn: its :func:`final_answer` (the last ``\\boxed{}`` or
    ``<answer>...</answer>``); without either, its last line ``Answer: ...`` or ``Final answer: ...``
    (DAPO-Math-17k's format); failing that, the number after its last ``####`` (GSM8K's); else ``None``."""
    given = final_answer(text)
    if given is not None:
        return given
    lines = _ANSWER_LINE.findall(text)
    if lines:
        return str(lines[-1]).strip().strip("$").strip() or None
    hashes = _HASHES.findall(text)
    return str(hashes[-1]).replace(",", "") if hashes else None


def gsm8k_final(answer: str) -> str:
    """A GSM8K worked solution's final answer, the number after its last ``####`` (separators dropped);
    any other answer unchanged."""
    if "####" not in answer:
        return answer
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


@dataclass
class MathVerdict:
    """Whether a predicted answer equals the gold one, and how that was decided."""

    correct: bool
    method: str  # "math_verify", "sympy", "string", "choices", "words", "number_with_words", "none"
    parsed: str | None  # the prediction as the verifier read it


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("^", "**").replace("{", "(").replace("}", ")")
    if re.fullmatch(r"[a-zA-Z]\w*\s*=\s*[^=]+", s):  # "x = 3" answers 3
        s = s.split("=", 1)[1]
    return s.strip()


# What sympify may see: sympify runs its text through eval, and a prediction is model output, so an answer
# such as __import__('os').system(...) would run on the node. Arithmetic, these names and calls of these
# functions only; no attributes, subscripts, strings or keywords.
_SYMPY_FUNCTIONS = frozenset({"sqrt", "exp", "log", "ln", "sin", "cos", "tan", "Abs"})
_SYMPY_CONSTANTS = frozenset({"pi", "oo", "E", "I"})
_SYMPY_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Tuple, ast.Load, ast.operator, ast.unaryop)


def _sympy_safe(expr: str) -> bool:
    """Is ``expr`` plain arithmetic that sympify may evaluate (see ``_SYMPY_FUNCTIONS``)?"""
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, int | float) or isinstance(node.value, bool):
                return False
        elif isinstance(node, ast.Name):
            if not (len(node.id) == 1 or node.id in _SYMPY_CONSTANTS or node.id in _SYMPY_FUNCTIONS):
                return False
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _SYMPY_FUNCTIONS or node.keywords:
                return False
        elif not isinstance(node, _SYMPY_NODES):
            return False
    return True


def _sympy_equal(gold: str, pred: str) -> tuple[bool, str] | None:
    """``(equal, parsed)`` by sympy, or ``None`` when either side does not parse or is no plain arithmetic."""
    import sympy

    gold_expr, pred_expr = _strip_latex(gold), _strip_latex(pred)
    if not (_sympy_safe(gold_expr) and _sympy_safe(pred_expr)):
        return None
    try:
        g = sympy.sympify(gold_expr)
        p = sympy.sympify(pred_expr)
        return bool(sympy.simplify(g - p) == 0), str(p)
    except (sympy.SympifyError, TypeError, SyntaxError, AttributeError, ValueError):
        return None


def _normalise(s: str) -> str:
    return re.sub(r"\s+", "", s.strip().strip("$").rstrip("."))


# Digit groups set off by a LaTeX space (10\\,000, 1\\ 234\\ 567, as LaTeX typesets thousands): math-verify reads
# 10\\,000 as the product 10*000, so a right answer written so would score 0. The space goes before parsing.
_DIGIT_GROUP_SPACE = re.compile(r"(?<=\d)(?:\\,|\\ |\\;|~)(?=\d{3}(?!\d))")
# A list of option letters, as MATH's "enter the letters of the correct options, separated by commas" answers
# (\\text{A, C}): math-verify reads the \\text{} one as the text "a,c" and the bare one as the set {a, c}, which
# never match; compared here as sets of letters, as math-verify compares two bare lists.
# Each item a letter or a parenthesised one: "(A, B)" is an ordered pair, not a list of options.
_CHOICE_ITEM = r"(?:\([A-Z]\)|[A-Z])"
_CHOICE_LIST = re.compile(rf"{_CHOICE_ITEM}(?:\s*,\s*{_CHOICE_ITEM})+")


def _choice_letters(answer: str) -> frozenset[str] | None:
    """The letters of an answer that is a list of option letters (``A, C``, ``\\text{(A), (C)}``), else ``None``."""
    words = latex_words(answer.strip().strip("$"))
    return frozenset(re.findall(r"[A-Z]", words)) if _CHOICE_LIST.fullmatch(words.strip()) else None


def _same_words(gold: str, pred: str) -> bool:
    """Is ``gold`` an answer in words (``\\text{June 20}``, as MATH writes such answers) that ``pred`` gives in the
    same words, case and LaTeX styling aside? math-verify reads the bare words ``June 20`` as a product of
    letters, which never equals the text."""
    if "\\text" not in gold:
        return False
    words = [" ".join(latex_words(side.strip().strip("$")).rstrip(".").casefold().split()) for side in (gold, pred)]
    return bool(words[0]) and words[0] == words[1]


# A number as GSM8K-style answers write it: digits, thousands set off by commas, a decimal part.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_PLAIN_NUMBER = re.compile(rf"(?:{_NUMBER})")
# A number followed by words naming what it counts (72 clips, \$18 dollars, 5 km/h): words of letters only,
# so no second number ("7 or 72") and no LaTeX command gets through.
_NUMBER_THEN_WORDS = re.compile(rf"(?:\\?\$)?\s*({_NUMBER})\s+([A-Za-z][A-Za-z'/ -]*?)[ .]*")
# Words that make "72 ..." something other than 72 ("72 or more", "72 and a half", "72 less than ...").
_QUALIFIERS = frozenset({"or", "and", "to", "plus", "minus", "times", "more", "less", "fewer", "than", "least", "most",
                         "over", "under", "not", "no", "about", "approximately", "around", "nearly", "almost", "roughly",
                         "between", "half", "quarter", "third", "thirds", "hundred", "thousand", "million",
                         "billion", "dozen", "dozens", "squared", "cubed"})


def _number_before_words(gold: str, pred: str) -> str | None:
    """The number of ``pred`` when ``gold`` is a plain number and ``pred`` that number followed by words (``72 clips``
    against GSM8K's ``72``), else ``None``.

    math-verify reads bare words as a product of letters (``72*c*i*l*p*s``), so a right count with its unit in
    the box would score 0. The rule is kept narrow, so that it never makes a wrong answer right: the gold is a
    plain number; the words follow the number after a space, hold no digit, no LaTeX and no single letter (a
    variable: ``72 x``), at least one of them three letters or more, and none of them a qualifier that changes the
    value (``72 or more``, ``72 thousand``); the number equals the gold's. As lm-eval's and verl's GSM8K scoring
    do, the number is what is compared, but only this one number: never the last of several (``7 or 72``).
    """
    gold_text = gold.strip().strip("$").strip()
    if not _PLAIN_NUMBER.fullmatch(gold_text):
        return None
    match = _NUMBER_THEN_WORDS.fullmatch(latex_words(pred.strip().strip("$")))
    if match is None:
        return None
    number, words = match.group(1), match.group(2).casefold().split()
    letters = [re.sub(r"[^a-z]", "", w) for w in words]
    if (not words or any(len(w) < 2 for w in letters) or max(map(len, letters)) < 3
            or any(part in _QUALIFIERS for w in words for part in re.split(r"[/-]", w))):
        return None
    same = Decimal(number.replace(",", "")) == Decimal(gold_text.replace(",", ""))
    return number if same else None


def math_equal(gold: str, pred: str | None) -> MathVerdict:
    """Is ``pred`` mathematically equal to ``gold``? ``None`` (no answer) is wrong.

    Runs without signal-based timeouts (it is called from worker threads):
    callers bound it with their stage limit.
    """
    if pred is None or not pred.strip():
        return MathVerdict(False, "none", None)
    gold, pred = _DIGIT_GROUP_SPACE.sub("", gold), _DIGIT_GROUP_SPACE.sub("", pred)
    counted = _number_before_words(gold, pred)
    if counted is not None:
        return MathVerdict(True, "number_with_words", counted)
    gold_letters, pred_letters = _choice_letters(gold), _choice_letters(pred)
    if gold_letters is not None and pred_letters is not None:
        return MathVerdict(gold_letters == pred_letters, "choices", ", ".join(sorted(pred_letters)))
    if importlib.util.find_spec("math_verify") is not None:
        from math_verify import parse, verify

        g = parse(f"${gold}$", parsing_timeout=None)
        p = parse(f"${pred}$", parsing_timeout=None)
        if g and p:
            ok = bool(verify(g, p, timeout_seconds=None))
            if not ok and _same_words(gold, pred):
                return MathVerdict(True, "words", latex_words(pred.strip().strip("$")))
            return MathVerdict(ok, "math_verify", str(p[0]))
        log.debug("math-verify could not parse gold %r or prediction %r; trying sympy", gold, pred)
    if importlib.util.find_spec("sympy") is not None:
        result = _sympy_equal(gold, pred)
        if result is not None:
            return MathVerdict(result[0], "sympy", result[1])
    return MathVerdict(_normalise(gold) == _normalise(pred), "string", _normalise(pred))


# A prediction whose value may be astronomically large: sympy evaluates 9^{9^{9}} (hundreds of millions of
# digits) eagerly, for minutes and gigabytes, in a thread that no stage limit stops. Such answers (and
# factorials, binomials, products, very long answers) are judged in a child process that is killed at its limit.
_HEAVY_WORDS = ("!", "**", "\\binom", "\\choose", "\\prod", "\\uparrow")
_HEAVY_CHARS = 500
_CHILD = """
import json, resource, sys
from dataclasses import asdict
limit = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from prorl_cli.domains.answers import math_equal
gold, pred = json.load(sys.stdin)
print(json.dumps(asdict(math_equal(gold, pred))))
"""


def _exponent(text: str, start: int) -> tuple[str, int]:
    """The superscript of ``text`` that starts at ``start`` (after the ``^``) and where it ends."""
    while start < len(text) and text[start].isspace():
        start += 1
    if start < len(text) and text[start] == "{":
        depth = 0
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + 1: i], i + 1
        return text[start + 1:], len(text)
    match = re.match(r"\\[a-zA-Z]+|\d+|.", text[start:], re.DOTALL)
    return (match.group(0), start + match.end()) if match else ("", start)


def heavy_answer(pred: str) -> bool:
    """May evaluating ``pred`` take unbounded time or memory (towers of powers, huge exponents, factorials)?"""
    if len(pred) > _HEAVY_CHARS or any(word in pred for word in _HEAVY_WORDS):
        return True
    carets = list(re.finditer(r"\^", pred))
    if len(carets) > 2:  # ((9^9)^9)^9... grows as a tower too
        return True
    for caret in carets:
        exponent, end = _exponent(pred, caret.end())
        if "^" in exponent or re.search(r"\d{5,}", exponent) or pred[end:].lstrip().startswith("^"):
            return True
        if len(carets) == 2 and re.search(r"\d{3,}", exponent):  # (10^{999})^{999}
            return True
    return False


def math_equal_bounded(gold: str, pred: str | None, *, timeout_s: float = 20.0, mem_mb: int = 2048) -> MathVerdict:
    """:func:`math_equal`, with a :func:`heavy_answer` judged in a child process under ``timeout_s`` and
    ``mem_mb``; one that runs past them is wrong (method ``"timeout"`` or ``"error"``)."""
    if pred is None or not heavy_answer(pred):
        return math_equal(gold, pred)
    # The child imports prorl_cli from where this process did, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(mem_mb)], input=json.dumps([gold, pred]),
                              capture_output=True, text=True, timeout=timeout_s, check=False, env=env,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        log.info("judging %r took over %.1f s: scored wrong", pred[:200], timeout_s)
        return MathVerdict(False, "timeout", None)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        # Out of memory is the answer's fault; anything else (an import error, say) would score every such
        # answer 0, so it is a warning.
        (log.info if "MemoryError" in done.stderr else log.warning)(
            "judging %r in a child process failed (exit %s): %s", pred[:200], done.returncode, done.stderr[-500:])
        return MathVerdict(False, "error", None)
    return MathVerdict(**json.loads(lines[-1]))


# LaTeX commands that only style the words inside them: a model boxes "\\text{Paris}" for the answer "Paris".
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textit|textrm|textsf|texttt|textnormal|mathrm|mathbf|mathit|mathsf|mbox|emph)\s*\{([^{}]*)\}")


def latex_words(text: str) -> str:
    """``text`` with styling commands (``\\text{...}``, ``\\textbf{...}``, ``\\mathrm{...}``) replaced by their
    content and LaTeX spaces (``\\ ``, ``~``, ``\\,``) by plain ones, for word-level answer matching."""
    previous = None
    while previous != text:  # nested: \textbf{\text{Paris}}
        previous, text = text, _TEXT_COMMAND.sub(r"\1", text)
    return re.sub(r"\\[ ,;:!]|~", " ", text).strip()


def squad_normalise(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: list[str]) -> bool:
    """SQuAD exact match against any of the gold answers."""
    p = squad_normalise(prediction)
    return any(p == squad_normalise(g) for g in golds)


def f1_score(prediction: str, golds: list[str]) -> float:
    """SQuAD token F1, the best over the gold answers."""
    best = 0.0
    pred_tokens = squad_normalise(prediction).split()
    for gold in golds:
        gold_tokens = squad_normalise(gold).split()
        common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
        same = sum(common.values())
        if not pred_tokens or not gold_tokens:
            f1 = float(pred_tokens == gold_tokens)
        elif same == 0:
            f1 = 0.0
        else:
            precision, recall = same / len(pred_tokens), same / len(gold_tokens)
            f1 = 2 * precision * recall / (precision + recall)
        best = max(best, f1)
    return best
