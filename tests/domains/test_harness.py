"""The ``harness`` task: an agent program, unmodified, in an Apptainer sandbox with no network, talking to
the job's gateway; every model call goes node -> broker -> scripted model bridge and back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prorl_cli.agent import Trajectory
from prorl_cli.training.samples import build_samples
from tests.domains.conftest import ScriptedStack, turn
from tests.fakes.agents import AGENT

COMPUTE = ("bash", {"command": "python3 -c 'print(2+3)'"})


def _instance(tag: str, image: str, **settings: Any) -> dict[str, Any]:
    return {"problem": f"[{tag}] What is 2+3?", "answer": "5",
            "settings": {"image": image, "command": AGENT, "scorer": "math", "poll_s": 0.2, **settings}}


def test_harness_runs_an_unmodified_agent_in_the_sandbox(stack: ScriptedStack, domain_image: str) -> None:
    stack.add("[H-ok]", turn("", COMPUTE), "The answer is \\boxed{5}.")
    stack.add("[H-fail]", turn("", COMPUTE), "I give up.")
    stack.add("[H-hang]", turn("", ("bash", {"command": "sleep 600"})), "never reached")
    stack.start_model()
    ok, fail, hang = stack.run("harness", [
        _instance("H-ok", domain_image),
        _instance("H-fail", domain_image, env={"AGENT_EXIT": "3"}),
        _instance("H-hang", domain_image, timeout_s=4.0),
    ], timeout_s=300)

    assert ok.state == "done" and ok.reward == 1.0, ok
    out = ok.output
    assert out["stop_reason"] == "stop" and out["harness_exit_code"] == 0
    assert "ran: python3 -c 'print(2+3)' -> 5" in out["harness_log"]  # the harness's own command ran inside
    assert out["continuity"] == 1.0 and out["segments"] == 1
    traj = Trajectory.from_dict(out["trajectory"])
    assert len(traj.calls) == 2 and traj.token_exact and traj.stop_reason == "stop"
    assert traj.calls[0].backend_id == "scripted"
    samples, report = build_samples(out["trajectory"], rollout_id=ok.job_id, group_id="g", reward=1.0)
    assert len(samples) == 1 and report.merge_ratio == 1.0

    assert fail.reward == 0.0 and fail.output["stop_reason"] == "error" and fail.output["harness_exit_code"] == 3
    assert len(fail.output["trajectory"]["calls"]) == 2  # the partial trajectory is kept

    assert hang.reward == 0.0 and hang.output["stop_reason"] == "timeout"
    assert hang.output["harness_exit_code"] is None
    assert len(hang.output["trajectory"]["calls"]) == 1 and "ran:" not in hang.output["harness_log"]


def test_a_cancelled_harness_is_killed(stack: ScriptedStack, domain_image: str) -> None:
    import os
    import time

    def sleepers() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"613"]:
                    found.append(pid)
            except OSError:
                continue  # it ended while we looked
        return found

    stack.add("[H-cancel]", turn("", ("bash", {"command": "sleep 613"})), "never reached")
    stack.start_model()
    client = stack.d.client
    (job_id,) = client.submit("harness", [_instance("H-cancel", domain_image)], timeout_s=120)
    node_log = stack.d.logs / "n1.log"
    deadline = time.monotonic() + 120
    # The harness streams its output to the job log: its first turn is printed before the tool runs.
    while f"job {job_id} harness| assistant:" not in node_log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the harness never reported its first model turn"
        time.sleep(0.1)
    while not sleepers():  # the harness's tool command, running inside the sandbox
        assert time.monotonic() < deadline, "the harness's tool command never started"
        time.sleep(0.1)
    client.cancel([job_id])
    (result,) = client.wait([job_id], timeout_s=120)
    assert result.state == "cancelled", result
    # The broker answers the cancel at once; the node then kills the harness's process group and the sandbox.
    deadline = time.monotonic() + 60
    while sleepers():
        assert time.monotonic() < deadline, f"the harness's processes {sleepers()} outlived the cancelled job"
        time.sleep(0.1)
