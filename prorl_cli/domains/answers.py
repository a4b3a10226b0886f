"""Answer extraction and scoring: ``\\boxed{}``, mathematical equivalence, SQuAD EM and F1.

Mathematical equivalence uses ``math-verify`` (LaTeX, fractions, intervals,
sets, equations such as ``x=3`` against ``3``); without it, or when it cannot
parse an answer, a sympy comparison of the two expressions; failing that,
normalised string equality. Install with ``pip install 'prorl[domains]'``.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import re
import string
from dataclasses import dataclass

log = logging.getLogger(__name__)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None  # unbalanced: no answer


@dataclass
class MathVerdict:
    """Whether a predicted answer equals the gold one, and how that was decided."""

    correct: bool
    method: str  # "math_verify", "sympy" or "string"
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


def _sympy_equal(gold: str, pred: str) -> tuple[bool, str] | None:
    """``(equal, parsed)`` by sympy, or ``None`` when either side does not parse."""
    import sympy

    try:
        g = sympy.sympify(_strip_latex(gold))
        p = sympy.sympify(_strip_latex(pred))
        return bool(sympy.simplify(g - p) == 0), str(p)
    except (sympy.SympifyError, TypeError, SyntaxError, AttributeError, ValueError):
        return None


def _normalise(s: str) -> str:
    return re.sub(r"\s+", "", s.strip().strip("$").rstrip("."))


def math_equal(gold: str, pred: str | None) -> MathVerdict:
    """Is ``pred`` mathematically equal to ``gold``? ``None`` (no answer) is wrong.

    Runs without signal-based timeouts (it is called from worker threads):
    callers bound it with their stage limit.
    """
    if pred is None or not pred.strip():
        return MathVerdict(False, "none", None)
    if importlib.util.find_spec("math_verify") is not None:
        from math_verify import parse, verify

        g = parse(f"${gold}$", parsing_timeout=None)
        p = parse(f"${pred}$", parsing_timeout=None)
        if g and p:
            ok = bool(verify(g, p, timeout_seconds=None))
            return MathVerdict(ok, "math_verify", str(p[0]))
        log.debug("math-verify could not parse gold %r or prediction %r; trying sympy", gold, pred)
    if importlib.util.find_spec("sympy") is not None:
        result = _sympy_equal(gold, pred)
        if result is not None:
            return MathVerdict(result[0], "sympy", result[1])
    return MathVerdict(_normalise(gold) == _normalise(pred), "string", _normalise(pred))


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
