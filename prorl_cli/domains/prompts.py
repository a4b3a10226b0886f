"""A task instance's own chat prompt: the messages a dataset row carries (verl's ``prompt`` column).

The loader keeps a row's prompt in the instance and the handler that prompts with it reads it back; both
check it with :func:`chat_prompt`, so a malformed one is refused where it is met, naming the field, rather
than replaced by a default prompt that the rows never asked for.
"""

from __future__ import annotations

from typing import Any

from prorl_cli.exceptions import DomainError

#: The tags Search-R1's instruction asks a model to write (``<search> q </search>``, ``<answer> a </answer>``):
#: a prompt naming both asks for its tag protocol (``tool_format: search_r1`` of the search task).
SEARCH_R1_MARKS = ("<search>", "<answer>")


def _kind(value: Any) -> str:
    """``value``'s type as a message names it (``null``, ``mapping``, ``str``)."""
    return "null" if value is None else "mapping" if isinstance(value, dict) else type(value).__name__


def chat_prompt(value: Any, field: str = "prompt") -> list[dict[str, str]]:
    """``value`` as chat messages ``[{"role": ..., "content": ...}]``, each role and content text.

    A message's other keys are dropped (a Parquet struct column gives every message every key the file's
    messages have, ``null`` where one has none). Anything else raises :class:`DomainError` naming the field
    (``prompt[1].content``): an empty list, a message that is not a mapping, a role or content that is not text.
    """
    if not isinstance(value, list):
        raise DomainError(f"field {field!r} is {_kind(value)}, expected chat messages: a list of {{role, content}}")
    if not value:
        raise DomainError(f"field {field!r} is an empty list, expected chat messages: a list of {{role, content}}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise DomainError(f"field '{field}[{i}]' is {_kind(message)}, expected a message {{role, content}}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DomainError(f"field '{field}[{i}].{key}' is {_kind(message.get(key))}, expected text")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def asks_for_search_r1_tags(prompt: Any) -> bool:
    """Whether a chat prompt (checked or not) carries Search-R1's inline instructions: its messages' text names
    both of :data:`SEARCH_R1_MARKS`."""
    if not isinstance(prompt, list):
        return False
    text = "".join(m["content"] for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
    return all(mark in text for mark in SEARCH_R1_MARKS)
