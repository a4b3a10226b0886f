"""A broker that crashes and restarts: its journal, nodes claiming their jobs back, clients watching again."""

from __future__ import annotations

import atexit
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.harness import Deployment, fixed_port

#: Checkpoint folders the trainer's update_weights names (the client refuses one that is not there); the fake
#: engines here load nothing from them.
CKPT = Path(tempfile.mkdtemp(prefix="prorl-ckpt-"))
for _v in (1, 2, 3):
    (CKPT / f"v{_v}").mkdir()
atexit.register(shutil.rmtree, CKPT, True)


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Deployment]]:
    """``make(journal=True)``: a deployment on a fixed port (a restarted broker binds it again), one node of credit 2."""
    made: list[Deployment] = []

    def _make(journal: bool = True, compact_mb: int = 256) -> Deployment:
        d = Deployment(tmp_path / "home", "jr", config={
            "broker": {"port": fixed_port(), "journal": journal, "journal_compact_mb": compact_mb},
            "node": {"n_init": 2, "n_run": 2, "n_eval": 2, "credit": 2},
        })
        made.append(d)
        d.start_broker()
        d.start_node("n1")
        return d

    yield _make
    for d in made:
        d.close()


def _runs(journal: Path) -> dict[str, list[str]]:
    return {f.stem: [line.split()[2] for line in f.read_text().splitlines()] for f in journal.glob("*.log")}


def test_a_restarted_broker_replays_its_journal_and_no_job_runs_twice(make: Callable[..., Deployment], tmp_path: Path) -> None:
    d = make()
    runs = tmp_path / "runs"
    runs.mkdir()
    client = d.client
    (early,) = client.submit("test", [{"echo": "before"}])
    assert client.wait([early], timeout_s=30)[0].ok
    ids = client.submit("test", [{"sleep_s": {"run": 1.0}, "journal": str(runs)}] * 6, timeout_s=60)
    d.wait_for(lambda st: st.jobs["run"] == 2, 30, "two jobs running, four queued")
    d.kill("broker", signal.SIGKILL)
    d.start_broker()
    # The same client, which submitted before the crash, gets every result: it watches again by itself.
    results = client.wait(ids, timeout_s=120)
    assert [r.state for r in results] == ["done"] * 6
    assert [r.attempt for r in results] == [1] * 6
    assert _runs(runs) == {j: ["init", "run", "eval"] for j in ids}, "each job ran once, start to end"
    # A result from before the crash is still there for a new client.
    late = d.new_client()
    assert late.result(early, timeout_s=30).output["echo"] == "before"
    late.close()
    assert "journal replayed: 7 job(s), 6 unfinished" in d.log("broker")
    assert "registering again" in d.log("n1")


def test_a_torn_journal_tail_is_reported_and_the_rest_replayed(make: Callable[..., Deployment]) -> None:
    d = make()
    ids = d.client.submit("test", [{"echo": i} for i in range(3)])
    assert all(r.ok for r in d.client.wait(ids, timeout_s=30))
    d.kill("broker", signal.SIGKILL)
    torn = b"\x85\xa1t\xa3job\xa4spec"  # a record cut off mid-write
    with open(d.deployment_dir / "broker.journal", "ab") as f:
        f.write(torn)
    d.start_broker()
    fresh = d.new_client()
    assert [r.output["echo"] for r in (fresh.result(j, timeout_s=30) for j in ids)] == [0, 1, 2]
    fresh.close()
    assert f"ignoring a torn record in its last {len(torn)} bytes" in d.log("broker")


def test_a_journal_compacted_all_along_replays_the_same(make: Callable[..., Deployment]) -> None:
    d = make(compact_mb=0)  # rewritten after every write: compaction must keep exactly what a replay needs
    ids = d.client.submit("test", [{"echo": i} for i in range(5)])
    assert all(r.ok for r in d.client.wait(ids, timeout_s=30))
    queued = d.client.submit("test", [{"echo": "later"}], timeout_s=60)
    d.kill("broker", signal.SIGKILL)
    d.start_broker()
    fresh = d.new_client()
    assert [fresh.result(j, timeout_s=30).output["echo"] for j in ids] == [0, 1, 2, 3, 4]
    assert fresh.wait(queued, timeout_s=60)[0].output["echo"] == "later"
    fresh.close()
    assert d.log("broker").count("compacted") > 2, "compacted while running, not only at the two starts"


def test_without_a_journal_waiting_clients_hear_that_their_jobs_are_gone(make: Callable[..., Deployment]) -> None:
    d = make(journal=False)
    ids = d.client.submit("test", [{"hang_in": "run"}] * 2, timeout_s=60)
    d.wait_for(lambda st: st.jobs["run"] == 2, 30, "both jobs running")
    d.kill("broker", signal.SIGKILL)
    d.start_broker()
    results = d.client.wait(ids, timeout_s=60)
    assert [r.state for r in results] == ["failed"] * 2
    assert {r.error["type"] for r in results if r.error} == {"BrokerRestarted"}
    assert all(r.task == "test" for r in results)
    # The node dropped the jobs the new broker does not know, instead of running them on.
    d.wait_for(lambda st: bool(st.nodes) and st.nodes[0].alive and st.nodes[0].inflight == 0, 30, "n1 back, idle")
    assert "ended or moved to another node meanwhile; dropping it" in d.log("n1")


