"""Broker, node servers and clients as separate OS processes on loopback."""

from __future__ import annotations

import collections
import os
import random
import signal
from pathlib import Path

import psutil
import pytest

from prorl_cli.protocol import JobState
from tests.harness import Deployment


@pytest.fixture
def deployment(tmp_path: Path):
    d = Deployment(tmp_path / "home", "core")
    d.start_broker()
    yield d
    d.close()


def _journal_counts(journal: Path) -> dict[str, list[str]]:
    runs: dict[str, list[str]] = {}
    for f in journal.glob("*.log"):
        runs[f.stem] = f.read_text().splitlines()
    return runs


def test_200_mixed_jobs_on_two_nodes_end_in_the_right_state(deployment: Deployment, tmp_path: Path) -> None:
    deployment.start_node("n1")
    deployment.start_node("n2")
    journal = tmp_path / "journal"
    journal.mkdir()
    rng = random.Random(7)
    kinds = ["echo", "sleep", "raise_init", "raise_run", "raise_eval", "hang_run", "hang_eval"]
    expected: dict[str, tuple[str, str | None]] = {}
    client = deployment.client
    all_ids = []
    for i in range(200):
        kind = kinds[i % len(kinds)]
        inst: dict = {"echo": i, "journal": str(journal)}
        state, critical = JobState.DONE.value, None
        if kind == "sleep":
            inst["sleep_s"] = {"init": rng.uniform(0, 0.05), "run": rng.uniform(0, 0.1), "eval": rng.uniform(0, 0.05)}
        elif kind.startswith("raise_"):
            stage = kind.split("_")[1]
            inst["raise_in"] = stage
            state, critical = JobState.FAILED.value, stage
        elif kind.startswith("hang_"):
            stage = kind.split("_")[1]
            inst["hang_in"] = stage
            state, critical = JobState.TIMED_OUT.value, stage
        job_id = f"job-{i:03d}-{kind}"
        (jid,) = client.submit("test", [inst], job_ids=[job_id], timeout_s=1.0)
        all_ids.append(jid)
        expected[jid] = (state, critical)

    results = client.wait(all_ids, timeout_s=120)
    assert len(results) == 200
    for r in results:
        state, critical = expected[r.job_id]
        assert (r.state, r.critical_error) == (state, critical), r
        assert r.attempt == 1
        assert r.node_id in ("n1", "n2")
        if state == JobState.DONE.value:
            assert r.output["echo"] == int(r.job_id.split("-")[1])
            assert r.reward == 1.0
            assert r.output["stages"] == ["init", "run", "eval"]
        else:
            # The stage's exception callback ran and the result is still well formed.
            assert r.output["fallback"].startswith(critical)
            assert r.reward == 0.0
            assert r.error is not None and r.error["stage"] == critical
            stages_run = r.output["stages"]
            assert stages_run[-1] == critical  # nothing ran after the failed stage
    # No job ran twice: each job's journal shows each stage at most once, from one process.
    runs = _journal_counts(journal)
    assert set(runs) == set(all_ids)
    for job_id, lines in runs.items():
        stages = [line.split()[2] for line in lines]
        assert len(stages) == len(set(stages)), (job_id, lines)
        assert len({line.split()[3] for line in lines}) == 1
    used = collections.Counter(r.node_id for r in results)
    assert used["n1"] > 0 and used["n2"] > 0
    status = client.status()
    assert status.jobs["done"] + status.jobs["failed"] + status.jobs["timed_out"] == 200
    assert status.queued == 0


