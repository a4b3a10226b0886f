"""``math_agent``: a multi-turn, tool-using math agent on the token-exact loop.

Instance::

    {"question": "What is 17 * 23?", "answer": "391",
     "tokenizer": "/path/model-dir",   # optional; default inference.tokenizer
     "max_turns": 4}                   # optional

The model may call ``calculator`` (Hermes ``<tool_call>`` format) any number
of times; the turn without a tool call is its answer. Reward: 1.0 when the
last number in that answer equals ``answer`` as a number, else 0.0: a GSM8K
``answer`` (a worked solution ending ``#### 72``) counts by its number after
``####``, thousands separators are ignored (``1,000`` is 1000) and ``72.0``
equals ``72``. No sandbox:
the calculator evaluates arithmetic with Python's ``ast``, nothing else.
The output holds the whole token-level trajectory (``prorl_cli.agent``).
"""

from __future__ import annotations

import ast
import operator
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from prorl_cli.domains.answers import gsm8k_final
from prorl_cli.node.handler import AgentHandler, HandlerSettings, JobContext, Tool, final_text

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = "You are a careful math assistant. Use the calculator tool, then state the final number."

_OPS: dict[type, Any] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}
#: The largest integer power the calculator computes (about 3,000 decimal digits).
_MAX_POW_BITS = 10_000


def calculator(expression: str) -> str:
    """Evaluate arithmetic only (no names, calls or attributes)."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            # Nested powers ((9**99)**99)**99 grow past any bound on the exponent alone, and the call runs on
            # the node's event loop: refuse a result of more than _MAX_POW_BITS bits before computing it.
            if (isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0
                    and abs(left).bit_length() * right > _MAX_POW_BITS):
                raise ValueError(f"result too large (over {_MAX_POW_BITS} bits)")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    value = ev(ast.parse(str(expression), mode="eval").body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# A number with thousands separators ("1,000") first, so that it is not read as its last group ("000").
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in ``text``, thousands separators dropped (``"1,000"`` -> ``"1000"``), or ``None``."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def gold_number(answer: object) -> str:
    """The gold answer as text: for a GSM8K solution the part after its last ``####``; separators dropped."""
    return gsm8k_final(str(answer)).strip().replace(",", "")


def same_number(got: str | None, gold: str) -> bool:
    """Do ``got`` and ``gold`` name the same number (``72.0`` is ``72``)? Text that is no number must match exactly."""
    if got is None:
        return False
    try:
        return Decimal(got) == Decimal(gold)
    except InvalidOperation:
        return got == gold


class MathAgentHandler(AgentHandler):
    """Question -> calculator calls -> answer; reward by exact match."""

    name = "math_agent"
    defaults = HandlerSettings(max_turns=4, system_prompt=SYSTEM)
    tools = (Tool("calculator", CALCULATOR_SCHEMA, calculator),)
    required_fields = ("question",)

    async def init(self, ctx: JobContext) -> None:
        if not isinstance(ctx.instance.get("question"), str):
            raise ValueError("math_agent instance needs a 'question' string")

    async def run(self, ctx: JobContext) -> None:
        # The trajectory is ctx.trajectory from the first call on: a RUN that times out or fails still returns it.
        await ctx.agent(ctx.instance["question"], max_turns=int(ctx.instance.get("max_turns", ctx.settings.max_turns)))

    async def eval(self, ctx: JobContext) -> None:
        traj = ctx.trajectory
        answer = final_text(traj) if traj.stop_reason == "stop" else ""
        got = final_number(answer)
        ctx.output["predicted"] = got
        ctx.reward = 1.0 if same_number(got, gold_number(ctx.instance.get("answer"))) else 0.0
