"""The README's "Writing a handler" example and every example of docs/handlers.md, run as written.

Each handler is cut from its document into a file of one folder that a real
node serves (``--handlers``); the model is scripted (fixed turns through a
real bridge); sandboxes are real bubblewrap ones. One deployment serves
every example, and their jobs run in one batch (starting the stack is most
of the cost). A handler written against the old contract (``ctx.chat()``,
``ctx.state["sandbox"]``, ``Trajectory.from_dict(ctx.output[...])``,
``extra["tool_timeout_s"]``, ``domains.<name>``) runs beside them unchanged.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.testing.scripted import TEST_IMAGES, ScriptedStack, turn
from tests.harness import REPO, Deployment

#: The README's handler as it was before the explicit contract (kept to prove old handlers still run).
LEGACY_HANDLER = '''
import re

from prorl_cli.agent import Tool, Trajectory
from prorl_cli.node.handler import AgentHandler, HandlerSettings, JobContext, final_text


async def bash(ctx: JobContext, command: str) -> str:
    result = await ctx.state["sandbox"].bash(command, timeout_s=ctx.settings.get("tool_timeout_s"))
    return result.output or f"(no output, exit code {result.exit_code})"


class OldCountLines(AgentHandler):
    name = "old_count_lines"
    defaults = HandlerSettings(max_turns=4, system_prompt="Use the bash tool to look at /tmp/data.txt.",
                               extra={"tool_timeout_s": 10.0})
    tools = [Tool("bash", {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
                  bash, description="Run a shell command.", context=True)]
    required_fields = ("lines",)

    async def init(self, ctx: JobContext) -> None:
        ctx.state["sandbox"] = sandbox = await ctx.start_sandbox(network=False)
        text = "".join(f"line {i}\\n" for i in range(int(ctx.instance["lines"])))
        await sandbox.write_file("/tmp/data.txt", text.encode())
        await ctx.chat()

    async def run(self, ctx: JobContext) -> None:
        await ctx.agent("How many lines does /tmp/data.txt have?")

    async def eval(self, ctx: JobContext) -> None:
        ctx.output["tool_timeout_s"] = ctx.settings.get("tool_timeout_s")
        answer = re.findall(r"\\d+", final_text(Trajectory.from_dict(ctx.output["trajectory"])))
        ctx.reward = 1.0 if answer and int(answer[-1]) == int(ctx.instance["lines"]) else 0.0
'''

PATIENT_RUN_LIMIT_S = 8.0  # the first call and its tool finish well within it; the second call sleeps far past it


def readme_handler() -> str:
    """The first python block of the README's "Writing a handler" section."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Writing a handler\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README 'Writing a handler' has no python example"
    return match.group(1)


def doc_handlers() -> dict[str, str]:
    """docs/handlers.md's complete handlers (python blocks defining an AgentHandler), by task name."""
    found = {}
    for block in re.findall(r"```python\n(.*?)```", (REPO / "docs" / "handlers.md").read_text(), re.DOTALL):
        if "(AgentHandler):" in block:
            name = re.search(r'^    name = "(\w+)"', block, re.MULTILINE)
            assert name is not None, block[:200]
            found[name.group(1)] = block
    return found


def code_lines(source: str) -> list[str]:
    """Lines that are code: not blank, not a comment, not the module docstring."""
    return [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith(("#", '"""'))]


