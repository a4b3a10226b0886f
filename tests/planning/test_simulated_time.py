"""Replays on simulated time (:mod:`prorl_cli.timebase`): the loop's clock, and a whole deployment on it.

The replay runs the real broker, node server, bridges, simulated engines
and DAPO sampler on one :class:`~prorl_cli.timebase.SimulatedEventLoop`.
Its figures must follow from the seed alone: two runs in two processes
give byte-identical engine ledgers, and so does a run while every core of
this machine is kept busy by another process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prorl_cli import timebase
from prorl_cli.exceptions import ProrlError
from prorl_cli.testing.simulated import SimulatedDeployment
from tests.harness import kill_if_running

REPLAY = Path(__file__).with_name("simulated_replay.py")


def test_simulated_loop_jumps_to_the_next_timer_and_restores_the_clock() -> None:
    async def main() -> tuple[float, float, float, str]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(3600.0)
        after_sleep = loop.time() - start
        # A timeout is a timer too: the wait_for below ends at +5 s, not at its 10 s limit.
        value = await asyncio.wait_for(asyncio.sleep(5.0, "done"), 10.0)
        return after_sleep, loop.time() - start, timebase.now() - start, value

    assert timebase.now is not None
    after_sleep, total, read, value = timebase.run_simulated(main())
    assert (after_sleep, total, read, value) == (3600.0, 3605.0, 3605.0, "done")
    # Outside the replay the roles read the host's clock again.
    assert timebase.now.__name__ == "monotonic" and timebase.now.__module__ == "time"


def test_simulated_loop_handles_ready_io_before_moving_time() -> None:
    """A message sent at an instant is read at that instant, even with a timer pending far ahead."""
    async def main() -> tuple[float, bytes]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        later = loop.call_later(100.0, lambda: None)
        got: asyncio.Future[bytes] = loop.create_future()
        loop.add_reader(b.fileno(), lambda: got.done() or got.set_result(b.recv(16)))
        start = loop.time()
        a.send(b"ping")
        data = await got
        elapsed = loop.time() - start
        loop.remove_reader(b.fileno())
        later.cancel()
        a.close()
        b.close()
        return elapsed, data

    assert timebase.run_simulated(main()) == (0.0, b"ping")


def test_simulated_deployment_refuses_a_real_time_loop(tmp_path: Path) -> None:
    async def main() -> None:
        async with SimulatedDeployment(tmp_path, "x", bridges=1):
            pass

    with pytest.raises(ProrlError, match="simulated time"):
        asyncio.run(main())


def _replay(home: Path, seed: int) -> tuple[dict[str, bytes], dict[str, object]]:
    home.mkdir(parents=True)
    proc = subprocess.run([sys.executable, str(REPLAY), str(home), str(seed)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ledgers = {p.name: p.read_bytes() for p in sorted((home / "ledgers").glob("*.json"))}
    return ledgers, json.loads((home / "figures.json").read_text())


def test_same_seed_same_ledgers_in_another_process_and_under_a_cpu_hog(tmp_path: Path) -> None:
    first_ledgers, first = _replay(tmp_path / "first", seed=3)
    assert sorted(first_ledgers) == ["sim-0.json", "sim-1.json"]
    calls = [c for raw in first_ledgers.values() for c in json.loads(raw)["calls"]]
    assert len(calls) > 50 and all(c["outcome"] in ("done", "aborted") for c in calls)
    steps = first["steps"]
    assert isinstance(steps, list) and len(steps) == 3
    assert all(len(s["rewards"]) == 2 for s in steps)  # each step returned its 2 informative groups

    second_ledgers, second = _replay(tmp_path / "second", seed=3)
    assert second_ledgers == first_ledgers
    assert second == first

    # Every core busy with another process while the replay runs: it takes longer, it measures the same.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(os.cpu_count() or 2)]
    try:
        hogged_ledgers, hogged = _replay(tmp_path / "hogged", seed=3)
    finally:
        for h in hogs:
            os.killpg(h.pid, signal.SIGKILL)
            h.wait()
    assert hogged_ledgers == first_ledgers
    assert hogged == first

    # Another seed is another workload: the comparison above could fail.
    other_ledgers, other = _replay(tmp_path / "other", seed=4)
    assert other_ledgers != first_ledgers and other != first


def test_sigterm_stops_a_replay_whose_node_runs_on_its_loop(tmp_path: Path) -> None:
    """The node server on a replay's loop leaves the process's signals alone: SIGTERM ends the replay.

    (Taking them over, it would stop only the node on SIGTERM, and the replay would run on without one.)
    """
    proc = subprocess.Popen([sys.executable, str(REPLAY), str(tmp_path), "3", "100000"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        kill_if_running(proc)


def test_plan_predicts_a_simulated_deployment_within_ten_percent(tmp_path: Path) -> None:
    """``prorl plan`` reads a deployment's own results and predicts its rollouts per GPU-second within 10 %.

    The deployment (broker, node, two sim bridges) runs on simulated time, so the measured figure is the
    workload's and not this machine's: the comparison is exact and repeatable, not a timing assertion.
    """
    from prorl_cli.inference.sim_engine import SimProfile
    from prorl_cli.planning import ClusterShape, Workload, make_plan

    bridges, in_flight, rollouts, warmup = 2, 16, 160, 40
    results_path = tmp_path / "results.jsonl"

    def instance(k: int) -> dict[str, object]:
        return {"seed": 1, "turns": [5, 12], "prompt_tokens": 2000,
                "output_tokens": {"median": 150, "sigma": 0.6, "max": 1024},
                "observation_tokens": {"median": 500, "sigma": 1.0, "max": 6000},
                "tool_s": {"median": 1.0, "sigma": 1.0, "max": 60.0}, "p_solve": (0.0, 0.5, 1.0)[k % 3]}

    async def closed_loop() -> float:
        config = {"broker": {"heartbeat_interval_s": 0.5, "journal": False},
                  "node": {"n_init": 8, "n_run": 2 * in_flight, "n_eval": 8,
                           "handler_paths": ["prorl_cli.testing.handlers"]},
                  "inference": {"capacity": 256}, "log_level": "WARNING"}
        async with SimulatedDeployment(tmp_path / "dep", "pa", config, bridges=bridges) as dep:
            stream = dep.client.results()
            submitted = done = 0
            t_a = t_b = 0.0

            async def submit_one() -> None:
                nonlocal submitted
                await dep.client.submit("sim_agent", [instance(submitted // 4)], job_ids=[f"pa-{submitted}"],
                                        group_id=f"g{submitted // 4}")
                submitted += 1

            for _ in range(in_flight):
                await submit_one()
            with results_path.open("w") as out:
                async for result in stream:
                    out.write(json.dumps(result.to_wire()) + "\n")
                    done += 1
                    if done == warmup:
                        t_a = timebase.now()
                    if done < rollouts:
                        await submit_one()
                    elif done == rollouts:
                        t_b = timebase.now()
                    if done == submitted:  # the tail finishes too: the file holds every rollout submitted
                        break
            return (rollouts - warmup) / ((t_b - t_a) * bridges)

    measured = timebase.run_simulated(closed_loop())
    work = Workload.from_results(results_path, time_scale=1.0)
    plan = make_plan(work, SimProfile.load("h100-8b"), ClusterShape(bridges=bridges, nodes=1, slots=2 * in_flight),
                     group_size=4, in_flight=[in_flight], rollouts=2 * rollouts)
    predicted = plan.sweep[0].rollouts_per_s / bridges
    assert measured > 0
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


def test_a_deployment_that_fails_to_start_stops_what_it_started(tmp_path: Path) -> None:
    """A node that cannot serve fails the start with its reason; the broker it left behind is closed,
    so a deployment of the same name starts next in the same process (its ``inproc`` address is free)."""
    async def main() -> int:
        broken = SimulatedDeployment(tmp_path / "a", "same", {"node": {"tasks": ["no_such_task"]}}, bridges=1)
        with pytest.raises(ProrlError) as e:
            async with broken:
                pass
        assert "no_such_task" in str(e.value)
        config = {"node": {"handler_paths": ["prorl_cli.testing.handlers"]}}
        async with SimulatedDeployment(tmp_path / "b", "same", config, bridges=1) as dep:
            return len((await dep.client.status()).backends)

    assert timebase.run_simulated(main()) == 1
