"""The published mini-swe-agent package, unmodified, as a prorl task: the tinycalc SWE instance in an
Apptainer sandbox with no network, a scripted model that emits the gold fix in mini-swe-agent's own
format (a ``bash`` tool call, then its submit command), graded by the swe scorer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorl_cli.agent import Trajectory
from prorl_cli.domains.tinyrepo import make_tinyrepo
from prorl_cli.testing.scripted_engine import calls_path_for
from tests.domains.conftest import IMAGES, ScriptedStack, turn
from tests.harness import need_module

FIX = "cd /testbed && sed -i 's/(len(xs) - 1)/len(xs)/' tinycalc/stats.py && git diff --stat"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's own "I am done" command
COMMAND = 'mini-swe-agent -t "$(cat {task_file})" -m openai/prorl -y --exit-immediately -l 0 -o /tmp/mini.traj.json'
ENV = {"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1",
       "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mswea", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def test_mini_swe_agent_fixes_tinycalc_through_the_gateway(stack: ScriptedStack, tmp_path: Path) -> None:
    need_module("swebench", "swe")
    image = IMAGES / "harness"
    if not (image / "usr" / "local" / "bin" / "mini-swe-agent").is_file():
        pytest.skip(f"{image} missing (run scripts/provision/47-harness-image.sh as root)")
    repo = make_tinyrepo(tmp_path / "tinycalc")
    stack.add("[MSWEA-fix]", turn("The mean divides by n - 1; fix it.", ("bash", {"command": FIX})),
              turn("Fixed; submitting.", ("bash", {"command": SUBMIT})))
    stack.start_model()
    instance = {**repo.instance, "repo_path": str(repo.path),
                "problem_statement": f"[MSWEA-fix] {repo.instance['problem_statement']}",
                "settings": {"image": str(image), "command": COMMAND, "env": ENV, "workdir": "/testbed",
                             "scorer": "swe", "timeout_s": 300.0, "poll_s": 0.2}}
    (result,) = stack.run("harness", [instance], timeout_s=400)

    out = result.output
    assert result.state == "done", out.get("failure") or out.get("harness_log")
    assert out["stop_reason"] == "stop" and out["harness_exit_code"] == 0, out["harness_log"]
    assert "mean" in out["model_patch"] and "len(xs)" in out["model_patch"]  # the harness's command ran inside
    assert out["report"]["resolved"] is True and result.reward == 1.0
    traj = Trajectory.from_dict(out["trajectory"])
    assert len(traj.calls) == 2 and all(c.backend_id == "scripted" for c in traj.calls)
    assert out["continuity"] == 1.0 and out["segments"] == 1 and traj.token_exact  # mini-swe-agent edits no history
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" not in traj.calls[0].text
    # Every recorded prompt is exactly what the model bridge received over the wire.
    served = [{key: call[key] for key in ("prompt_ids", "output_ids")}  # the engine's record also has its sampling
              for call in map(json.loads, calls_path_for(stack.script_path).read_text().splitlines())]
    for call in traj.calls:
        assert {"prompt_ids": call.prompt_ids, "output_ids": call.output_ids} in served
