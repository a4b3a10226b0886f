"""``math_agent``: a multi-turn, tool-using math agent on the token-exact loop.

Instance::

    {"question": "What is 17 * 23?", "answer": "391",
     "tokenizer": "/path/model-dir",   # optional; default inference.tokenizer
     "max_turns": 4}                   # optional

The model may call ``calculator`` (Hermes ``<tool_call>`` format) any number
of times; the turn without a tool call is its answer. Reward: 1.0 when the
last number in that answer equals ``answer`` exactly, else 0.0. No sandbox:
the calculator evaluates arithmetic with Python's ``ast``, nothing else.
The output holds the whole token-level trajectory (``prorl_cli.agent``).
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

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


def final_number(text: str) -> str | None:
    """The last number in ``text`` (as written), or ``None``."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    return numbers[-1] if numbers else None


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
        ctx.reward = 1.0 if got is not None and got == str(ctx.instance.get("answer")) else 0.0
