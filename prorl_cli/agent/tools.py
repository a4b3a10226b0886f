"""Tools: one declaration (:class:`Tool`) for the chat template and the loop; call parsing (pluggable).

A :class:`Tool` carries the name, the JSON schema the chat template shows the
model, and the function the agent loop calls, so a tool is declared once.

Parsing reads text only to decide what to *do*; the trajectory keeps the
model's token ids untouched. The default is the Hermes/Qwen format::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

Register another format with :func:`register_tool_parser`. A format whose
results continue the model's own turn rather than a tool message of the chat
template (Search-R1's ``<search>`` ... ``<information>``) is an
:class:`InlineToolParser`; ``search_r1`` is registered (:class:`SearchR1ToolParser`).
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from prorl_cli.exceptions import UnknownToolParser

#: Open and close a reasoning block; the answer (and its tool calls) follows it.
_THINK_START, _THINK_END = "<think>", "</think>"
#: A tool's implementation: ``fn(**arguments) -> str`` (sync or async; other results are JSON-encoded).
ToolFn = Callable[..., Any]


@dataclass(frozen=True)
class Tool:
    """One tool the model may call, declared once.

    ``schema`` is the JSON schema of the arguments (``{"type": "object",
    "properties": ...}``), or a whole OpenAI function schema
    (``{"type": "function", "function": {...}}``) whose name must be ``name``.
    ``fn`` runs the call: ``fn(**arguments)``, or ``fn(ctx, **arguments)`` with
    ``context=True`` (the job's :class:`~prorl_cli.node.handler.JobContext`,
    for tools that use the job's sandbox or settings). ``fn`` may be ``None``
    when every job supplies the implementation (``ctx.agent(..., tools={name: fn})``).
    """

    name: str
    schema: Mapping[str, Any]
    fn: ToolFn | None = None
    description: str = ""
    context: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a tool needs a non-empty name, got {self.name!r}")
        if not isinstance(self.schema, Mapping):
            raise ValueError(f"tool {self.name!r}: schema must be a JSON-schema mapping, got {type(self.schema).__name__}")
        if self.schema.get("type") == "function":
            declared = (self.schema.get("function") or {}).get("name")
            if declared != self.name:
                raise ValueError(f"tool {self.name!r}: its function schema is named {declared!r}")
        elif self.schema.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: schema must be an object schema or a function schema, "
                             f"got type {self.schema.get('type')!r}")

    def spec(self) -> dict[str, Any]:
        """The OpenAI function schema the chat template renders (``tools=[...]``)."""
        if self.schema.get("type") == "function":
            return json.loads(json.dumps(self.schema))
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(json.dumps(self.schema))
        return {"type": "function", "function": function}


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
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn.

    Reasoning before ``</think>`` (Qwen3, DeepSeek-R1), or after a ``<think>``
    never closed, is skipped: a call drafted while thinking is not a call (see
    :func:`_after_reasoning`). The turn's last call may lack its
    ``</tool_call>`` (the model ended the turn right after the JSON); it counts
    when its JSON is a whole call, and is ignored otherwise (a turn cut short).
    """

    pattern = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        text = _after_reasoning(text)
        calls = []
        for match in self.pattern.finditer(text):
            raw = match.group(1).strip()
            closed = bool(match.group(2))
            try:
                obj = json.loads(raw)
            except ValueError as e:
                if closed:
                    calls.append(ToolCall("", raw=raw, error=f"tool call is not valid JSON: {e}"))
                continue
            if not closed and not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
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


def _after_reasoning(text: str) -> str:
    """The part of a turn after its reasoning block (where calls are made); all of it when there is none.

    A turn that opens with ``<think>`` reasons up to the first ``</think>``; one cut before it made no
    call. A template may open the block in the prompt (only ``</think>`` in the output): then a
    ``</think>`` inside a call's arguments (a file being written) is text, not the end of a thought.
    """
    if text.lstrip().startswith(_THINK_START):
        end = text.find(_THINK_END)
        return "" if end < 0 else text[end + len(_THINK_END) :]
    end = text.find(_THINK_END)
    while end >= 0:
        before = text[:end]
        if before.count("<tool_call>") <= before.count("</tool_call>"):
            return text[end + len(_THINK_END) :]
        end = text.find(_THINK_END, end + 1)
    return text


class InlineToolParser(abc.ABC):
    """A tool format whose results are appended to the model's own turn, not as chat-template tool turns.

    The agent loop (:func:`~prorl_cli.agent.run_tool_agent`) keeps each model output only up to the end of
    its action (:meth:`action_end`: the first complete call, or the answer), parses that, appends
    :meth:`observation` as plain text right after it (masked out of the loss, token-exact: the ids of that
    text alone) and samples the continuation of the same assistant turn.

    :attr:`stop`: strings the loop adds to every call's ``sampling.stop``, so the engine stops at the
    action's closing tag instead of generating past it; the cut at :meth:`action_end` stays, for an engine
    that does not stop there (one that cannot match stop strings, or a tag with nothing opened before it).
    """

    #: Closing tags of the format's actions, sent as stop strings (empty: the engine is not told).
    stop: tuple[str, ...] = ()

    @abc.abstractmethod
    def action_end(self, text: str) -> int | None:
        """Where the first complete action of ``text`` ends (just past its closing tag); ``None``: none is."""

    @abc.abstractmethod
    def parse(self, text: str) -> list[ToolCall]:
        """The calls of a turn cut at its action: ``[]`` when the turn ends the rollout (an answer)."""

    @abc.abstractmethod
    def observation(self, calls: list[ToolCall], results: list[str]) -> str:
        """The text appended to the turn after ``calls`` ran with ``results``."""


#: Search-R1's action: the first tag pair, search or answer, as its environment reads a turn.
_SEARCH_R1_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_SEARCH_R1_CLOSE = re.compile(r"</(search|answer)>")
#: The note Search-R1's environment appends to a turn with neither action: the model was trained to read it.
SEARCH_R1_INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> "
                     "and </search>. If I want to give the final answer, I should put the answer between <answer> "
                     "and </answer>. Let me try again.\n")


