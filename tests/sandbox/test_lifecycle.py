"""Lifecycle for real: clean stop, reaping after a node crash, 32 starts at once, limits."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.sandbox.runtime import proc_start_ticks, wait_gone
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


@pytest.mark.parametrize(("runtime", "image"), [*ISOLATED, pytest.param("local", None, id="local")])
def test_a_start_whose_tool_server_cannot_be_reached_leaves_nothing(
        runtime: str, image: str | None, scenarios: ScenarioRunner, images: dict[str, str],
        request: pytest.FixtureRequest) -> None:
    """The runtime printed its ready line, then the connect failed: start raises and the sandbox is stopped."""
    config = {"runtime": "local"} if runtime == "local" else _config(runtime, image or "", images, request)
    r = scenarios.run("connect_fails", config)
    assert r["error"] and "cannot connect to the tool server" in r["error"], r
    assert r["n_procs"] >= 1  # the tool server (and, isolated, its runtime)
    assert r["alive_after"] == [] and r["session_after"] == [], r
    assert r["session_dir_left"] is False and r["records_after"] == [], r


@pytest.mark.parametrize(("runtime", "image"), [*ISOLATED, pytest.param("local", None, id="local")])
def test_a_stop_whose_caller_is_cancelled_still_ends_the_sandbox(
        runtime: str, image: str | None, scenarios: ScenarioRunner, images: dict[str, str],
        request: pytest.FixtureRequest) -> None:
    config = {"runtime": "local"} if runtime == "local" else _config(runtime, image or "", images, request)
    r = scenarios.run("stop_cancelled", config)
    assert r["cancelled"] is True and r["n_procs"] >= 3, r
    assert r["alive_after"] == [] and r["records_after"] == [], r


def test_stop_leaves_nothing_under_nohup(scenarios: ScenarioRunner) -> None:
    """A node started with hangups ignored (``nohup``): the local sandbox's shell jobs still end with it."""
    r = scenarios.run("stop_clean", {"runtime": "local"}, nohup=True)
    assert r["n_procs"] >= 3
    assert r["alive_after"] == [] and r["session_after"] == []


@pytest.mark.parametrize(("runtime", "image"), [*ISOLATED, pytest.param("local", None, id="local")])
def test_kill9_node_leaves_nothing_and_a_node_with_another_id_reaps(
    runtime: str, image: str | None, scenarios: ScenarioRunner, images: dict[str, str], request: pytest.FixtureRequest
) -> None:
    config = {"runtime": "local"} if runtime == "local" else _config(runtime, image or "", images, request)
    state_dir = scenarios.state_dir()
    held = _hold_then_kill9(scenarios, "hold", {"config": config, "state_dir": str(state_dir), "n": 2})
    # The runtime parent, its helpers (squashfuse, fuse-overlayfs), the tool server, the shell and
    # its children: all of them, identified by pid and start time.
    assert len(held["procs"]) >= (4 if runtime == "local" else 6)
    procs = {int(p): t for p, t in held["procs"].items()}
    # Without any other node: the dead node's watchdog ends them (zombies left to a non-reaping init count as gone).
    assert wait_gone([p for p, t in procs.items() if proc_start_ticks(p) == t], 60) == []
    # A node with ANOTHER id (its own run directory) removes what the dead one recorded.
    _reap_with_another_node(scenarios, config, state_dir, held)


def test_a_node_killed_mid_start_leaves_no_session_folder(scenarios: ScenarioRunner) -> None:
    """Killed after the session folder was made and before any process ran: the folder is reaped too."""
    state_dir = scenarios.state_dir()
    # A folder of its own: what this test leaves when it fails must not show up in other tests' local_dir.
    config = {"runtime": "local", "local_dir": str(state_dir / "local")}
    held = _hold_then_kill9(scenarios, "hold_mid_start", {"config": config, "state_dir": str(state_dir)})
    assert all(os.path.isdir(s) for s in held["sessions"]), held
    _reap_with_another_node(scenarios, config, state_dir, held)


@pytest.mark.parametrize(("runtime", "image"), [pytest.param("bwrap", "rootfs", id="bwrap", marks=pytest.mark.bwrap),
                                               pytest.param("local", None, id="local")])
def test_a_node_that_stops_cleans_up_after_a_sibling_killed_while_it_ran(
    runtime: str, image: str | None, scenarios: ScenarioRunner, images: dict[str, str], request: pytest.FixtureRequest
) -> None:
    """The deployment is taken down before a killed node's replacement starts: the node that leaves reaps."""
    dead_state_dir = scenarios.state_dir()
    # A folder of its own: what this test leaves when it fails must not show up in other tests' local_dir.
    local = {"local_dir": str(dead_state_dir / "local")}
    config = {"runtime": "local", **local} if runtime == "local" else _config(runtime, image or "", images, request,
                                                                             **local)
    held = _hold_then_kill9(scenarios, "hold", {"config": config, "state_dir": str(dead_state_dir), "n": 1})
    assert (dead_state_dir / "sandboxes").is_dir() and any((dead_state_dir / "sandboxes").glob("*.json"))
    args = {"config": config, "state_dir": str(scenarios.state_dir()), "dead_state_dir": str(dead_state_dir), **held}
    proc = scenarios.popen("stop_after_sibling_died", args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert r["alive_after"] == [] and r["sessions_left"] == [], (r, err[-3000:])
    assert r["dead_records_left"] == [] and r["own_records_left"] == [], r


def _hold_then_kill9(scenarios: ScenarioRunner, scenario: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run a stand-in node until it reports what it holds, then ``kill -9`` it; return that report."""
    holder = scenarios.popen(scenario, args)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line, f"holder died: {holder.stderr.read() if holder.stderr else ''}"
        held: dict[str, Any] = json.loads(line)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # the "node server" crashes
        holder.communicate()
    return held


def _reap_with_another_node(scenarios: ScenarioRunner, config: dict[str, Any], dead_state_dir: Path,
                            held: dict[str, Any]) -> None:
    args = {"config": config, "state_dir": str(scenarios.state_dir()), "dead_state_dir": str(dead_state_dir), **held}
    proc = scenarios.popen("reap", args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert r["alive_after"] == []
    assert r["sessions_left"] == [], (r, err[-3000:])
    assert r["dead_records_left"] == []
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
