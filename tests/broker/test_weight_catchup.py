"""A bridge that (re)joins on other weights loads the current ones before any call: the router as a plain object.

The recorded-sends cluster of ``tests.fakes.broker_cluster``: after an update every
bridge loaded, a bridge registering on its start weights is sent that
update and gets no call until it answered; one registering while an update
is in flight is sent that update's checkpoint; one that cannot load them is
told to shut down and dropped (an error, or no answer in time); one that
registers on the current version is sent nothing.
"""

from __future__ import annotations

import time
from typing import Any

from prorl_cli.protocol import Op
from tests.fakes.broker_cluster import N1, Cluster, hdr, run


def _update(c: Cluster, version: int, rid: int = 9) -> dict[bytes, dict[str, Any]]:
    """The trainer's ``update_weights``; returns what each bridge was forwarded."""
    c.router.on_update_weights(b"trainer", hdr(Op.UPDATE_WEIGHTS, {"rid": rid, "checkpoint": f"/c/v{version}",
                                                                   "policy_version": version}), [])
    fwd = {who: h for who, h, _ in c.sent if h.get("op") == Op.UPDATE_WEIGHTS.value}
    c.sent = [s for s in c.sent if s[1].get("op") != Op.UPDATE_WEIGHTS.value]
    return fwd


def _loaded(c: Cluster, bridge: bytes, forward: dict[str, Any], error: str | None = None) -> None:
    fields: dict[str, Any] = {"rid": forward["rid"]}
    if error:
        fields["error"] = {"code": "reload_failed", "message": error}
    c.router.on_weights_updated(bridge, hdr(Op.WEIGHTS_UPDATED, fields), [])


def _register(c: Cluster, backend_id: str, policy_version: int | None = None) -> bytes:
    identity = f"bridge-{backend_id}-again".encode()
    fields: dict[str, Any] = {"rid": 1, "backend_id": backend_id, "host": "h9", "model": "m"}
    if policy_version is not None:
        fields["policy_version"] = policy_version
    c.router.on_register_backend(identity, hdr(Op.REGISTER_BACKEND, fields), [])
    return identity


def _statuses(c: Cluster) -> dict[str, tuple[int | None, bool]]:
    return {s.backend_id: (s.policy_version, s.loading) for s in c.router.backend_statuses()}


def test_a_bridge_back_on_its_start_weights_loads_the_current_ones_before_any_call() -> None:
    c = Cluster()
    c.bridge("b1")
    b2 = c.bridge("b2")
    for who, fwd in _update(c, 1).items():
        _loaded(c, who, fwd)
    c.take()
    assert _statuses(c) == {"b1": (1, False), "b2": (1, False)}
    c.router.unregister(b2)  # requeued
    again = _register(c, "b2")  # back on v0
    (catch_up,) = [h for h in c.take(again) if h["op"] == Op.UPDATE_WEIGHTS.value]
    assert (catch_up["checkpoint"], catch_up["policy_version"]) == ("/c/v1", 1)
    assert _statuses(c)["b2"] == (None, True)
    # Two new jobs: both go to b1 while b2 loads (least-loaded would have given one to b2).
    run(c, "j1", "j2")
    assert c.routed("j1") == "b1" and c.routed("j2") == "b1"
    _loaded(c, again, catch_up)
    assert _statuses(c)["b2"] == (1, False)
    run(c, "j3")
    assert c.routed("j3") == "b2-again"  # the new connection of b2 (routed() names the peer)


def test_calls_held_for_want_of_a_serving_bridge_go_once_it_has_loaded() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    (fwd,) = _update(c, 1).values()
    _loaded(c, b1, fwd)
    c.router.unregister(b1)
    again = _register(c, "b1")
    (catch_up,) = [h for h in c.take(again) if h["op"] == Op.UPDATE_WEIGHTS.value]
    run(c, "j1")
    c.generate("j1")
    assert [h["op"] for h in c.take(N1)] == [Op.GENERATE_HELD.value]  # held at the broker: no bridge serves
    _loaded(c, again, catch_up)
    assert [h["op"] for h in c.take(again)] == [Op.GENERATE.value]


