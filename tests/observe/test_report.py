"""`prorl inspect` on a trajectory with a continuity violation, and `prorl report --html` in a real headless Chromium."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent.chat import ChatTokens
from prorl_cli.agent.loop import TokenSession
from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import JobResult, SamplingParams
from tests.observe.conftest import ObservedRun


class ScriptedModel:
    """Fixed assistant turns as token ids through the generate contract."""

    def __init__(self, chat: ChatTokens, texts: list[str]) -> None:
        self.outputs = [chat.encode(t) for t in texts]

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        ids = self.outputs.pop(0)
        return Generation(ids, [-0.25 - 0.01 * k for k in range(len(ids))], "stop", "scripted")


def _session(chat: ChatTokens, retokenize: bool) -> dict[str, Any]:
    tool_turn = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    session = TokenSession(chat, ScriptedModel(chat, [tool_turn, "five<|im_end|>"]), [{"role": "user", "content": "2+3?"}])
    asyncio.run(session.generate(SamplingParams()))
    session.add_messages([{"role": "tool", "name": "add", "content": "5"}])
    prompt = None
    if retokenize:  # a handler that re-tokenizes its prompt text breaks token continuity: it must show
        prompt = chat.encode(chat.decode(session.prompt_ids).replace("2+3?", "2 + 3?"))
        assert prompt != session.prompt_ids
    asyncio.run(session.generate(SamplingParams(), prompt_ids=prompt))
    return session.trajectory.to_dict()


@pytest.fixture(scope="module")
def results_file(observed_run: ObservedRun, tiny_model: Path) -> Path:
    """The observed run's results plus two chat trajectories, one with a continuity violation."""
    chat = ChatTokens.from_pretrained(tiny_model)
    extra = [JobResult(job_id=f"chat-{k}", task="chat", state="done", reward=1.0, node_id="n1",
                       output={"trajectory": _session(chat, retokenize=k == "viol")}) for k in ("clean", "viol")]
    path = observed_run.results_path.parent / "with_chat.jsonl"
    path.write_text(observed_run.results_path.read_text() + "".join(json.dumps(r.to_wire()) + "\n" for r in extra))
    return path


def test_inspect_shows_the_continuity_violation(observed_run: ObservedRun, results_file: Path, tiny_model: Path) -> None:
    out = observed_run.prorl("inspect", str(results_file), "--violations", "--tokenizer", str(tiny_model))
    assert out.returncode == 0, out.stderr
    assert "chat-viol" in out.stdout and "chat-clean" not in out.stdout and "obs-0-0" not in out.stdout
    assert "CONTINUITY BROKEN" in out.stdout
    assert "continuity violation at call 1" in out.stdout and "not a token-exact extension" in out.stdout
    assert "1 of 8 result(s)" in out.stdout
    # The clean one: only the new prompt tokens of call 1 (the tool result), decoded; the tool call; the observation.
    out = observed_run.prorl("inspect", str(results_file), "--job", "chat-clean", "--tokenizer", str(tiny_model))
    assert out.returncode == 0, out.stderr
    assert "CONTINUITY" not in out.stdout and "violation" not in out.stdout
    assert "tool call: add({'a': 2, 'b': 3})" in out.stdout and "tool add: 5" in out.stdout
    assert "<tool_response>" in out.stdout  # call 1's new prompt tokens, decoded
    assert re.search(r"logprobs mean -0\.\d+, min -0\.\d+ at output token \d+", out.stdout)
    # Filters over the real run's results: state and reward.
    out = observed_run.prorl("inspect", str(results_file), "--task", "obs", "--state", "failed")
    assert out.returncode == 0 and "2 of 8 result(s)" in out.stdout and "failed on purpose" in out.stdout
    out = observed_run.prorl("inspect", str(results_file), "--task", "obs", "--max-reward", "-1")
    assert out.returncode == 1 and "no result matches" in out.stderr
    out = observed_run.prorl("inspect", str(results_file), "--state", "nosuch")
    assert out.returncode == 2 and "'nosuch' is not one of" in out.stderr, out.stderr
    # On a narrow terminal (or piped: 80 columns) the header wraps inside its panel, its stage times included.
    narrow = subprocess.run([sys.executable, "-m", "prorl_cli", "inspect", str(results_file), "--task", "obs",
                             "--state", "failed", "--limit", "1"],
                            env={**observed_run.deployment.env(), "COLUMNS": "60"}, capture_output=True, text=True,
                            timeout=120)
    assert narrow.returncode == 0, narrow.stderr
    flat = " ".join(narrow.stdout.replace("│", " ").split())
    assert re.search(r"\b(init|run|eval) \d+\.\d{3}s", flat), narrow.stdout


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (scripts/provision/60-chromium.sh installs it)")
    return exe


def _open_in_chromium(exe: str, page: Path, shot: Path) -> list[str]:
    """Load ``page`` in headless Chromium, save a screenshot; return the page's console messages."""
    out = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", "--hide-scrollbars",
         f"--screenshot={shot}", "--window-size=1400,1800", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert shot.exists(), out.stderr[-3000:]
    return [line for line in out.stderr.splitlines() if ":CONSOLE" in line]


def test_report_loads_in_headless_chromium_with_its_plots(observed_run: ObservedRun, results_file: Path) -> None:
    exe = _chromium()
    page = results_file.parent / "report.html"
    out = observed_run.prorl("report", str(results_file), "--html", str(page))
    assert out.returncode == 0, out.stderr
    text = page.read_text()
    pngs = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert len(pngs) == 4 and all(base64.b64decode(p).startswith(b"\x89PNG") for p in pngs)
    assert "http://" not in text and "https://" not in text and "<script" not in text  # self-contained
    for job_id in ("obs-0-0", "obs-3-0", "chat-viol"):
        assert f"href='#job-{job_id}'" in text and f"id=\"job-{job_id}\"" in text
    assert "the run failed on purpose" in text and "continuity violation at call 1" in text
    # The console check can fail: a page with an error shows up in it.
    bad = results_file.parent / "bad.html"
    bad.write_text("<html><body><script>console.error('boom'); missingFunction();</script></body></html>")
    assert any("boom" in line for line in _open_in_chromium(exe, bad, results_file.parent / "bad.png"))
    shot = results_file.parent / "report.png"
    assert _open_in_chromium(exe, page, shot) == []
    from PIL import Image

    with Image.open(shot) as im:
        assert im.size == (1400, 1800)
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 50  # plots drawn, not a blank page
    keep = Path("/tmp/prorl-report-screenshot.png")
    shutil.copy(shot, keep)  # for a person to look at after a run
