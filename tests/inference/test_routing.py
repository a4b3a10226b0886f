"""Backend routing through the real broker and node, to real bridges.

Counting-engine bridges (``tests.fakes``: run in this process, speaking the real protocol)
show which backend each call reached under each routing policy, that
cancel propagation stops a finished job's calls at the engine (and that
switching it off leaves them running), and that routing state drains to
nothing. The ``vllm``-marked tests do the same on a real vLLM: stickiness,
balance, pause/resume, clear, kill.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from prorl_cli import protocol as P
from prorl_cli.agent import Trajectory
from tests.fakes.bridges import ThreadBridge
from tests.fakes.engines import CountingEngine
from tests.harness import Deployment, bare_dealer
from tests.inference.conftest import HANDLERS, VLLM_TEST_ARGS, start_bridge


def submit(d: Deployment, tiny_model: Path, n: int, turns: int = 3, sampling: dict[str, Any] | None = None,
           **instance: Any) -> list[str]:
    inst = {"tokenizer": str(tiny_model), "turns": turns, **instance}
    return d.client.submit("multiturn", [inst] * n, sampling=sampling or {"max_tokens": 8}, timeout_s=240)


def backends(st: Any) -> dict[str, Any]:
    return {b.backend_id: b for b in st.backends}


def trajectory(res: Any) -> Trajectory:
    assert res.ok, (res.state, res.error)
    return Trajectory.from_dict(res.output["trajectory"])


@pytest.mark.vllm
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
    assert sum(b.served for b in st.backends) == 120
    assert all(b.inflight == 0 and b.jobs == 0 for b in st.backends)


@pytest.mark.vllm
def test_pause_drains_in_flight_calls_and_holds_new_ones(
    deployment: Deployment, vllm_server: Any, tiny_model: Path
) -> None:
    d = deployment
    start_bridge(d, "b1", "--attach", vllm_server.url)
    ids = submit(d, tiny_model, 6, turns=4, sampling={"max_tokens": 48})
    d.wait_for(lambda st: backends(st)["b1"].inflight > 0, 120, "calls in flight", "b1")
    d.client.pause_generation()
    drained = d.wait_for(lambda st: backends(st)["b1"].inflight == 0, 120, "in-flight calls to drain", "b1")
    served = backends(drained)["b1"].served
    late = submit(d, tiny_model, 1, turns=2)
    # The late job itself, not a count of jobs in RUN: a first job may have made all its calls before the pause
    # (a loaded machine runs the six unevenly) and be done by now.
    d.wait_for(lambda st: d.client.list_jobs(prefix=late[0]).get(late[0]) == "run", 60, "the late job in RUN", "n1")
    with pytest.raises(TimeoutError):
        d.client.result(late[0], timeout_s=1.5)
    assert backends(d.client.status())["b1"].served == served  # nothing served while paused
    d.client.resume_generation()
    for res in d.client.wait(ids + late, timeout_s=300):
        traj = trajectory(res)
        # Calls that were in flight at the pause completed; the held ones ran after resume: no errors.
        assert traj.error is None and len(traj.calls) == (2 if res.job_id in late else 4)


@pytest.mark.vllm
def test_clear_lets_jobs_finish_and_readd_routes_again(
    deployment: Deployment, vllm_server: Any, tiny_model: Path
) -> None:
    d = deployment
    url = vllm_server.url
    d.client.add_backend(url)
    (job_a,) = submit(d, tiny_model, 1, turns=3, pause_s=1.0)
    d.wait_for(lambda st: url in backends(st) and backends(st)[url].jobs == 1, 60, "job A routed to the URL")
    assert d.client.clear_backends(url) == [url]
    st = d.client.status()
    assert st.jobs.get("run") == 1, "job A must still be running when its backend is cleared"
    assert backends(st)[url].cleared is True
    (job_b,) = submit(d, tiny_model, 1, turns=2)
    # A keeps its backend and finishes; B, a new job, has nowhere to go and waits.
    traj_a = trajectory(d.client.result(job_a, timeout_s=120))
    assert [c.backend_id for c in traj_a.calls] == [url] * 3 and traj_a.error is None
    with pytest.raises(TimeoutError):
        d.client.result(job_b, timeout_s=1.5)
    d.client.add_backend(url)
    traj_b = trajectory(d.client.result(job_b, timeout_s=120))
    assert [c.backend_id for c in traj_b.calls] == [url] * 2 and traj_b.error is None


@pytest.mark.vllm
def test_killing_vllm_fails_its_job_and_the_rest_go_on(
    deployment: Deployment, vllm_server: Any, tiny_model: Path
) -> None:
    d = deployment
    start_bridge(d, "b-ok", "--attach", vllm_server.url)
    child_bridge = start_bridge(d, "b-child", "--model", str(tiny_model), "--max-model-len", "1024", "--",
                                *VLLM_TEST_ARGS, timeout_s=500)
    (vllm_proc,) = [p for p in psutil.Process(child_bridge.pid).children() if "vllm" in " ".join(p.cmdline())]
    long = {"max_tokens": 400, "temperature": 1.0}
    ids = submit(d, tiny_model, 2, turns=2, sampling=long)
    d.wait_for(lambda st: backends(st)["b-child"].inflight > 0, 120, "a call in flight on b-child", "b-child")
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


# ---------------------------------------------------------------------- scripted bridges


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[Callable[..., tuple[Deployment, list[ThreadBridge[CountingEngine]]]]]:
    """``start(broker_config, *engines)``: a deployment (broker + node) and one scripted bridge per engine."""
    made: list[tuple[Deployment, list[ThreadBridge[CountingEngine]]]] = []

    def start(broker: dict[str, Any], *engines: CountingEngine) -> tuple[Deployment, list[ThreadBridge[CountingEngine]]]:
        d = Deployment(tmp_path / f"home{len(made)}", config={"broker": broker, "inference": {"generate_timeout_s": 60.0}})
        bridges: list[ThreadBridge[CountingEngine]] = []
        made.append((d, bridges))
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        for i, engine in enumerate(engines, 1):
            bridges.append(ThreadBridge(d, f"b{i}", engine))  # one by one: b1 registers first
        return d, bridges

    try:
        yield start
    finally:
        for d, bridges in made:
            d.close()
            for b in bridges:
                b.close()


def drained(st: Any) -> bool:
    return st.held_generates == 0 and all(b.inflight == 0 and b.jobs == 0 for b in st.backends)


def one(d: Deployment, **instance: Any) -> list[str]:
    return d.client.submit("calls", [instance], sampling={"max_tokens": 2}, timeout_s=120)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # A holds b1; B goes to b2; once B ended, b2 has no live job and b1 one: C goes to b2.
        ("least_loaded_sticky", (["b2", "b2"], ["b2", "b2"])),
        # The paper's server counts B on b2 for ever: b1 and b2 have one job each, C goes to the first.
        ("ever_assigned", (["b2", "b2"], ["b1", "b1"])),
        # No stickiness: every call to the next backend, jobs alternate within themselves.
        ("round_robin", (["b2", "b1"], ["b2", "b1"])),
    ],
)
def test_each_policy_routes_calls_where_it_says(scripted: Any, policy: str, expected: tuple[list[str], list[str]]) -> None:
    d, _ = scripted({"routing_policy": policy}, CountingEngine(), CountingEngine())
    assert d.client.status().routing_policy == policy
    (job_a,) = one(d, calls=1, hold_s=60)
    d.wait_for(lambda st: sum(b.served for b in st.backends) == 1, 30, "job A's call to be served", "n1")
    st = d.client.status()
    assert {b.backend_id: b.jobs for b in st.backends} == ({"b1": 0, "b2": 0} if policy == "round_robin" else {"b1": 1, "b2": 0})
    got = []
    for _ in range(2):
        (res,) = d.client.wait(one(d, calls=2), timeout_s=60)
        assert res.ok, res.output
        got.append(res.output["backends"])
    assert tuple(got) == expected
    assert d.client.cancel([job_a]) == {job_a: "cancelled"}
    d.wait_for(drained, 30, "routing state to drain")


@pytest.mark.parametrize("propagate", [True, False], ids=["cancel-propagation", "no-cancel-propagation"])
def test_cancel_propagation_stops_a_cancelled_jobs_call_and_its_ablation_leaves_it_running(
    scripted: Any, propagate: bool
) -> None:
    engine = CountingEngine(delay_s=4.0)
    d, _ = scripted({"cancel_propagation": propagate}, engine)
    (job,) = one(d, calls=1)
    assert engine.first_started.wait(30), "the call never reached the engine"
    assert d.client.cancel([job]) == {job: "cancelled"}
    assert d.client.wait([job], timeout_s=30)[0].state == "cancelled"
    assert engine.first_ended.wait(30)
    if propagate:
        # Stopped at the engine long before its 4 s were up.
        assert (engine.cancelled, engine.finished) == (1, 0)
    else:
        # The engine served the stale call to its end; the broker counted it in flight until then.
        assert (engine.cancelled, engine.finished) == (0, 1)
    st = d.wait_for(drained, 30, "routing state to drain")
    assert st.backends[0].served == (0 if propagate else 1)


def test_a_bridge_that_leaves_mid_call_hands_the_call_on_and_the_job_finishes(scripted: Any) -> None:
    """A bridge stopped as SIGTERM, a scale-down or a time limit's warning stop it: the call it was serving is
    cancelled in its engine and runs again on the other bridge; the job never sees it."""
    slow, fast = CountingEngine(delay_s=120.0), CountingEngine()
    d, bridges = scripted({}, slow, fast)
    (job,) = one(d, calls=2)
    assert slow.first_started.wait(30), "the call never reached b1"
    bridges[0].close()  # the bridge stops: it cancels its call and unregisters
    (res,) = d.client.wait([job], timeout_s=60)
    assert res.ok, (res.state, res.error)
    assert res.output["backends"] == ["b2", "b2"]
    assert (slow.cancelled, slow.finished, fast.finished) == (1, 0, 2)
    st = d.wait_for(drained, 30, "routing state to drain")
    assert [(b.backend_id, b.gone_reason, b.inflight) for b in st.gone_backends] == [("b1", "left", 0)]


def test_routing_state_drains_to_nothing_when_jobs_are_cancelled_while_their_calls_race(scripted: Any) -> None:
    """Calls that arrive after their job was cancelled are refused, never routed, and bind nothing."""
    d, bridges = scripted({}, CountingEngine(delay_s=0.002), CountingEngine(delay_s=0.002))
    ids = d.client.submit("calls", [{"calls": 400}] * 12, sampling={"max_tokens": 2}, timeout_s=120)
    d.wait_for(lambda st: sum(b.served for b in st.backends) >= 60, 60, "calls to flow", "n1")
    states = d.client.cancel(ids)
    results = d.client.wait(ids, timeout_s=60)
    assert set(states.values()) == {"cancelled"} and all(r.state == "cancelled" for r in results)
    st = d.wait_for(drained, 30, "routing state to drain")
    assert {b.backend_id for b in st.backends} == {"b1", "b2"}
    assert sum(b.engine.started for b in bridges) < 12 * 400


class RawPeer:
    """A DEALER speaking the protocol by hand: a node that does exactly what a test tells it, in that order."""

    def __init__(self, d: Deployment) -> None:
        self.sock = bare_dealer(d.address, d.deployment_dir)

    def send(self, header: dict[str, Any], payload: list[bytes] | None = None) -> None:
        self.sock.send_multipart(P.encode(header, payload or []))

    def expect(self, op: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """The next message with ``op`` (heartbeats and the like in between are skipped)."""
        deadline = time.monotonic() + timeout_s
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if self.sock.poll(left_ms):
                header = P.decode_header(self.sock.recv_multipart()[0])
                if header["op"] == op:
                    return header
        raise TimeoutError(f"no {op} within {timeout_s} s")

    def close(self) -> None:
        self.sock.close()


def test_a_generate_for_a_job_that_is_not_running_on_the_requester_is_refused_and_binds_nothing(scripted: Any) -> None:
    """Deterministically: a node asks for a cancelled job, and for a queued job it was never given."""
    engine = CountingEngine()
    d, _ = scripted({}, engine)
    d.kill("n1")  # the raw node below is the only one: it gets the job
    node = RawPeer(d)
    try:
        node.send({"op": "register", "rid": 1, "node_id": "raw", "host": "127.0.0.1", "pid": 1, "credit": 1,
                   "tasks": ["calls"]})
        assert node.expect("reply")["ok"]
        ids = d.client.submit("calls", [{}, {}])
        (spec,) = node.expect("assign")["jobs"]  # credit 1: the other job stays queued
        job = spec["job_id"]
        (queued,) = set(ids) - {job}
        d.client.cancel([job])
        for rid, job_id in ((2, job), (3, queued)):
            node.send({"op": "generate", "rid": rid, "job_id": job_id}, [P.pack_tokens([1, 2, 3])])
            answer = node.expect("reply")
            assert answer["rid"] == rid and answer["error"]["code"] == "unknown_job", answer
            assert job_id in answer["error"]["message"]
    finally:
        node.close()
    st = d.client.status()
    assert [(b.jobs, b.inflight, b.served) for b in st.backends] == [(0, 0, 0)] and engine.started == 0


def test_generate_from_an_unregistered_peer_is_answered_at_once_and_nothing_is_held(scripted: Any) -> None:
    """A stranger's generate gets ``unknown_peer``, with its rid, and the broker keeps nothing of it."""

    d, _ = scripted({})
    sock = bare_dealer(d.address, d.deployment_dir)
    try:
        sock.send_multipart(P.encode({"op": "generate", "rid": 41, "job_id": "nobody"}, [P.pack_tokens([1] * 1024)]))
        assert sock.poll(10_000), "no answer"
        header = P.decode_header(sock.recv_multipart()[0])
        assert header["rid"] == 41 and header["error"]["code"] == "unknown_peer"
    finally:
        sock.close()
    assert d.client.status().held_generates == 0


def test_policy_version_given_to_pause_and_resume_is_kept_and_shown(scripted: Any) -> None:
    """K3: the trainer's version travels with pause/resume; status shows the current one."""
    d, _ = scripted({}, CountingEngine())
    assert d.client.status().policy_version == 0
    d.client.pause_generation(policy_version=3)
    (job,) = one(d, calls=1)
    d.wait_for(lambda st: st.held_generates == 1, 30, "the call to be held", "n1")
    d.client.resume_generation()
    (res,) = d.client.wait([job], timeout_s=60)
    assert res.ok and res.output["backends"] == ["b1"]
    assert d.client.status().policy_version == 3
