"""The router as a plain object: each policy's choice, call bookkeeping, job ends and backend loss.

No sockets: :class:`tests.fakes.broker_cluster.Cluster` records what the
router sent and gives it a table of real ``Node`` records. Everything is
driven by the same handler calls the broker makes.
"""

from __future__ import annotations

import pytest

from prorl_cli.exceptions import ConfigError, ProtocolError
from prorl_cli.protocol import ErrorCode, Op
from tests.fakes.broker_cluster import N1, N2, Cluster, end, hdr, run

# ---------------------------------------------------------------------- policies


def test_least_loaded_sticky_balances_live_jobs_and_keeps_each_job_on_its_backend() -> None:
    c = Cluster()
    c.bridge("b1")
    c.bridge("b2")
    run(c, "j1", "j2", "j3")
    # j3 ties on live jobs (1 each) and goes where fewer calls are in flight (j1 made two).
    assert [c.routed("j1"), c.routed("j2"), c.routed("j1"), c.routed("j3")] == ["b1", "b2", "b1", "b2"]
    assert c.live_jobs() == {"b1": 1, "b2": 2}
    end(c, "j2", "j3")
    run(c, "j4")
    assert c.routed("j4") == "b2"  # no live job left there
    assert c.live_jobs() == {"b1": 1, "b2": 1}


def test_least_loaded_sticky_prefers_the_requesting_nodes_host_on_a_tie() -> None:
    c = Cluster()
    c.bridge("far", host="h9")
    c.bridge("near", host="h2")
    run(c, "j1", node="n2")
    assert c.routed("j1", requester=N2) == "near"


def test_round_robin_sends_each_call_to_the_next_backend_and_binds_no_job() -> None:
    c = Cluster("round_robin")
    c.bridge("b1")
    c.bridge("b2")
    c.bridge("b3")
    run(c, "j1", "j2")
    assert [c.routed("j1") for _ in range(4)] + [c.routed("j2")] == ["b1", "b2", "b3", "b1", "b2"]
    assert c.live_jobs() == {"b1": 0, "b2": 0, "b3": 0}


def test_ever_assigned_counts_jobs_that_ended_where_least_loaded_does_not() -> None:
    choices = {}
    for policy in ("least_loaded_sticky", "ever_assigned"):
        c = Cluster(policy)
        c.bridge("b1")
        c.bridge("b2")
        run(c, "j1", "j2", "j3")
        assert [c.routed("j1"), c.routed("j2"), c.routed("j3")] == ["b1", "b2", "b1"]
        end(c, "j1", "j3")  # b1: 0 live jobs, 2 ever assigned; b2: 1 live, 1 ever
        run(c, "j4")
        choices[policy] = c.routed("j4")
        assert c.routed("j4") == choices[policy], "both policies are sticky"
    assert choices == {"least_loaded_sticky": "b1", "ever_assigned": "b2"}


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="routing_policy: 'fastest'"):
        Cluster("fastest")


# ---------------------------------------------------------------------- bookkeeping


def test_inflight_is_computed_from_pending_calls_and_replies_carry_the_policy_version() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    run(c, "j1", "j2")
    c.generate("j1")
    c.generate("j1")
    c.generate("j2")
    calls = [h["rid"] for h in c.take(b1)]
    assert c.inflight() == {"b1": 3}
    c.reply(b1, calls[0])
    (answer,) = c.take(N1)
    assert answer["ok"] and answer["backend_id"] == "b1" and answer["policy_version"] == 0
    c.reply(b1, calls[0])  # a repeat is ignored
    assert c.take() == [] and c.inflight() == {"b1": 2}
    # A call forwarded after a weight update is labelled with the new version.
    c.router.on_pause_generation(b"trainer", hdr(Op.PAUSE_GENERATION, {"rid": 7, "policy_version": 4}), [])
    c.router.on_resume_generation(b"trainer", hdr(Op.RESUME_GENERATION, {"rid": 8}), [])
    assert [h["policy_version"] for h in c.take(b"trainer")] == [4, 4]
    c.generate("j2")
    (late,) = [h["rid"] for h in c.take(b1)]
    c.reply(b1, late)
    c.reply(b1, calls[2])
    assert [h["policy_version"] for h in c.take(N1)] == [4, 0]
    assert c.inflight() == {"b1": 1}


