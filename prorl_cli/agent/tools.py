"""Tool-call parsing from decoded model output (pluggable).

Parsing reads text only to decide what to *do*; the trajectory keeps the
model's token ids untouched. The default is the Hermes/Qwen format::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

Register another format with :func:`register_tool_parser`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolCall:
    """One call the model asked for. ``error`` is set when the call could not be parsed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


class ToolParser(Protocol):
    """Finds tool calls in an assistant turn's text."""

    def parse(self, text: str) -> list[ToolCall]: ...


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn."""

    pattern = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for match in self.pattern.finditer(text):
            raw = match.group(1).strip()
            try:
                obj = json.loads(raw)
            except ValueError as e:
                calls.append(ToolCall("", raw=raw, error=f"tool call is not valid JSON: {e}"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls.append(ToolCall("", raw=raw, error="tool call must be a JSON object with a string 'name'"))
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models emit the arguments JSON-encoded a second time
                try:
                    args = json.loads(args)
                except ValueError as e:
                    calls.append(ToolCall(obj["name"], raw=raw, error=f"tool call arguments are not JSON: {e}"))
                    continue
            if not isinstance(args, dict):
                calls.append(ToolCall(obj["name"], raw=raw, error="tool call 'arguments' must be an object"))
                continue
            calls.append(ToolCall(obj["name"], args, raw))
        return calls


_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser}


def register_tool_parser(name: str, factory: Callable[[], ToolParser]) -> None:
    """Make a parser available by name (``get_tool_parser(name)``)."""
    _PARSERS[name] = factory


def get_tool_parser(name: str = "hermes") -> ToolParser:
    """A parser by name; :class:`KeyError` names the known ones."""
    try:
        return _PARSERS[name]()
    except KeyError:
        raise KeyError(f"unknown tool parser {name!r}; known: {sorted(_PARSERS)}") from None
