"""The README's "Writing a handler" example, run as written on a real deployment.

The handler is cut from README.md and served from a file (``--handlers``);
the model is scripted (fixed turns through a real bridge); the sandbox is a
real bubblewrap one. The tool declared once in the class shows up in the
prompt the chat template rendered, and the model's call of it runs.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from prorl_cli.testing.scripted import TEST_IMAGES, ScriptedStack, turn
from tests.harness import REPO, Deployment


def readme_handler() -> str:
    """The first python block of the README's "Writing a handler" section."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Writing a handler\n"):]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "README 'Writing a handler' has no python example"
    return match.group(1)


def test_the_readme_example_is_short() -> None:
    lines = [line for line in readme_handler().splitlines() if line.strip()]
    assert len(lines) <= 45, f"the README's handler example grew to {len(lines)} lines"


def test_the_readme_handler_runs_end_to_end(tmp_path: Path, tiny_model: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/provision/20-bwrap.sh)")
    rootfs = TEST_IMAGES / "python-rootfs"
    if not rootfs.is_dir():
        pytest.skip(f"test image {rootfs} missing (run scripts/provision/45-test-images.sh as root)")
    handler_file = tmp_path / "count_lines.py"
    handler_file.write_text(readme_handler())
    d = Deployment(tmp_path / "home", "example", config={
        "sandbox": {"runtime": "bwrap", "image": str(rootfs), "local_dir": str(tmp_path / "sb")},
        "inference": {"tokenizer": str(tiny_model), "generate_timeout_s": 60.0},
        "domains": {"count_lines": {"tool_timeout_s": 5}},  # a deployment override of the handler's own setting
    })
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(handler_file))
        stack = ScriptedStack(d, tiny_model, tmp_path / "script.json")
        stack.add("How many lines", turn("Let me count.", ("bash", {"command": "wc -l < /tmp/data.txt"})),
                  "The file has 3 lines.")
        stack.start_model()
        good, bad_setting, missing = stack.run("count_lines", [
            {"lines": 3}, {"lines": 3, "settings": {"max_turn": 2}}, {"line": 3},
        ], timeout_s=120)
    finally:
        d.close()

    assert good.state == "done" and good.reward == 1.0, good
    traj = good.output["trajectory"]
    assert good.output["stop_reason"] == traj["stop_reason"] == "stop" and good.output["turns"] == 2
    assert [m["content"] for m in traj["messages"] if m["role"] == "tool"] == ["3\n"]  # the tool ran in the sandbox
    first_prompt = traj["messages"][0]["content"]
    assert first_prompt.startswith("Use the bash tool")  # the settings' system prompt
    # The schema declared once on the class is in the prompt the chat template rendered.
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(str(tiny_model)).decode(traj["calls"][0]["prompt_ids"])
    assert '"name": "bash"' in rendered and "Run a shell command." in rendered, rendered[:2000]

    assert bad_setting.state == "failed" and bad_setting.critical_error == "init"
    assert "unknown setting 'max_turn'" in bad_setting.error["message"], bad_setting.error
    assert missing.state == "failed" and "lacks field(s) ['lines']" in missing.error["message"], missing.error