def test_job_ended_cancels_its_calls_at_the_bridge_and_answers_the_node_at_once() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    run(c, "j1", "j2")
    r1 = c.generate("j1")
    c.generate("j2")
    forwarded = {h["job_id"]: h["rid"] for h in c.take(b1)}
    end(c, "j1")
    assert c.take(b1) == [{"op": Op.GENERATE_CANCEL.value, "rid": forwarded["j1"], "job_id": "j1"}]
    (answer,) = c.take(N1)
    assert answer["rid"] == r1 and not answer["ok"] and answer["error"]["code"] == ErrorCode.UNKNOWN_JOB.value
    assert c.inflight() == {"b1": 1} and c.live_jobs() == {"b1": 1}
    c.reply(b1, forwarded["j1"])  # the bridge answered before it saw the cancel: nobody hears of it
    assert c.take(N1) == []


def test_without_cancel_propagation_an_ended_jobs_calls_keep_running_and_still_answer() -> None:
    c = Cluster(cancel_propagation=False)
    b1 = c.bridge("b1")
    run(c, "j1")
    r1 = c.generate("j1")
    (fwd,) = [h["rid"] for h in c.take(b1)]
    end(c, "j1")
    assert c.take() == [], "no cancel to the bridge, no early answer"
    assert c.inflight() == {"b1": 1} and c.live_jobs() == {"b1": 0}
    c.router.on_generate_cancel(N1, hdr(Op.GENERATE_CANCEL, {"rid": r1, "job_id": "j1"}), [])  # the node's own give-up is not propagated either
    assert c.take(b1) == [] and c.inflight() == {"b1": 1}
    c.reply(b1, fwd)
    (answer,) = c.take(N1)
    assert answer["rid"] == r1 and answer["ok"]
    assert c.inflight() == {"b1": 0}


def test_held_calls_of_an_ended_job_are_answered_and_the_rest_released_on_resume() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    run(c, "j1", "j2")
    c.router.on_pause_generation(b"trainer", hdr(Op.PAUSE_GENERATION, {"rid": 1}), [])
    r1 = c.generate("j1")
    c.generate("j2")
    assert len(c.router.held) == 2 and c.take(b1) == []
    # The node hears that its calls are held (its clocks of those jobs stand still meanwhile).
    assert [(h["op"], h["job_id"], h["held"]) for h in c.take(N1)] == [("generate_held", "j1", True), ("generate_held", "j2", True)]
    end(c, "j1")
    (answer,) = c.take(N1)
    assert answer["rid"] == r1 and answer["error"]["code"] == ErrorCode.UNKNOWN_JOB.value
    c.router.on_resume_generation(b"trainer", hdr(Op.RESUME_GENERATION, {"rid": 2}), [])
    assert [h["job_id"] for h in c.take(b1)] == ["j2"]
    assert len(c.router.held) == 0


def test_calls_wait_for_a_first_backend() -> None:
    c = Cluster()
    run(c, "j1")
    c.generate("j1")
    assert len(c.router.held) == 1 and [(h["op"], h["held"]) for h in c.take()] == [("generate_held", True)]
    b1 = c.bridge("b1")
    assert [h["job_id"] for h in c.take(b1)] == ["j1"]
    assert len(c.router.held) == 0
    assert [(h["op"], h["held"]) for h in c.take(N1)] == [("generate_held", False)]


# ---------------------------------------------------------------------- refusals (defects 7, 17)


def test_generate_from_an_unregistered_peer_is_refused_and_nothing_is_held() -> None:
    c = Cluster()
    run(c, "j1")
    c.generate("j1", requester=b"stranger")
    (answer,) = c.take(b"stranger")
    assert answer["error"]["code"] == ErrorCode.UNKNOWN_PEER.value
    assert len(c.router.held) == 0 and len(c.router.pending) == 0
    for op, handler in ((Op.GENERATE_DONE, c.router.on_generate_done), (Op.GENERATE_CANCEL, c.router.on_generate_cancel)):
        handler(b"stranger", hdr(op, {"rid": 3, "job_id": "j1", "backend_id": "b1"}), [])
        assert c.take(b"stranger")[0]["error"]["code"] == ErrorCode.UNKNOWN_PEER.value
    c.router.on_generate_reply(b"stranger", hdr(Op.GENERATE_REPLY, {"rid": 1}), [])
    assert c.take(b"stranger")[0]["error"]["code"] == ErrorCode.UNKNOWN_PEER.value


@pytest.mark.parametrize("where", [None, "n2"], ids=["not-running", "on-another-node"])
def test_generate_for_a_job_not_running_on_the_requester_is_refused_and_never_routed(where: str | None) -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    if where is not None:
        run(c, "j1", node=where)
    c.generate("j1")
    (answer,) = c.take(N1)
    assert answer["error"]["code"] == ErrorCode.UNKNOWN_JOB.value and "j1" in answer["error"]["message"]
    assert c.take(b1) == [] and c.live_jobs() == {"b1": 0} and c.inflight() == {"b1": 0}


