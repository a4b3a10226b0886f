"""Stopping a deployment with jobs in it (real broker, node and client): what their results say."""

from __future__ import annotations

from pathlib import Path

from prorl_cli.protocol import Op
from prorl_cli.testing.harness import Deployment
from tests.fakes.broker_cluster import Cluster, hdr


def test_jobs_a_stopping_deployment_cancels_say_why(tmp_path: Path) -> None:
    """``prorl stop``/``down`` mid-run: the cancelled results named no reason, so a trainer could not tell them
    from its own cancels."""
    with Deployment(tmp_path / "home", "stop", config={"node": {"n_run": 1}}) as d:
        d.start_broker()
        d.start_node("n1")
        client = d.new_client()
        running, queued = client.submit("test", [{"sleep_s": {"run": 60}}, {"echo": "queued"}])
        d.wait_for(lambda st: st.jobs.get("run") == 1, 30, "one job running")
        stream = client.results([running, queued], timeout_s=60)
        d.client.stop()
        results = {r.job_id: r for r in stream}
        for job_id in (running, queued):
            result = results[job_id]
            assert result.state == "cancelled" and result.error is not None, result
            assert result.error["type"] == "DeploymentStopped" and "stopped" in result.error["message"]
        client.close()


def test_a_bridge_that_registers_while_the_broker_stops_is_told_to_shut_down() -> None:
    """As a node is: taken on by a broker about to exit, it would register again for ever once the broker is
    gone, and the stop would wait for it until its deadline."""
    c = Cluster()
    c.bridge("b1")
    c.take()
    c.router.stop()
    late = b"bridge-late"
    c.router.on_register_backend(late, hdr(Op.REGISTER_BACKEND, {"rid": 1, "backend_id": "late", "host": "h",
                                                                   "model": "m"}), [])
    assert [h["op"] for h in c.take(late)] == [Op.SHUTDOWN.value]
    assert "late" not in {s.backend_id for s in c.router.backend_statuses()}