def test_queue_time_does_not_count_toward_the_timeout(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "queue", {"node": {"n_init": 1, "n_run": 1, "n_eval": 1, "credit": 8}})
    try:
        d.start_broker()
        d.start_node("n1")
        client = d.client
        # One RUN slot: the fourth job waits ~3 x 0.4 s in the RUN queue, far past its 1 s budget,
        # yet only its 0.4 s in RUN counts.
        ids = client.submit("test", [{"sleep_s": {"run": 0.4}}] * 4, timeout_s=1.0)
        results = client.wait(ids, timeout_s=60)
        assert [r.state for r in results] == ["done"] * 4
        # In-stage time does count.
        slow = client.process("test", {"sleep_s": {"run": 1.5}}, timeout_s=1.0)
        assert slow.state == "timed_out" and slow.critical_error == "run"
        assert "in-stage time only" in slow.error["message"]
        # Handlers that swallow the timeout's cancel, or turn it into another error, still time out.
        for misbehaviour in ("swallow", "raise"):
            r = client.process("test", {"hang_in": "run", "on_cancel": misbehaviour}, timeout_s=0.5)
            assert (r.state, r.critical_error) == ("timed_out", "run"), (misbehaviour, r)
            assert "eval" not in r.output["stages"]
        # A per-stage cap applies to its stage alone.
        capped = client.process("test", {"sleep_s": {"init": 0.3}}, timeout_s=10.0, stage_timeouts_s={"init": 0.1})
        assert capped.state == "timed_out" and capped.critical_error == "init"
    finally:
        d.close()


def test_cancel_queued_and_running_jobs_completes_the_wait(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "cancel", {"node": {"n_init": 1, "n_run": 1, "n_eval": 1, "credit": 1}})
    try:
        d.start_broker()
        d.start_node("n1")
        client = d.client
        running, queued = client.submit("test", [{"hang_in": "run"}, {"echo": 1}], timeout_s=100)
        d.wait_for(lambda st: st.jobs["run"] == 1, 10, "the first job to reach RUN")
        assert client.status().jobs["queued"] == 1  # credit 1: the second one waits at the broker

        waiter = d.new_client()
        waiter.submit("test", [{}, {}], job_ids=[running, queued])  # watch them (idempotent: no new jobs)
        states = client.cancel([queued, running])
        assert states == {queued: "cancelled", running: "cancelled"}
        # Both waits complete within the 1 s the design promises (wait() raises past it).
        results = waiter.wait([running, queued], timeout_s=1.0)
        assert [r.state for r in results] == ["cancelled", "cancelled"]
        waiter.close()
        # The node really stopped the running job and took the next one.
        after = client.process("test", {"echo": "after"}, timeout_s=10)
        assert after.state == "done" and after.output["echo"] == "after"
        d.wait_for(lambda st: st.nodes[0].inflight == 0, 10, "node credit to come back")
    finally:
        d.close()


def test_resubmitting_a_job_id_returns_the_same_job(deployment: Deployment, tmp_path: Path) -> None:
    deployment.start_node("n1")
    journal = tmp_path / "j"
    journal.mkdir()
    client = deployment.client
    inst = {"journal": str(journal), "echo": "first", "sleep_s": {"run": 0.2}}
    client.submit("test", [inst], job_ids=["same-id"])
    # Same id again, while running and after finishing, from another client too.
    client.submit("test", [{"echo": "second"}], job_ids=["same-id"])
    r1 = client.result("same-id", timeout_s=30)
    other = deployment.new_client()
    other.submit("test", [{"echo": "third"}], job_ids=["same-id"])
    r2 = other.result("same-id", timeout_s=30)
    other.close()
    assert r1.output["echo"] == r2.output["echo"] == "first"
    assert len((journal / "same-id.log").read_text().splitlines()) == 3  # init, run, eval once
    assert client.status().jobs["done"] == 1


def test_kill_9_of_a_node_requeues_its_jobs_to_the_other(deployment: Deployment, tmp_path: Path) -> None:
    deployment.start_node("victim")
    client = deployment.client
    # The first attempt never ends: only the survivor can finish these jobs, however slow the machine.
    ids = client.submit("test", [{"hang_in": "run", "hang_attempt": 1}] * 4, timeout_s=30)
    deployment.wait_for(lambda st: st.jobs["run"] == 4, 20, "4 jobs in RUN on the victim")
    deployment.start_node("survivor")
    deployment.kill("victim", signal.SIGKILL)
    results = client.wait(ids, timeout_s=60)
    assert [r.state for r in results] == ["done"] * 4
    assert {r.node_id for r in results} == {"survivor"}
    assert [r.attempt for r in results] == [2] * 4
    assert [r.output["attempt"] for r in results] == [2] * 4
    nodes = {n.node_id: n for n in client.status().nodes}
    assert nodes["victim"].alive is False