def test_a_bridge_cannot_answer_another_bridges_call() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    b2 = c.bridge("b2")
    run(c, "j1")
    c.generate("j1")
    (fwd,) = [h["rid"] for h in c.take(b1)]
    c.reply(b2, fwd)
    assert c.take(N1) == [] and c.inflight()["b1"] == 1


# ---------------------------------------------------------------------- backend loss, HTTP backends, stop


def test_a_call_goes_on_after_one_lost_backend_and_fails_after_two() -> None:
    """A backend lost (its engine died, it fell silent) may have been killed by the call: the call runs once more
    elsewhere, and a second loss under it answers ``backend_error`` naming that backend."""
    c = Cluster()
    b1 = c.bridge("b1")
    run(c, "j1")
    r1 = c.generate("j1")
    c.take(b1)
    c.router.unregister(b1, "engine of backend b1 is down: exit 1")
    (held,) = c.take(N1)  # no other backend: it waits for one
    assert held["op"] == Op.GENERATE_HELD.value and held["held"]
    assert c.router.backend_statuses() == [] and not c.router.bridges_alive()
    b2 = c.bridge("b2")
    (again,) = [h for h in c.take(b2) if h["op"] == Op.GENERATE.value]
    assert again["job_id"] == "j1"
    c.router.unregister(b2, "engine of backend b2 is down: exit 1")
    answer = [a for a in c.take(N1) if a["op"] == Op.REPLY.value][-1]
    assert answer["rid"] == r1 and answer["error"]["code"] == ErrorCode.BACKEND_ERROR.value and "b2" in answer["error"]["message"]
    assert len(c.router.held) == 0
    c.bridge("b3")
    assert c.routed("j1") == "b3"  # the job's later calls go on


def test_a_bridge_that_leaves_has_its_calls_routed_again_not_failed() -> None:
    """A scale-down, a time limit's warning or ``down``: no call's fault. Each call the bridge had not answered
    goes to another backend, or waits for one, and its node gets the answer of its own request."""
    c = Cluster()
    b1, b2 = c.bridge("b1"), c.bridge("b2")
    run(c, "j1", "j2")
    r1, r2 = c.generate("j1"), c.generate("j2")
    assert {who for who, h, _ in c.sent if h["op"] == Op.GENERATE.value} == {b1, b2}
    c.sent.clear()
    c.router.unregister(b1)  # left: j1's call runs again on b2
    assert c.take(N1) == []
    (again,) = c.take(b2)
    assert again["op"] == Op.GENERATE.value and again["job_id"] == "j1"
    c.reply(b2, again["rid"])
    (answer,) = c.take(N1)
    assert answer["rid"] == r1 and "error" not in answer and answer["backend_id"] == "b2"
    gone = {s.backend_id: (s.gone_reason, s.inflight, s.jobs) for s in c.router.gone.statuses()}
    assert gone == {"b1": ("left", 0, 0)}  # it serves nothing now: shown so
    c.router.unregister(b2)  # the last bridge leaves: j2's call waits for the next one, its node told so
    (held,) = c.take(N1)
    assert held["op"] == Op.GENERATE_HELD.value and held["job_id"] == "j2" and held["held"]
    b3 = c.bridge("b3")
    (again,) = [h for h in c.take(b3) if h["op"] == Op.GENERATE.value]
    assert again["job_id"] == "j2"
    c.reply(b3, again["rid"])
    answers = c.take(N1)
    assert [a["rid"] for a in answers if a["op"] == Op.REPLY.value] == [r2], answers
    assert c.inflight() == {"b3": 0}


def test_a_bridge_that_names_a_fault_is_lost_one_that_does_not_has_left() -> None:
    c = Cluster()
    b1, b2 = c.bridge("b1"), c.bridge("b2")
    c.router.unregister(b1)  # a signal, a scale-down, `down`: nothing broke
    c.router.unregister(b2, "engine of backend b2 is down: exit 1")
    assert {s.backend_id: (s.alive, s.gone_reason) for s in c.router.gone.statuses()} == {
        "b1": (False, "left"), "b2": (False, "engine of backend b2 is down: exit 1")}
    c.bridge("b1")  # back (a requeue): no longer gone
    assert [s.backend_id for s in c.router.gone.statuses()] == ["b2"]