def test_nodes_and_clients_follow_a_broker_restarted_at_a_new_address(tmp_path: Path) -> None:
    """With a free port (the default), the new broker listens elsewhere; peers find it in the rendezvous file."""
    from prorl_cli.client import RolloutClient

    d = Deployment(tmp_path / "home", "mv", config={"node": {"n_init": 2, "n_run": 2, "n_eval": 2, "credit": 2}})
    runs = tmp_path / "runs"
    runs.mkdir()
    try:
        d.start_broker()
        old_address = d.address
        d.start_node("n1")
        client = RolloutClient("mv", config=d.load_config())  # no address: it reads the rendezvous file
        ids = client.submit("test", [{"sleep_s": {"run": 1.0}, "journal": str(runs)}] * 4, timeout_s=60)
        d.wait_for(lambda st: st.jobs["run"] == 2, 30, "two jobs running, two queued")
        d.kill("broker", signal.SIGKILL)
        # The new broker binds a port below the ephemeral range: surely not the one the kernel gave the old one.
        d.config_path.write_text(yaml.safe_dump({**d.config, "broker": {"port": fixed_port()}}))
        d.start_broker()
        assert d.address != old_address
        results = client.wait(ids, timeout_s=120)
        client.close()
        assert [r.state for r in results] == ["done"] * 4
        assert _runs(runs) == {j: ["init", "run", "eval"] for j in ids}, "each job ran once, start to end"
        assert f"the broker moved from {old_address} to {d.address}; node follows it" in d.log("n1")
    finally:
        d.close()


def _bridge(d: Deployment, backend_id: str) -> None:
    """A real bridge process (the simulated engine, which loads any checkpoint it is sent), registered."""
    d.spawn(backend_id, "serve", "inference", "--engine", "sim", "--backend-id", backend_id)
    d.wait_for(lambda st: any(b.backend_id == backend_id and b.alive for b in st.backends), 60,
               f"backend {backend_id} to register", backend_id)


def _version(d: Deployment, backend_id: str) -> int | None:
    (b,) = [b for b in d.client.list_backends() if b.backend_id == backend_id]
    return None if b.loading else b.policy_version


def test_a_restarted_broker_still_knows_the_current_weights(make: Callable[..., Deployment]) -> None:
    """Weights every bridge loaded are journaled before the trainer hears of it: after a crash, a bridge joining
    on its start weights is sent them, and so after a second crash (the record survives compaction)."""
    d = make()
    _bridge(d, "b1")
    done = d.client.update_weights(f"{CKPT}/v3", policy_version=3, timeout_s=60)
    assert list(done.updated) == ["b1"]
    d.kill("broker", signal.SIGKILL)  # at once: the reply came, so the record is on disk
    d.start_broker()
    assert f"current weights from the journal: {CKPT}/v3 (policy version 3)" in d.log("broker")
    # A replacement bridge (a requeued Slurm task) starts on its start weights: it is sent v3 first.
    _bridge(d, "b2")
    d.wait_for(lambda st: any(b.backend_id == "b2" and b.policy_version == 3 and not b.loading
                              for b in st.backends), 60, "b2 to load the current weights")
    assert f"backend b2 joined on its start weights: it loads {CKPT}/v3 (policy version 3)" in d.log("broker")
    # b1 rejoins the new broker on v3 itself: nothing to load again.
    d.wait_for(lambda st: any(b.backend_id == "b1" and b.alive for b in st.backends), 60, "b1 to rejoin")
    assert _version(d, "b1") == 3 and "backend b1 joined on its start weights" not in d.log("broker")
    d.kill("broker", signal.SIGKILL)
    d.start_broker()
    assert d.log("broker").count(f"current weights from the journal: {CKPT}/v3 (policy version 3)") == 2


def test_a_restarted_broker_still_knows_whether_a_bridge_verified_the_current_weights(
    make: Callable[..., Deployment],
) -> None:
    """Weights taken with no bridge up come back unverified after a crash; once a bridge has loaded them the
    journal says so too, and the next broker reports them verified."""
    d = make()
    done = d.client.update_weights(f"{CKPT}/v2", policy_version=2, timeout_s=60)
    assert (done.updated, done.verified) == ([], False)
    d.kill("broker", signal.SIGKILL)
    d.start_broker()
    assert (f"current weights from the journal: {CKPT}/v2 (policy version 2, unverified: no bridge loaded them yet)"
            in d.log("broker"))
    weights = d.client.status().weights
    assert weights is not None and (weights.policy_version, weights.verified) == (2, False), weights
    _bridge(d, "b1")  # on its start weights: it loads v2, which verifies them
    d.wait_for(lambda st: st.weights is not None and st.weights.verified, 60, "b1 to verify the weights", "b1")
    d.kill("broker", signal.SIGKILL)  # the status said verified: the record saying so is on disk
    d.start_broker()
    assert d.log("broker").count(f"current weights from the journal: {CKPT}/v2 (policy version 2)") == 1
    weights = d.client.status().weights
    assert weights is not None and (weights.checkpoint, weights.verified) == (f"{CKPT}/v2", True), weights
