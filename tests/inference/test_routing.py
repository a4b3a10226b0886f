"""Backend routing with real bridges on a real vLLM: stickiness, balance, pause/resume, clear, kill."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest

from prorl_cli.agent import Trajectory
from tests.harness import Deployment
from tests.inference.conftest import start_bridge

pytestmark = pytest.mark.vllm


def submit(d: Deployment, tiny_model: Path, n: int, turns: int = 3, sampling: dict[str, Any] | None = None,
           **instance: Any) -> list[str]:
    inst = {"tokenizer": str(tiny_model), "turns": turns, **instance}
    return d.client.submit("multiturn", [inst] * n, sampling=sampling or {"max_tokens": 8}, timeout_s=240)


def backends(st: Any) -> dict[str, dict[str, Any]]:
    return {b["backend_id"]: b for b in st.backends}


def trajectory(res: Any) -> Trajectory:
    assert res.ok, (res.state, res.error)
    return Trajectory.from_dict(res.output["trajectory"])


def test_forty_jobs_on_two_bridges_are_sticky_and_balanced(
    deployment: Deployment, vllm_server: Any, tiny_model: Path
) -> None:
    d = deployment
    start_bridge(d, "b1", "--attach", vllm_server.url)
    start_bridge(d, "b2", "--attach", vllm_server.url)
    # Hold the first calls so that all 40 jobs are routed while none has finished.
    d.client.pause_generation()
    ids = submit(d, tiny_model, 40)
    d.wait_for(lambda st: st.jobs.get("run", 0) == 40, 120, "40 jobs in RUN", "n1")
    d.client.resume_generation()
    per_backend: Counter[str] = Counter()
    for res in d.client.wait(ids, timeout_s=300):
        traj = trajectory(res)
        assert traj.error is None and len(traj.calls) == 3
        used = {c.backend_id for c in traj.calls}
        assert len(used) == 1, f"job {res.job_id} used {used}"
        per_backend[str(used.pop())] += 1
    assert set(per_backend) == {"b1", "b2"}
    assert abs(per_backend["b1"] - per_backend["b2"]) <= 1, per_backend
    st = d.client.status()
    assert sum(b["served"] for b in st.backends) == 120
    assert all(b["inflight"] == 0 and b["jobs"] == 0 for b in st.backends)


def test_pause_drains_in_flight_calls_and_holds_new_ones(
    deployment: Deployment, vllm_server: Any, tiny_model: Path
) -> None:
    d = deployment
    start_bridge(d, "b1", "--attach", vllm_server.url)
    ids = submit(d, tiny_model, 6, turns=4, sampling={"max_tokens": 48})
    d.wait_for(lambda st: backends(st)["b1"]["inflight"] > 0, 120, "calls in flight", "b1")
    d.client.pause_generation()
    drained = d.wait_for(lambda st: backends(st)["b1"]["inflight"] == 0, 120, "in-flight calls to drain", "b1")
    served = backends(drained)["b1"]["served"]
    late = submit(d, tiny_model, 1, turns=2)
    d.wait_for(lambda st: st.jobs.get("run", 0) == 7, 60, "the late job in RUN", "n1")
    with pytest.raises(TimeoutError):
        d.client.result(late[0], timeout_s=1.5)
    assert backends(d.client.status())["b1"]["served"] == served  # nothing served while paused
    d.client.resume_generation()
    for res in d.client.wait(ids + late, timeout_s=300):
        traj = trajectory(res)
        # Calls that were in flight at the pause completed; the held ones ran after resume: no errors.
        assert traj.error is None and len(traj.calls) == (2 if res.job_id in late else 4)


def test_clear_lets_jobs_finish_and_readd_routes_again(
    deployment: Deployment, vllm_server: Any, tiny_model: Path
) -> None:
    d = deployment
    url = vllm_server.url
    d.client.add_backend(url)
    (job_a,) = submit(d, tiny_model, 1, turns=3, pause_s=1.0)
    d.wait_for(lambda st: backends(st).get(url, {}).get("jobs") == 1, 60, "job A routed to the URL")
    assert d.client.clear_backends(url) == [url]
    st = d.client.status()
    assert st.jobs.get("run") == 1, "job A must still be running when its backend is cleared"
    assert backends(st)[url]["cleared"] is True
    (job_b,) = submit(d, tiny_model, 1, turns=2)
    # A keeps its backend and finishes; B, a new job, has nowhere to go and waits.
    traj_a = trajectory(d.client.result(job_a, timeout_s=120))
    assert [c.backend_id for c in traj_a.calls] == [url] * 3 and traj_a.error is None
    with pytest.raises(TimeoutError):
        d.client.result(job_b, timeout_s=1.5)
    d.client.add_backend(url)
    traj_b = trajectory(d.client.result(job_b, timeout_s=120))
    assert [c.backend_id for c in traj_b.calls] == [url] * 2 and traj_b.error is None


def test_killing_vllm_fails_its_job_and_the_rest_go_on(
    deployment: Deployment, vllm_server: Any, tiny_model: Path
) -> None:
    d = deployment
    start_bridge(d, "b-ok", "--attach", vllm_server.url)
    child_bridge = start_bridge(d, "b-child", "--model", str(tiny_model), "--max-model-len", "1024", timeout_s=500)
    (vllm_proc,) = [p for p in psutil.Process(child_bridge.pid).children() if "vllm" in " ".join(p.cmdline())]
    long = {"max_tokens": 400, "temperature": 1.0}
    ids = submit(d, tiny_model, 2, turns=2, sampling=long)
    d.wait_for(lambda st: backends(st)["b-child"]["inflight"] > 0, 120, "a call in flight on b-child", "b-child")
    os.killpg(vllm_proc.pid, signal.SIGKILL)  # vLLM runs in its own process group, which this test's bridge made
    results = {r.job_id: r for r in d.client.wait(ids, timeout_s=240)}
    trajs = [trajectory(r) for r in results.values()]
    failed = [t for t in trajs if t.error is not None]
    assert len(failed) == 1, [t.error for t in trajs]
    error = failed[0].error
    assert failed[0].stop_reason == "error" and error is not None and "b-child" in error["message"]
    (ok,) = [t for t in trajs if t.error is None]
    assert {c.backend_id for c in ok.calls} == {"b-ok"} and len(ok.calls) == 2
    # The bridge notices, unregisters and exits non-zero; new jobs all go to b-ok.
    assert child_bridge.wait(60) == 1
    assert "engine of backend b-child is down" in d.log("b-child")
    d.wait_for(lambda st: "b-child" not in backends(st), 30, "b-child to be gone")
    for res in d.client.wait(submit(d, tiny_model, 3, turns=2), timeout_s=120):
        assert {c.backend_id for c in trajectory(res).calls} == {"b-ok"}
