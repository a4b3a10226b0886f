"""A calculator agent: a plain OpenAI-SDK program for any OpenAI-compatible endpoint.

    OPENAI_BASE_URL=http://host/v1 OPENAI_API_KEY=... python calculator_agent.py task.txt   # or the task on stdin

It sends the task with one function tool, ``calculator``, evaluates each call
(arithmetic only, through ``ast``; nothing is executed), sends the results back
and stops at the first reply without a tool call (or after ``MAX_TURNS``
model calls), printing that reply. ``OPENAI_MODEL`` names the model (default
``prorl``). The conversation is only ever appended to, replies sent back as
the endpoint returned them.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys
from pathlib import Path
from typing import Any

SYSTEM = "You are a careful math assistant. Use the calculator tool, then give the final answer as \\boxed{N}."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TURNS = 3
_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression of numbers, + - * / and parentheses, or ``error: ...``."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)[:80]}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
        return str(int(result)) if float(result).is_integer() else str(result)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {e}"


def main() -> int:
    from openai import OpenAI

    task = Path(sys.argv[1]).read_text() if len(sys.argv) > 1 else sys.stdin.read()
    client, model = OpenAI(), os.environ.get("OPENAI_MODEL", "prorl")
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.strip()}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message  # type: ignore[arg-type]
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            try:
                expression = str(json.loads(call.function.arguments).get("expression", ""))  # type: ignore[union-attr]
            except (json.JSONDecodeError, AttributeError) as e:
                expression = f"<bad arguments: {e}>"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    print(reply.content or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