def test_a_bridge_joining_during_an_update_loads_that_update() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    (fwd,) = _update(c, 1).values()
    _loaded(c, b1, fwd)
    (fwd2,) = _update(c, 2, rid=10).values()  # in flight: b1 has not answered
    b2 = _register(c, "b2")
    (catch_up,) = [h for h in c.take(b2) if h["op"] == Op.UPDATE_WEIGHTS.value]
    assert (catch_up["checkpoint"], catch_up["policy_version"]) == ("/c/v2", 2)
    _loaded(c, b1, fwd2)
    _loaded(c, b2, catch_up)
    assert _statuses(c) == {"b1": (2, False), "b2": (2, False)} and c.router.weights.current is not None
    assert c.router.weights.current.checkpoint == "/c/v2"


def test_a_bridge_on_the_current_version_is_sent_nothing() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    (fwd,) = _update(c, 3).values()
    _loaded(c, b1, fwd)
    c.router.unregister(b1)
    again = _register(c, "b1", policy_version=3)
    assert [h["op"] for h in c.take(again)] == [Op.REPLY.value] and _statuses(c)["b1"] == (3, False)


def test_a_bridge_that_cannot_load_the_current_weights_is_shut_down() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    (fwd,) = _update(c, 1).values()
    _loaded(c, b1, fwd)
    b2, b3 = _register(c, "b2"), _register(c, "b3")
    (catch_up,) = [h for h in c.take(b2) if h["op"] == Op.UPDATE_WEIGHTS.value]
    _loaded(c, b2, catch_up, error="no config.json")
    assert [h["op"] for h in c.take(b2)] == [Op.SHUTDOWN.value] and "b2" not in _statuses(c)
    # b3 never answers: past the update's load_timeout_s (default 600 s) it goes the same way.
    c.take(b3)
    c.router.check_waiters(time.monotonic() + 601)
    assert [h["op"] for h in c.take(b3)] == [Op.SHUTDOWN.value] and "b3" not in _statuses(c)
    assert _statuses(c) == {"b1": (1, False)}


def test_a_bridge_that_registered_twice_while_catching_up_is_dropped_once_when_both_time_out() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    (fwd,) = _update(c, 1).values()
    _loaded(c, b1, fwd)
    first = _register(c, "b2")
    again = _register(c, "b2")  # the same peer registering again (it thought us dead): a second catch-up
    assert again == first
    catch_ups = [h for h in c.take(again) if h["op"] == Op.UPDATE_WEIGHTS.value]
    assert len(catch_ups) == 2
    # Neither is answered; both are past their deadline on the same tick: b2 goes once, the broker's tick goes on.
    c.router.check_waiters(time.monotonic() + 601)
    assert [h["op"] for h in c.take(again)] == [Op.SHUTDOWN.value] and _statuses(c) == {"b1": (1, False)}


def test_another_bridge_answering_a_catch_up_leaves_it_waiting_for_its_own_bridge() -> None:
    c = Cluster()
    b1 = c.bridge("b1")
    (fwd,) = _update(c, 1).values()
    _loaded(c, b1, fwd)
    c.take()
    b2 = _register(c, "b2")
    (catch_up,) = [h for h in c.take(b2) if h["op"] == Op.UPDATE_WEIGHTS.value]
    _loaded(c, b1, catch_up)  # b1 answers b2's forward id (a confused or hostile peer): ignored
    assert _statuses(c)["b2"] == (None, True)
    _loaded(c, b2, catch_up)  # b2's own answer still counts: it serves
    assert _statuses(c)["b2"] == (1, False)


def test_weights_synced_while_no_bridge_is_up_are_what_a_bridge_joining_later_loads() -> None:
    """An update answered with no bridge to load it (all requeued at that moment) still sets the current
    weights: the broker stamps its version on every call from then on, so a bridge back on its start weights
    must load them before it serves, or its tokens would carry a version they were not sampled with."""
    c = Cluster()
    assert _update(c, 1) == {}
    (answer,) = [h for h in c.take(b"trainer")]
    assert answer.get("ok") and answer["updated"] == [] and c.router.policy_version == 1
    b1 = _register(c, "b1")
    (catch_up,) = [h for h in c.take(b1) if h["op"] == Op.UPDATE_WEIGHTS.value]
    assert (catch_up["checkpoint"], catch_up["policy_version"]) == ("/c/v1", 1)
    assert _statuses(c)["b1"] == (None, True)
    _loaded(c, b1, catch_up)
    assert _statuses(c)["b1"] == (1, False)