def test_silent_bridge_is_lost_on_tick() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    run(c, "j1")
    c.generate("j1")
    c.take(b1)
    c.router.tick(c.router.backends["b1"].last_seen + 1.0)
    assert c.take(b1) == [{"op": Op.HEARTBEAT.value}]
    c.router.tick(c.router.backends["b1"].last_seen + 10.0)
    assert "b1" not in c.router.backends
    (held,) = c.take(N1)  # its call goes on, once, when another backend registers
    assert held["op"] == Op.GENERATE_HELD.value
    b2 = c.bridge("b2")
    (again,) = [h for h in c.take(b2) if h["op"] == Op.GENERATE.value]
    c.router.tick(c.router.backends["b2"].last_seen + 10.0)  # silent too: the second loss under the call
    assert [a["error"]["code"] for a in c.take(N1) if a["op"] == Op.REPLY.value] == [ErrorCode.BACKEND_ERROR.value]


def test_http_backend_redirects_counts_until_done_and_is_pruned_once_cleared_and_idle() -> None:
    c = Cluster()
    url = "http://h3:8000/v1"
    c.router.http.on_add_llm_server(b"trainer", hdr(Op.ADD_LLM_SERVER, {"rid": 1, "url": url + "/"}), [])
    run(c, "j1")
    r1 = c.generate("j1")
    (answer,) = c.take(N1)
    assert answer["rid"] == r1 and answer["redirect"] == url and answer["policy_version"] == 0
    assert c.inflight() == {url: 1} and c.live_jobs() == {url: 1}
    c.router.http.on_clear_llm_server(b"trainer", hdr(Op.CLEAR_LLM_SERVER, {"rid": 2, "url": url}), [])
    assert url in c.router.backends, "a job still uses it"
    c.router.on_generate_done(N1, hdr(Op.GENERATE_DONE, {"job_id": "j1", "backend_id": url}), [])
    assert c.inflight() == {url: 0}
    end(c, "j1")
    assert url not in c.router.backends


def test_stop_answers_held_and_forwarded_calls_and_shuts_bridges_down() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    run(c, "j1", "j2")
    c.generate("j1")
    c.take()
    c.router.on_pause_generation(b"trainer", hdr(Op.PAUSE_GENERATION, {"rid": 1}), [])
    c.generate("j2")
    c.take()
    c.router.stop()
    assert c.take(b1) == [{"op": Op.SHUTDOWN.value}]
    codes = [h["error"]["code"] for h in c.take(N1)]
    assert codes == [ErrorCode.SHUTTING_DOWN.value] * 2
    assert len(c.router.held) == 0 and len(c.router.pending) == 0


def test_bad_policy_version_is_refused_by_name() -> None:
    # The op's schema refuses it before the router sees it (the broker answers with this error).
    with pytest.raises(ProtocolError) as e:
        hdr(Op.PAUSE_GENERATION, {"rid": 1, "policy_version": "v2"})
    assert e.value.code == ErrorCode.BAD_FIELD.value and "policy_version" in e.value.message


# ---------------------------------------------------------------------- weight sync: drain, update, versions


def test_a_draining_pause_is_answered_when_the_last_call_ends_or_at_its_deadline() -> None:
    import time

    c = Cluster()
    b1 = c.bridge("b1")
    run(c, "j1", "j2")
    c.generate("j1")
    c.generate("j2")
    (f1, f2) = [h["rid"] for h in c.take(b1)]
    c.router.on_pause_generation(b"trainer", hdr(Op.PAUSE_GENERATION, {"rid": 7, "drain_timeout_s": 60.0}), [])
    assert c.take(b"trainer") == []  # two calls in flight: no answer yet
    c.reply(b1, f1)
    assert c.take(b"trainer") == []
    c.reply(b1, f2)
    (answer,) = c.take(b"trainer")
    assert answer["ok"] and answer["rid"] == 7 and answer["drained"] is True and c.router.paused

    c.router.on_resume_generation(b"trainer", hdr(Op.RESUME_GENERATION, {"rid": 8}), [])
    c.take()
    c.generate("j1")
    c.router.on_pause_generation(b"trainer", hdr(Op.PAUSE_GENERATION, {"rid": 9, "drain_timeout_s": 5.0}), [])
    c.router.check_waiters(time.monotonic() + 6.0)
    (late,) = c.take(b"trainer")
    assert late["error"]["code"] == ErrorCode.DRAIN_TIMEOUT.value and "job j1 on b1" in late["error"]["message"]
    assert [r["job_id"] for r in late["running"]] == ["j1"] and c.router.paused  # it stays paused