def test_stop_leaves_no_process_of_the_deployment_running(deployment: Deployment) -> None:
    deployment.start_node("n1")
    deployment.start_node("n2")
    waiter = deployment.new_client()  # it submits, so the broker pushes it every result
    ids = waiter.submit("test", [{"hang_in": "run"}] * 6 + [{"echo": 1}] * 40, timeout_s=100)
    deployment.wait_for(lambda st: st.jobs["run"] >= 6, 20, "hanging jobs to run")
    pids = [p.pid for p in deployment.procs.values()]
    children = [c.pid for pid in pids for c in psutil.Process(pid).children(recursive=True)]
    deployment.stop(timeout_s=30)
    # Every job's wait completes: finished ones done, the rest cancelled.
    results = waiter.wait(ids, timeout_s=5)
    waiter.close()
    assert {r.state for r in results} <= {"done", "cancelled"}
    assert sum(r.state == "cancelled" for r in results) >= 6
    for proc in deployment.procs.values():
        assert proc.returncode == 0
    for pid in pids + children:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not (deployment.deployment_dir / "broker.json").exists()
    assert not (deployment.deployment_dir / "broker.journal").exists(), "a clean stop leaves nothing to replay"
    assert os.listdir(deployment.deployment_dir / "nodes")  # the nodes' run dirs stay for inspection


def test_sigterm_of_a_node_hands_its_jobs_back(deployment: Deployment) -> None:
    """A preempted node (Slurm sends SIGTERM) unregisters; its jobs move on at once."""
    deployment.start_node("preempted")
    client = deployment.client
    ids = client.submit("test", [{"sleep_s": {"run": 1.0}}] * 3, timeout_s=30)
    deployment.wait_for(lambda st: st.jobs["run"] == 3, 20, "3 jobs in RUN")
    deployment.kill("preempted", signal.SIGTERM)
    assert deployment.procs["preempted"].returncode == 0
    # No heartbeat timeout is needed: the node said goodbye (liveness here is 2 s).
    st = deployment.wait_for(lambda st: st.jobs["queued"] == 3, 1.5, "jobs back in the queue")
    assert not st.nodes[0].alive
    # A planned exit, not a loss: it left, and the broker says so in its status and its log.
    assert st.nodes[0].lost_reason == "left", st.nodes[0]
    assert "node preempted left; re-queueing 3 job(s)" in deployment.log("broker")
    assert "node preempted lost" not in deployment.log("broker")
    deployment.start_node("next")
    results = client.wait(ids, timeout_s=60)
    assert [(r.state, r.node_id, r.attempt) for r in results] == [("done", "next", 2)] * 3


def test_rendezvous_file_is_private(deployment: Deployment) -> None:
    path = deployment.deployment_dir / "broker.json"
    assert (path.stat().st_mode & 0o777) == 0o600
    assert deployment.address.startswith("tcp://127.0.0.1:")


def test_curve_encrypts_and_authenticates(tmp_path: Path) -> None:
    import msgpack
    import zmq

    from prorl_cli import protocol as P

    d = Deployment(tmp_path / "home", "secure", {"broker": {"curve": "on"}})
    try:
        d.start_broker()
        info = __import__("json").loads((d.deployment_dir / "broker.json").read_text())
        assert info["curve_public_key"]
        assert ((d.deployment_dir / "client.key").stat().st_mode & 0o777) == 0o600
        d.start_node("n1")
        assert d.client.process("test", {"echo": "secret"}).output["echo"] == "secret"
        # A peer without the deployment's client key gets nothing: no reply, no job.
        intruder = zmq.Context.instance().socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        pub, sec = zmq.curve_keypair()
        intruder.curve_serverkey = info["curve_public_key"].encode()
        intruder.curve_publickey, intruder.curve_secretkey = pub, sec
        intruder.connect(d.address)
        intruder.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "status", "rid": 1}))
        assert not intruder.poll(1000)
        intruder.close(0)
        plain = zmq.Context.instance().socket(zmq.DEALER)  # no keys at all
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(d.address)
        plain.send(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "status", "rid": 1}))
        assert not plain.poll(1000)
        plain.close(0)
        assert d.client.status().jobs["done"] == 1
    finally:
        d.close()
