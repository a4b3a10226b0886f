"""KV-cache admission in the router: a new job's first call waits while no backend's KV cache has room for it."""

from __future__ import annotations

import time

from prorl_cli.broker.admission import KvAdmission, call_tokens
from prorl_cli.protocol import ErrorCode, Op, SamplingParams, pack_tokens
from prorl_cli.protocol.headers import Generate
from tests.fakes.broker_cluster import N1, Cluster, end, hdr, run


class Clocked(Cluster):
    """A cluster whose admission reads a clock the test sets."""

    now = 0.0


def admitting(capacity: int | None, *backends: str, max_wait_s: float = 60.0) -> tuple[Clocked, dict[str, bytes]]:
    """A cluster whose backends report ``capacity`` KV tokens (None: report nothing), admission on at 100%."""
    c = Clocked()
    c.router.admission = KvAdmission(1.0, max_wait_s, clock=lambda: c.now)
    ids = {}
    for b in backends:
        ids[b] = c.bridge(b)
        if capacity is not None:
            assert c.router.bridge_heartbeat(ids[b], hdr(Op.HEARTBEAT, {"stats": {"kv_capacity_tokens": capacity}}))
    return c, ids


def call(c: Cluster, job_id: str, prompt_tokens: int, max_tokens: int = 10) -> int:
    c._rid += 1
    h = {"op": Op.GENERATE, "rid": c._rid, "job_id": job_id, "sampling": {"max_tokens": max_tokens}}
    c.router.on_generate(N1, hdr(Op.GENERATE, h), [pack_tokens(list(range(prompt_tokens)))])
    return c._rid


def forwarded(c: Cluster) -> list[tuple[str, str]]:
    """(job, backend) of the calls sent to bridges since the last look."""
    out = [(h["job_id"], who.decode().removeprefix("bridge-")) for who, h, _ in c.sent if h.get("op") == Op.GENERATE.value]
    c.sent = [s for s in c.sent if s[1].get("op") != Op.GENERATE.value]
    return out


def test_call_tokens_counts_the_prompt_and_max_tokens() -> None:
    assert call_tokens(Generate(1, "j", SamplingParams.from_given(max_tokens=7)), [pack_tokens([1, 2, 3])]) == 10
    # A call that left max_tokens to the engine reserves its prompt only.
    assert call_tokens(Generate(1, "j", SamplingParams.from_given(temperature=0.5)), [pack_tokens([1])]) == 1
    assert call_tokens(Generate(1, "j"), []) == 0


def test_a_new_job_waits_for_room_and_a_placed_jobs_calls_never_do() -> None:
    c, _ = admitting(100, "b1")
    run(c, "j1", "j2")
    call(c, "j1", 50)
    call(c, "j2", 50)  # 60 + 60 > 100: waits
    assert forwarded(c) == [("j1", "b1")] and len(c.router.admission) == 1
    call(c, "j1", 80)  # j1 is placed: its next call goes at once, whatever its size
    assert forwarded(c) == [("j1", "b1")] and c.router.admission.load("b1") == 90
    end(c, "j1")  # its share is free: the waiting first call goes
    assert forwarded(c) == [("j2", "b1")] and len(c.router.admission) == 0
    # A young job reserves at least the mean call context so far (60, 90, 60): its context will grow.
    assert c.router.admission.load("b1") == 70


def test_a_young_job_reserves_the_mean_context_of_the_calls_so_far() -> None:
    c, _ = admitting(1000, "b1")
    run(c, "old", "new1", "new2")
    for n in (290, 490, 690):  # a multi-turn job whose context grew: mean call 500
        call(c, "old", n)
    assert c.router.admission.load("b1") == 700
    call(c, "new1", 40)  # needs 50 now, reserves 500 (mean of 300, 500, 700 is 500): 1,200 > 1,000
    assert forwarded(c) == [("old", "b1")] * 3 and len(c.router.admission) == 1
    end(c, "old")
    call(c, "new2", 40)  # behind new1 in arrival order
    assert [j for j, _ in forwarded(c)] == ["new1", "new2"]


