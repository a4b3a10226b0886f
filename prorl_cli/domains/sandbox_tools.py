"""The sandbox tools the domains offer a model (``bash``, ``editor``, ``python``), each declared once.

Each :class:`~prorl_cli.agent.Tool` here runs in the job's sandbox,
``ctx.state["sandbox"]`` (started by the handler's INIT), with the handler's
``tool_timeout_s`` setting.
"""

from __future__ import annotations

from typing import Any

from prorl_cli.agent.tools import Tool
from prorl_cli.exceptions import DomainError

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a persistent session (sympy is installed); returns stdout and the last expression's value.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
BASH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in /work (persistent shell); returns its output and exit code.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
EDITOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "editor",
        "description": "View, create or edit files: command is view, create, str_replace, insert or undo.",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo"]},
                "path": {"type": "string"},
                "file_text": {"type": "string"},
                "old_str": {"type": "string"},
                "new_str": {"type": "string"},
                "insert_line": {"type": "integer"},
            },
            "required": ["command", "path"],
        },
    },
}


def _sandbox(ctx: Any) -> Any:
    sandbox = ctx.state.get("sandbox")
    if sandbox is None:
        raise DomainError(f"{ctx.task}: no sandbox in ctx.state['sandbox'] (INIT starts it)")
    return sandbox


async def bash(ctx: Any, command: str) -> str:
    """Run ``command`` in the job's persistent shell."""
    timeout_s = float(ctx.settings.get("tool_timeout_s"))
    r = await _sandbox(ctx).bash(str(command), timeout_s=timeout_s)
    tail = f"\n[exit code {r.exit_code}]" if r.exit_code not in (0, None) else ""
    if r.timed_out:
        tail += f"\n[stopped after {timeout_s:g} s]"
    return (r.output + tail) or "(no output)"


async def editor(ctx: Any, command: str, path: str, file_text: str | None = None, old_str: str | None = None,
                 new_str: str | None = None, insert_line: int | None = None) -> str:
    """View or edit a file in the job's sandbox."""
    r = await _sandbox(ctx).edit(command, path, file_text=file_text, old_str=old_str, new_str=new_str,
                                 insert_line=insert_line)
    return str(r.output)


async def python(ctx: Any, code: str) -> str:
    """Run ``code`` in the job's persistent Python namespace."""
    timeout_s = float(ctx.settings.get("tool_timeout_s"))
    r = await _sandbox(ctx).python(str(code), timeout_s=timeout_s)
    parts = [r.stdout.rstrip()] if r.stdout.strip() else []
    if r.result is not None:
        parts.append(r.result)
    if r.error:
        parts.append(f"error: {r.error}")
    if r.timed_out:
        parts.append(f"(stopped after {timeout_s:g} s)")
    return "\n".join(parts) or "(no output)"


BASH = Tool("bash", BASH_SCHEMA, bash, context=True)
EDITOR = Tool("editor", EDITOR_SCHEMA, editor, context=True)
PYTHON = Tool("python", PYTHON_SCHEMA, python, context=True)
