"""Lifecycle for real: clean stop, reaping after a node crash, 32 starts at once, limits."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from tests.sandbox.conftest import ScenarioRunner

ISOLATED = [
    pytest.param("apptainer", "dir", id="apptainer", marks=pytest.mark.apptainer),
    pytest.param("bwrap", "rootfs", id="bwrap", marks=pytest.mark.bwrap),
]


def _config(runtime: str, image: str, images: dict[str, str], request: pytest.FixtureRequest,
            **extra: Any) -> dict[str, Any]:
    request.getfixturevalue(f"need_{runtime}")
    return {"runtime": runtime, "image": images[image], **extra}


@pytest.mark.parametrize(("runtime", "image"), [*ISOLATED, pytest.param("local", None, id="local")])
def test_stop_leaves_nothing(runtime: str, image: str | None, scenarios: ScenarioRunner,
                             images: dict[str, str], request: pytest.FixtureRequest) -> None:
    config = {"runtime": "local"} if runtime == "local" else _config(runtime, image or "", images, request)
    r = scenarios.run("stop_clean", config)
    assert r["n_procs"] >= 3  # the sandbox, its shell and two background sleeps at least
    assert r["alive_after"] == []
    assert r["group_after"] == []
    assert r["session_after"] == []
    assert r["session_left"] is False and r["socket_left"] is False
    assert len(r["records_before"]) == 1 and r["records_after"] == []


@pytest.mark.parametrize(("runtime", "image"), ISOLATED)
def test_kill9_node_then_new_node_reaps(runtime: str, image: str, scenarios: ScenarioRunner,
                                        images: dict[str, str], request: pytest.FixtureRequest) -> None:
    config = _config(runtime, image, images, request)
    state_dir = str(scenarios.state_dir())
    holder = scenarios.popen("hold", {"config": config, "state_dir": state_dir, "n": 2})
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line, f"holder died: {holder.stderr.read() if holder.stderr else ''}"
        held = json.loads(line)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the "node server" crashes
        holder.communicate()
    assert len(held["procs"]) >= 6
    # A new "node server" in the same run directory.
    args = {"config": config, "state_dir": state_dir, **held}
    proc = scenarios.popen("reap", args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    if runtime == "apptainer":
        assert r["reaped"] == 2  # they outlived the node; bwrap's --die-with-parent ends them first
    assert r["alive_after"] == []
    assert r["sessions_left"] == []
    assert r["reaped_again"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(("runtime", "image"), ISOLATED)
def test_32_at_once(runtime: str, image: str, scenarios: ScenarioRunner,
                    images: dict[str, str], request: pytest.FixtureRequest) -> None:
    config = _config(runtime, image, images, request, max_concurrent_starts=4)
    r = scenarios.run("many", config, n=32)
    assert r["errors"] == []
    assert r["up"] == 32 and r["echo_ok"] is True
    assert r["distinct_ips"] == 32
    assert r["alive_after"] == [] and r["live_after"] == 0
    assert r["local_dir_left"] == []


@pytest.mark.parametrize(("runtime", "image"), ISOLATED)
def test_fork_bomb_and_memory_hog_are_contained(runtime: str, image: str, scenarios: ScenarioRunner,
                                                 images: dict[str, str], request: pytest.FixtureRequest) -> None:
    config = _config(runtime, image, images, request, mem_gb=1.0, max_procs=64)
    r = scenarios.run("limits", config)
    assert r["hog_error"].startswith("MemoryError")
    assert r["hog_then"] == "2"  # the namespace survived
    assert "MemoryError" in r["shell_hog"]
    assert r["bomb_fork_failed"] is True, r["bomb_output_tail"]
    assert r["bomb_procs"] <= 64 + 8  # the limit, plus the sandbox's own processes
    assert r["other_during"].startswith("serving")
    assert r["bomb_alive_after_stop"] == []
    assert r["other_after"] == "still serving\n"