class SearchR1ToolParser(InlineToolParser):
    """Search-R1's tag protocol: ``<search> query </search>``, results in ``<information>``, ``<answer>`` ends.

    A turn is cut where its first ``</search>`` or ``</answer>`` closes an opened tag (Search-R1 cuts its
    generations there too). A search is the call ``search(query=...)``; its result comes back as
    ``\\n\\n<information>RESULT</information>\\n\\n``. A turn with neither action gets
    :data:`SEARCH_R1_INVALID` and the model goes on, as in Search-R1's environment. Reasoning is not
    skipped: Search-R1 reads the first action wherever it stands. Calls stop at the first ``</search>`` or
    ``</answer>`` (:attr:`stop`), where Search-R1 cuts its generations; one closing a tag never opened
    leaves a turn with no action, which gets the note.
    """

    stop = ("</search>", "</answer>")

    def action_end(self, text: str) -> int | None:
        for close in _SEARCH_R1_CLOSE.finditer(text):
            if text.rfind(f"<{close.group(1)}>", 0, close.start()) >= 0:
                return close.end()
        return None

    def parse(self, text: str) -> list[ToolCall]:
        match = _SEARCH_R1_ACTION.search(text)
        if match is None:
            return [ToolCall("", raw=text, error="neither <search> nor <answer>")]
        if match.group(1) == "answer":
            return []
        return [ToolCall("search", {"query": match.group(2).strip()}, match.group(0))]

    def observation(self, calls: list[ToolCall], results: list[str]) -> str:
        return "".join(SEARCH_R1_INVALID if call.error else f"\n\n<information>{result.strip()}</information>\n\n"
                       for call, result in zip(calls, results, strict=True))


_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser, "search_r1": SearchR1ToolParser}


def register_tool_parser(name: str, factory: Callable[[], ToolParser]) -> None:
    """Make a parser available by name (``get_tool_parser(name)``); an :class:`InlineToolParser` too."""
    _PARSERS[name] = factory


def get_tool_parser(name: str = "hermes") -> ToolParser:
    """A parser by name; an unknown name raises :class:`UnknownToolParser` (a ``KeyError``) naming the registered ones."""
    factory = _PARSERS.get(name)
    if factory is None:
        raise UnknownToolParser(f"unknown tool parser {name!r}; registered: {sorted(_PARSERS)} "
                                "(add one with register_tool_parser)")
    return factory()
