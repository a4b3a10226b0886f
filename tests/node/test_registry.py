"""Handler discovery: the built-in package, ``--handlers`` paths and package names, and entry points."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prorl_cli.node.registry import discover

HANDLER = '''
from prorl_cli.node.handler import AgentHandler

class {cls}(AgentHandler):
    name = "{name}"
    async def init(self, ctx): pass
    async def run(self, ctx): pass
    async def eval(self, ctx): ctx.reward = 1.0
'''


def test_builtins_paths_package_names_and_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRORL_HANDLER_PATHS", raising=False)
    (tmp_path / "mine.py").write_text(HANDLER.format(cls="Mine", name="mine"))
    site = tmp_path / "site"
    (site / "ep_demo-0.1.dist-info").mkdir(parents=True)
    (site / "ep_demo-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-demo\nVersion: 0.1\n")
    (site / "ep_demo-0.1.dist-info" / "entry_points.txt").write_text("[prorl.handlers]\nep = ep_handler:FromEntryPoint\n")
    (site / "ep_handler.py").write_text(HANDLER.format(cls="FromEntryPoint", name="from_entry_point"))
    monkeypatch.syspath_prepend(str(site))
    reg = discover([str(tmp_path / "mine.py"), "prorl_cli.testing.handlers"])
    assert reg.errors == []
    assert {"math", "code", "swe", "search", "math_agent"} <= set(reg.tasks)  # built-in
    assert reg.origins["mine"] == str(tmp_path / "mine.py")
    assert reg.origins["from_entry_point"] == "entry point ep"
    # A file inside an importable package is imported under its package name: one class identity.
    from prorl_cli.testing.handlers.testing import ScriptedTestHandler

    assert reg.get("test") is ScriptedTestHandler
    assert discover([str(Path(sys.modules["prorl_cli.testing.handlers.testing"].__file__ or ""))]).get("test") \
        is ScriptedTestHandler


def test_bad_handler_sources_are_reported_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRORL_HANDLER_PATHS", raising=False)
    (tmp_path / "broken.py").write_text("x = 1\nraise RuntimeError('boom')\n")
    (tmp_path / "twice.py").write_text(HANDLER.format(cls="Twice", name="math"))
    reg = discover([str(tmp_path / "broken.py"), str(tmp_path / "twice.py"), str(tmp_path / "absent")])
    errors = "\n".join(reg.errors)
    assert f"{tmp_path / 'broken.py'}:2: import failed: RuntimeError: boom" in errors
    assert "task 'math' is defined twice" in errors
    assert "absent: handler path does not exist" in errors


def test_bad_handler_settings_in_the_config_stop_the_node_at_start(tmp_path: Path) -> None:
    import subprocess

    from prorl_cli.config import config_from_dict
    from tests.harness import Deployment

    reg = discover()
    assert reg.settings_errors(config_from_dict({"handlers": {"math": {"max_turns": 3}, "other": {"x": 1}}})) == []
    assert reg.settings_errors(config_from_dict({"handlers": {"math": {"tools": ["python", "shell"]}}})) == [
        "prorl.yaml: handlers.math: tools ['shell'] do not exist; math offers ['python']"]
    d = Deployment(tmp_path / "home", "badset", config={"domains": {"code": {"test_mem_mb": "lots"}}})
    try:
        proc = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", "badset", "serve", "node"],
                              env=d.env(), capture_output=True, text=True, timeout=60)
    finally:
        d.close()
    assert proc.returncode != 0
    assert "badset.yaml: domains.code.test_mem_mb: expected a positive number, got 'lots'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_tool_is_declared_once_for_the_template_and_the_loop() -> None:
    from prorl_cli.agent import Tool, tool_functions

    def add(a: int, b: int) -> int:
        return a + b

    tool = Tool("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}, add,
                description="Add two numbers.")
    assert tool.spec() == {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                                           "parameters": dict(tool.schema)}}
    full = Tool("add", tool.spec(), add)
    assert full.spec() == tool.spec()
    assert tool_functions([tool]) == {"add": add}
    with pytest.raises(ValueError, match="function schema is named 'plus'"):
        Tool("add", {"type": "function", "function": {"name": "plus"}}, add)
    with pytest.raises(ValueError, match="must be an object schema"):
        Tool("add", {"type": "string"}, add)
    with pytest.raises(ValueError, match="needs a job context"):
        tool_functions([Tool("add", tool.schema, add, context=True)])


def test_a_named_task_whose_source_failed_to_import_is_reported_by_that_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--task count_lines`` with a broken count_lines.py: the import failure (file, line, error) comes first,
    not only "unknown task", which would send the user hunting for a typo in the name."""
    from prorl_cli.exceptions import HandlerError

    monkeypatch.delenv("PRORL_HANDLER_PATHS", raising=False)
    broken = tmp_path / "count_lines.py"
    broken.write_text(HANDLER.format(cls="CountLines", name="count_lines").replace("async def init(self, ctx):",
                                                                                  "async def init(self, ctx)"))
    with pytest.raises(HandlerError) as caught:
        discover([str(broken)], only=["count_lines"])
    message = str(caught.value)
    assert message.startswith(f"{broken}:6: import failed: SyntaxError"), message
    assert message.index("import failed") < message.index("node.tasks names unknown task(s) ['count_lines']")
    # A mistyped package name is reported as what it is, too.
    with pytest.raises(HandlerError, match=r"^prorl_cli\.testing\.handler: handler path does not exist; "
                                           r"node\.tasks names unknown task\(s\) \['noop'\]"):
        discover(["prorl_cli.testing.handler"], only=["noop"])
