"""The sandbox tools any handler may offer a model (``bash``, ``editor``, ``python``), each declared once.

Each :class:`~prorl_cli.agent.Tool` here runs in the job's sandbox,
``ctx.sandbox`` (the first sandbox the handler's INIT started), each call
bounded by the ``tool_timeout_s`` setting (unset: the sandbox's default,
``sandbox.tool_timeout_s``). Declare them in ``tools``; see docs/handlers.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from prorl_cli.agent.tools import Tool

if TYPE_CHECKING:
    from prorl_cli.node.handler import JobContext
    from prorl_cli.sandbox.sandbox import EditCommand

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


def _timeout_s(ctx: JobContext) -> float:
    """This job's limit of one tool call: the setting, else the sandbox's own default."""
    timeout_s = ctx.settings.tool_timeout_s
    return float(timeout_s if timeout_s is not None else ctx.sandbox.tool_timeout_s)


async def bash(ctx: JobContext, command: str) -> str:
    """Run ``command`` in the job's persistent shell."""
    timeout_s = _timeout_s(ctx)
    r = await ctx.sandbox.bash(str(command), timeout_s=timeout_s)
    tail = f"\n[exit code {r.exit_code}]" if r.exit_code not in (0, None) else ""
    if r.timed_out:
        tail += f"\n[stopped after {timeout_s:g} s]"
    return (r.output + tail) or "(no output)"


async def editor(ctx: JobContext, command: str, path: str, file_text: str | None = None, old_str: str | None = None,
                 new_str: str | None = None, insert_line: int | None = None) -> str:
    """View or edit a file in the job's sandbox."""
    # The model's command goes as it is: the sandbox's tool server refuses an unknown one (the model sees why).
    r = await ctx.sandbox.edit(cast("EditCommand", command), path, file_text=file_text, old_str=old_str, new_str=new_str,
                               insert_line=insert_line)
    return str(r.output)


async def python(ctx: JobContext, code: str) -> str:
    """Run ``code`` in the job's persistent Python namespace."""
    timeout_s = _timeout_s(ctx)
    r = await ctx.sandbox.python(str(code), timeout_s=timeout_s)
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