def test_waiting_calls_go_in_arrival_order_to_where_room_frees_and_at_most_max_wait_s_late() -> None:
    c, _ = admitting(100, "b1", "b2", max_wait_s=30.0)
    run(c, "j1", "j2", "j3", "j4")
    for j in ("j1", "j2", "j3", "j4"):
        call(c, j, 70)
    assert forwarded(c) == [("j1", "b1"), ("j2", "b2")]
    end(c, "j2")
    assert forwarded(c) == [("j3", "b2")], "the oldest waiting call first; j4 still fits nowhere"
    c.now = 5.0
    c.router.tick(0.0)
    assert forwarded(c) == []
    c.now = 31.0
    c.router.tick(0.0)  # waited its longest: the policy's choice anyway
    assert [j for j, _ in forwarded(c)] == ["j4"] and len(c.router.admission) == 0


def test_a_waiting_call_of_a_job_that_ends_is_answered_and_stop_answers_the_rest() -> None:
    c, _ = admitting(100, "b1")
    run(c, "j1", "j2", "j3")
    call(c, "j1", 90)
    r2 = call(c, "j2", 90)
    r3 = call(c, "j3", 90)
    forwarded(c)
    c.sent.clear()
    end(c, "j2")
    (answer,) = c.take(N1)
    assert answer["rid"] == r2 and answer["error"]["code"] == ErrorCode.UNKNOWN_JOB.value
    assert len(c.router.admission) == 1
    c.router.stop()
    answers = [h for h in c.take(N1) if h.get("rid") == r3]
    assert answers and answers[0]["error"]["code"] == ErrorCode.SHUTTING_DOWN.value


def test_a_backend_that_reports_no_kv_capacity_is_never_limited() -> None:
    c, _ = admitting(None, "b1")
    run(c, "j1", "j2", "j3")
    for j in ("j1", "j2", "j3"):
        call(c, j, 10_000)
    assert [j for j, _ in forwarded(c)] == ["j1", "j2", "j3"]


def test_admission_is_off_for_a_policy_without_stickiness() -> None:
    c = Cluster(policy="round_robin")
    assert not c.router.admission.enabled


def test_a_waiting_first_call_its_node_gave_up_on_is_answered_and_never_routed() -> None:
    c, _ = admitting(100, "b1")
    run(c, "j1", "j2")
    call(c, "j1", 90)
    r2 = call(c, "j2", 90)  # waits for room
    forwarded(c)
    c.sent.clear()
    # The node's generate timeout ran out first: it gives the call up.
    cancel = {"op": Op.GENERATE_CANCEL, "rid": r2, "job_id": "j2"}
    c.router.on_generate_cancel(N1, hdr(Op.GENERATE_CANCEL, cancel), [])
    (answer,) = c.take(N1)
    assert answer["rid"] == r2 and answer["error"]["code"] == ErrorCode.UNKNOWN_JOB.value
    assert len(c.router.admission) == 0
    end(c, "j1")  # room frees: the abandoned call must not reach an engine
    assert forwarded(c) == []


def test_a_bridge_declared_dead_frees_its_jobs_kv_and_has_room_when_it_registers_again() -> None:
    c, ids = admitting(100, "b1")
    run(c, "placed", "new")
    call(c, "placed", 80)
    assert forwarded(c) == [("placed", "b1")] and c.router.admission.load("b1") == 90
    c.router.tick(time.monotonic() + 10 * c.router.dead_after_s)  # silent too long: lost
    assert "b1" not in c.router.backends and c.router.admission.load("b1") == 0
    assert len(c.router.held) == 1  # its call waits for a backend; its job then ends
    end(c, "placed")
    assert len(c.router.held) == 0
    # It comes back on its connection (it thought the broker gone): it serves no job, so a new one fits.
    assert c.bridge("b1") == ids["b1"]
    assert c.router.bridge_heartbeat(ids["b1"], hdr(Op.HEARTBEAT, {"stats": {"kv_capacity_tokens": 100}}))
    call(c, "new", 80)
    assert forwarded(c) == [("new", "b1")] and c.router.admission.load("b1") == 90
