"""Drain with grace: on SIGUSR2 a node hands back what it has not started, lets running jobs finish for
``node.drain_grace_s`` (delivered once, not rerun), then stops the rest, which the broker runs elsewhere."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.harness import Deployment

GRACE_S = 8.0


def test_usr2_delivers_what_finishes_in_the_grace_and_reruns_the_rest_elsewhere(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "drain", config={
        "node": {"n_init": 1, "n_run": 3, "n_eval": 1, "credit": 5, "drain_grace_s": GRACE_S},
    })
    try:
        d.start_broker()
        d.start_node("n1")
        client = d.client
        stream = client.results(timeout_s=120)
        [long_job] = client.submit("test", [{"sleep_s": {"run": 60}, "echo": "long"}])
        short = list(client.submit("test", [{"sleep_s": {"run": 2}, "echo": "short"}] * 2))
        d.wait_for(lambda st: st.jobs.get("run") == 3, 30, "three jobs running")
        [slow_init] = client.submit("test", [{"sleep_s": {"init": 60}, "echo": "slow init"}])
        d.wait_for(lambda st: st.jobs.get("init") == 1, 30, "a job in INIT")
        [queued] = client.submit("test", [{"echo": "queued"}])  # waits for n1's only INIT slot: never starts there
        d.wait_for(lambda st: st.jobs.get("assigned") == 1, 30, "the fifth job placed on n1")
        os.killpg(d.procs["n1"].pid, signal.SIGUSR2)
        d.wait_for(lambda st: any(n.node_id == "n1" and n.draining for n in st.nodes), 30, "n1 draining", "n1")
        d.start_node("n2")
        got = {r.job_id: r for r in (next(stream) for _ in range(3))}  # the two short ones and the handed-back one
        assert sorted(got) == sorted([*short, queued]), got
        for job_id in short:  # finished in the grace on n1: delivered, not rerun
            assert (got[job_id].state, got[job_id].node_id, got[job_id].attempt) == ("done", "n1", 1), got[job_id]
        assert (got[queued].state, got[queued].node_id, got[queued].attempt) == ("done", "n2", 1), got[queued]
        # After the grace n1 stops the rest and leaves; the broker runs them on n2 as their next attempt.
        assert d.procs["n1"].wait(timeout=GRACE_S + 30) == 0
        d.wait_for(lambda st: any(n.node_id == "n2" and n.inflight == 2 for n in st.nodes), 30,
                   "the two unfinished jobs rerun on n2")
        client.cancel([long_job, slow_init])
        rest = {r.job_id: r for r in (next(stream) for _ in range(2))}
        for job_id in (long_job, slow_init):
            assert (rest[job_id].state, rest[job_id].node_id, rest[job_id].attempt) == ("cancelled", "n2", 2), rest[job_id]
        stream.close()
        assert "handed back 1 queued job(s)" in d.log("n1"), d.log("n1")
        assert "drain grace over: stopping 2 job(s)" in d.log("n1"), d.log("n1")
    finally:
        d.close()


def test_a_draining_node_hands_back_jobs_done_with_init_instead_of_starting_their_run(tmp_path: Path) -> None:
    """A RUN begun late in the grace is cut short and runs again as a new attempt (repeated preemptions would spend
    max_attempts so): jobs waiting for a RUN slot when the drain begins, or ending INIT during it, go back whole."""
    d = Deployment(tmp_path / "home", "drain2", config={
        "node": {"n_init": 2, "n_run": 1, "n_eval": 1, "credit": 4, "drain_grace_s": GRACE_S},
    })
    try:
        d.start_broker()
        d.start_node("n1")
        client = d.client
        [busy] = client.submit("test", [{"sleep_s": {"run": 4}, "echo": "busy"}])
        d.wait_for(lambda st: st.jobs.get("run") == 1, 30, "the RUN slot taken")
        [waiting] = client.submit("test", [{"echo": "waits for RUN"}])
        [in_init] = client.submit("test", [{"sleep_s": {"init": 1}, "echo": "in INIT"}])
        d.wait_for(lambda st: st.jobs.get("init") == 2, 30, "one job waiting for RUN, one in INIT")
        os.killpg(d.procs["n1"].pid, signal.SIGUSR2)
        d.wait_for(lambda st: any(n.node_id == "n1" and n.draining for n in st.nodes), 30, "n1 draining", "n1")
        d.start_node("n2")
        results = {r.job_id: r for r in client.wait([busy, waiting, in_init], timeout_s=120)}
        assert (results[busy].state, results[busy].node_id, results[busy].attempt) == ("done", "n1", 1)
        for job_id in (waiting, in_init):  # their INIT ran on n1, the rest on n2, as the same attempt
            assert (results[job_id].state, results[job_id].node_id, results[job_id].attempt) == ("done", "n2", 1), \
                results[job_id]
        assert "goes back to the broker after its INIT" in d.log("n1"), d.log("n1")
    finally:
        d.close()
