"""The sandbox tools the domains offer a model (``bash``, ``editor``, ``python``) and their JSON schemas."""

from __future__ import annotations

from typing import Any

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


def sandbox_tools(sandbox: Any, timeout_s: float) -> dict[str, Any]:
    """``bash`` and ``editor`` over a sandbox (the code and swe domains)."""

    async def bash(command: str) -> str:
        r = await sandbox.bash(str(command), timeout_s=timeout_s)
        tail = f"\n[exit code {r.exit_code}]" if r.exit_code not in (0, None) else ""
        if r.timed_out:
            tail += f"\n[stopped after {timeout_s:g} s]"
        return (r.output + tail) or "(no output)"

    async def editor(command: str, path: str, file_text: str | None = None, old_str: str | None = None,
                     new_str: str | None = None, insert_line: int | None = None) -> str:
        r = await sandbox.edit(command, path, file_text=file_text, old_str=old_str, new_str=new_str,
                               insert_line=insert_line)
        return str(r.output)

    return {"bash": bash, "editor": editor}