def test_the_examples_are_short() -> None:
    assert len(code_lines(readme_handler())) <= 24, "the README's handler example grew"
    assert len(code_lines(doc_handlers()["word_count"])) <= 20, "docs/handlers.md's smallest tool handler grew"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, Any]]:
    """Every example's jobs, run in one batch on one deployment: results by case name (and the node's log)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/provision/20-bwrap.sh)")
    rootfs = TEST_IMAGES / "python-rootfs"
    if not rootfs.is_dir():
        pytest.skip(f"test image {rootfs} missing (run scripts/provision/45-test-images.sh as root)")
    tmp_path = tmp_path_factory.mktemp("handler-examples")
    served = tmp_path / "handlers"
    served.mkdir()
    (served / "count_lines.py").write_text(readme_handler())
    (served / "old_count_lines.py").write_text(LEGACY_HANDLER)
    for name, source in doc_handlers().items():
        (served / f"{name}.py").write_text(source)
    d = Deployment(tmp_path / "home", "examples", config={
        "sandbox": {"runtime": "bwrap", "image": str(rootfs), "local_dir": str(tmp_path / "sb")},
        "inference": {"tokenizer": str(tiny_model), "generate_timeout_s": 60.0},
        "handlers": {"count_lines": {"tool_timeout_s": 5}},  # a deployment override of a handler setting
        "domains": {"old_count_lines": {"tool_timeout_s": 4}},  # the section's old name, still read
    })
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(served))
        stack = ScriptedStack(d, tiny_model, tmp_path / "script.json")
        stack.add("How many lines", turn("Let me count.", ("bash", {"command": "wc -l < /tmp/data.txt"})),
                  "The file has 3 lines.")
        stack.add("[W] red green blue", turn("", ("count_words", {"text": "[W] red green blue"})), "There are 4 words.")
        stack.add("The file is /tmp/poem.txt.",
                  turn("", ("editor", {"command": "str_replace", "path": "/tmp/poem.txt", "old_str": "Rosse",
                                       "new_str": "Roses"}), ("bash", {"command": "cat /tmp/poem.txt"})),
                  "done")
        stack.add("What is the value of answer-key?", turn("", ("lookup", {"key": "answer-key"})), "The value is 42.")
        stack.add("[patient]", turn("", ("step", {"n": 1})), "<<sleep:300>>never read")
        stack.start_model()
        cases = {
            "count_lines": ("count_lines", {"lines": 3}),
            "count_lines bad setting": ("count_lines", {"lines": 3, "settings": {"max_turn": 2}}),
            "count_lines missing field": ("count_lines", {"line": 3}),
            "old_count_lines": ("old_count_lines", {"lines": 3}),
            "word_count": ("word_count", {"text": "[W] red green blue"}),
            "fix_typo": ("fix_typo", {"text": "Rosse are red\n", "fixed": "Roses are red\n"}),
            "lookup": ("lookup", {"key": "answer-key", "table": {"answer-key": 42, "other": 7}}),
            "patient": ("patient", {"task": "[patient] take steps", "settings": {"run_timeout_s": PATIENT_RUN_LIMIT_S}}),
        }
        client = d.client
        ids = {case: client.submit(task, [instance], timeout_s=120)[0] for case, (task, instance) in cases.items()}
        by_id = {r.job_id: r for r in client.wait(list(ids.values()), timeout_s=180)}
        out: dict[str, Any] = {case: by_id[job_id] for case, job_id in ids.items()}
        out["node log"] = (d.logs / "n1.log").read_text()
        yield out
    finally:
        d.close()


def tool_results(result: Any) -> list[str]:
    return [m["content"] for m in result.output["trajectory"]["messages"] if m["role"] == "tool"]


def test_the_readme_handler_runs_end_to_end(results: dict[str, Any], tiny_model: Path) -> None:
    good = results["count_lines"]
    assert good.state == "done" and good.reward == 1.0, good
    traj = good.output["trajectory"]
    assert good.output["stop_reason"] == traj["stop_reason"] == "stop" and good.output["turns"] == 2
    assert tool_results(good) == ["3\n"]  # the shipped bash tool ran in ctx.sandbox
    first_prompt = traj["messages"][0]["content"]
    assert first_prompt.startswith("Use the bash tool")  # the settings' system prompt
    # The schema declared once on the class is in the prompt the chat template rendered.
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(str(tiny_model)).decode(traj["calls"][0]["prompt_ids"])
    assert '"name": "bash"' in rendered and "Run a shell command in /work" in rendered, rendered[:2000]

    bad_setting, missing = results["count_lines bad setting"], results["count_lines missing field"]
    assert bad_setting.state == "failed" and bad_setting.critical_error == "init"
    assert bad_setting.error["type"] == "SettingsError", bad_setting.error
    assert "unknown setting 'max_turn'" in bad_setting.error["message"], bad_setting.error
    assert missing.state == "failed" and "lacks field(s) ['lines']" in missing.error["message"], missing.error


def test_a_handler_written_for_the_old_contract_still_runs(results: dict[str, Any]) -> None:
    old = results["old_count_lines"]
    assert old.state == "done" and old.reward == 1.0, old
    assert old.output["stop_reason"] == "stop" and old.output["turns"] == 2
    assert tool_results(old) == ["3\n"]
    assert old.output["tool_timeout_s"] == 4.0  # its extra setting, overridden under the old domains.<name>
    assert "domains.old_count_lines is deprecated; rename it handlers.old_count_lines" in results["node log"]


def test_every_docs_example_is_run_here() -> None:
    assert set(doc_handlers()) == {"word_count", "fix_typo", "lookup", "patient"}


def test_docs_smallest_tool_handler(results: dict[str, Any]) -> None:
    r = results["word_count"]
    assert r.state == "done" and r.reward == 1.0, r
    assert tool_results(r) == ["4"] and r.output["turns"] == 2


def test_docs_init_example_uses_the_sandbox_and_its_shipped_tools(results: dict[str, Any]) -> None:
    r = results["fix_typo"]
    assert r.state == "done" and r.reward == 1.0, r
    assert r.output["text"] == "Roses are red\n"
    # No tool_timeout_s anywhere: the shipped tools use the sandbox's own limit.
    assert tool_results(r)[1] == "Roses are red\n", tool_results(r)


def test_docs_run_example_wraps_generate_and_still_records(results: dict[str, Any]) -> None:
    r = results["lookup"]
    assert r.state == "done" and r.reward == 1.0, r
    assert tool_results(r) == ["42"]  # the per-job implementation of the declared tool
    calls = r.output["trajectory"]["calls"]
    assert len(calls) == 2 and r.output["prompt_sizes"] == [len(c["prompt_ids"]) for c in calls]


def test_docs_eval_example_scores_the_partial_trajectory(results: dict[str, Any]) -> None:
    r = results["patient"]
    assert r.state == "timed_out" and r.critical_error == "run", r
    assert r.error["type"] == "StageTimeout" and f"{PATIENT_RUN_LIMIT_S:.3f}" in r.error["message"], r.error
    traj = r.output["trajectory"]
    assert len(traj["calls"]) == 1 and traj["stop_reason"] == r.output["stop_reason"] == "timeout"
    assert r.output["calls_before_failure"] == 1 and r.output["failure"]["type"] == "StageTimeout"
    assert r.reward == pytest.approx(0.1)  # EVAL after the timed-out RUN: one step of ten
