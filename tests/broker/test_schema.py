"""One schema per op: every field of every op is checked for type and range before a handler runs."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest

from prorl_cli import protocol as P
from prorl_cli.client.aio import AsyncRolloutClient
from prorl_cli.exceptions import ProtocolError
from prorl_cli.testing.samples import STOP, VALID


def _check(op: P.Op, header: dict[str, Any], payload: list[bytes]) -> None:
    P.validate({"op": op, **header}, len(payload))


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path, value


def _set(header: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(header)
    target = out
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return out


def test_every_op_has_a_schema_and_the_samples_pass() -> None:
    broker_ops = set(VALID) | {P.Op.STOP}
    assert broker_ops <= set(P.OP_SCHEMAS)
    for op, (header, payload) in [*VALID.items(), (P.Op.STOP, STOP)]:
        _check(op, header, payload)


@pytest.mark.parametrize("op", list(VALID), ids=lambda op: op.value)
def test_non_finite_numbers_are_refused_everywhere(op: P.Op) -> None:
    header, payload = VALID[op]
    numbers = [(path, v) for path, v in _leaves(header) if isinstance(v, int | float) and not isinstance(v, bool)]
    for path, _ in numbers:
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ProtocolError) as e:
                _check(op, _set(header, path, bad), payload)
            assert e.value.code == "bad_field" and op.value in e.value.message and str(path[0]) in e.value.message


@pytest.mark.parametrize("op", list(VALID), ids=lambda op: op.value)
def test_wrong_types_are_refused_naming_op_and_field(op: P.Op) -> None:
    header, payload = VALID[op]
    for path, value in _leaves(header):
        if path[-1] in ("meta",) or (len(path) > 1 and path[-2] == "meta") or path == ("rid",):
            continue  # scalar maps and ids take several types
        for bad in ([1], {"a": 1}, b"\x00", True if not isinstance(value, bool) else "yes"):
            with pytest.raises(ProtocolError) as e:
                _check(op, _set(header, path, bad), payload)
            assert op.value in e.value.message and str(path[0]) in e.value.message, e.value.message


def test_the_reported_killers_are_refused() -> None:
    cases = [
        (P.Op.REGISTER, {"pid": "123"}, "pid"),
        (P.Op.REGISTER_BACKEND, {"capacity": "4"}, "capacity"),
        (P.Op.REGISTER_BACKEND, {"model": 5}, "model"),
        (P.Op.JOB_STAGE, {"updates": [{"job_id": ["x"], "attempt": 1, "stage": "run"}]}, "updates[0].job_id"),
        (P.Op.CLEAR_LLM_SERVER, {"url": 5}, "url"),
        (P.Op.HEARTBEAT, {"stages": {"run": "junk"}}, "stages"),
        (P.Op.SUBMIT, {"jobs": [{"job_id": "a", "task": "t", "timeout_s": math.nan}]}, "jobs[0].timeout_s"),
        (P.Op.REGISTER, {"credit": 0}, "credit"),
        (P.Op.CANCEL, {"job_ids": ["x" * 300]}, "job_ids[0]"),
        (P.Op.SUBMIT, {"jobs": [{"job_id": "a", "task": "t", "meta": {"k": "v" * 5000}}]}, "meta"),
    ]
    for op, change, field in cases:
        header, payload = VALID[op]
        bad = {**header, **change}
        with pytest.raises(ProtocolError) as e:
            _check(op, bad, payload if op != P.Op.SUBMIT else [b"\x80"] * len(bad["jobs"]))
        assert field in e.value.message and op.value in e.value.message, e.value.message


def test_payload_counts_are_checked() -> None:
    for op in (P.Op.SUBMIT, P.Op.JOB_DONE, P.Op.GENERATE):
        header, payload = VALID[op]
        with pytest.raises(ProtocolError) as e:
            _check(op, header, [*payload, b"extra"])
        assert "payload" in e.value.message


def test_header_rid_is_kept_for_error_replies() -> None:
    assert P.header_rid({"rid": 7, "op": "cancel"}) == 7
    assert P.header_rid({"rid": "r-1"}) == "r-1"
    assert P.header_rid({"rid": [1]}) is None and P.header_rid({"rid": True}) is None
    assert P.header_rid({"rid": "x" * 1000}) is None


def test_jobspec_refuses_nan_client_side() -> None:
    client = AsyncRolloutClient("schema-test")  # make_specs checks with the submit schema; nothing connects
    with pytest.raises(ProtocolError, match="timeout_s"):
        client.make_specs("t", 1, timeout_s=math.nan)
    with pytest.raises(ProtocolError, match=r"stage_timeouts_s\['run'\]"):
        client.make_specs("t", 1, stage_timeouts_s={"run": math.inf})
    with pytest.raises(ProtocolError, match=r"sampling.top_k' must be -1 \(off\) or positive"):
        client.make_specs("t", 1, sampling={"top_k": 0})