def test_update_weights_waits_for_each_bridge_and_names_the_failures() -> None:
    c = Cluster()
    b1, b2 = c.bridge("b1"), c.bridge("b2")
    c.router.on_update_weights(b"trainer", hdr(Op.UPDATE_WEIGHTS, {"rid": 3, "checkpoint": "/c/v2", "policy_version": 2}), [])
    fwd = {who: h for who, h, _ in c.sent if h.get("op") == Op.UPDATE_WEIGHTS.value}
    assert set(fwd) == {b1, b2} and all(h["checkpoint"] == "/c/v2" and h["policy_version"] == 2 for h in fwd.values())
    c.sent.clear()
    c.router.on_weights_updated(b1, hdr(Op.WEIGHTS_UPDATED, {"rid": fwd[b1]["rid"]}), [])
    assert c.take(b"trainer") == []
    c.router.on_weights_updated(b2, hdr(Op.WEIGHTS_UPDATED, {"rid": fwd[b2]["rid"], "error": {"code": "reload_failed", "message": "bad shapes"}}), [])
    (answer,) = c.take(b"trainer")
    assert answer["error"]["code"] == ErrorCode.RELOAD_FAILED.value and answer["failed"] == {"b2": "bad shapes"}
    assert answer["updated"] == ["b1"] and c.router.policy_version == 0  # not all loaded: the version stays
    c.router.on_update_weights(b"trainer", hdr(Op.UPDATE_WEIGHTS, {"rid": 4, "checkpoint": "/c/v3", "policy_version": 3}), [])
    for who, h, _ in [s for s in c.sent if s[1].get("op") == Op.UPDATE_WEIGHTS.value]:
        c.router.on_weights_updated(who, hdr(Op.WEIGHTS_UPDATED, {"rid": h["rid"]}), [])
    (ok,) = c.take(b"trainer")
    assert ok["ok"] and sorted(ok["updated"]) == ["b1", "b2"] and c.router.policy_version == 3


def test_a_generate_reply_carries_the_bridges_own_version_when_it_has_one() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    run(c, "j1")
    c.router.on_pause_generation(b"trainer", hdr(Op.PAUSE_GENERATION, {"rid": 1, "policy_version": 5}), [])
    c.router.on_resume_generation(b"trainer", hdr(Op.RESUME_GENERATION, {"rid": 2}), [])
    c.take()
    c.generate("j1")
    (fwd,) = c.take(b1)
    c.reply(b1, fwd["rid"], policy_version=4)  # the bridge served it with the weights of version 4
    (answer,) = c.take(N1)
    assert answer["policy_version"] == 4
    c.generate("j1")
    (fwd,) = c.take(b1)
    c.reply(b1, fwd["rid"])  # a bridge that does not say: the broker's version when it routed the call
    (answer,) = c.take(N1)
    assert answer["policy_version"] == 5


def test_a_call_that_cannot_be_sent_to_a_killed_bridge_goes_on_elsewhere_or_waits() -> None:
    """A bridge killed (SIGKILL) disconnects before its heartbeats are missed: the next call sent to it fails to
    send. That call never reached it, so it cannot have killed it: it goes to another backend, or waits for the
    next one, instead of failing its job; the bridge is lost."""
    c = Cluster()
    b1, b2 = c.bridge("b1"), c.bridge("b2")
    run(c, "j1", "j2")
    c.unreachable.add(b1)  # killed: j1 is bound to no bridge yet, the least loaded is tried first
    r1 = c.generate("j1")
    (sent,) = [h for h in c.take(b2) if h["op"] == Op.GENERATE.value]
    assert sent["job_id"] == "j1" and c.take(N1) == []  # no error for the node: the call runs on b2
    c.reply(b2, sent["rid"])
    (answer,) = [a for a in c.take(N1) if a["op"] == Op.REPLY.value]
    assert answer["rid"] == r1 and "error" not in answer and answer["backend_id"] == "b2"
    assert [s.backend_id for s in c.router.backend_statuses()] == ["b2"]
    c.unreachable.add(b2)  # the last bridge killed too: the next call waits for one, its node told so
    c.generate("j2")
    (held,) = c.take(N1)
    assert held["op"] == Op.GENERATE_HELD.value and held["held"] and len(c.router.held) == 1
    b3 = c.bridge("b3")
    assert [h["job_id"] for h in c.take(b3) if h["op"] == Op.GENERATE.value] == ["j2"]
