"""Typed headers and OP_SCHEMAS cannot drift: every op has a header class whose fields are its schema's."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest

from prorl_cli import protocol as P
from prorl_cli.exceptions import ProtocolError
from prorl_cli.protocol import headers as H
from prorl_cli.protocol.schema import RECORD_FIELDS, Record
from prorl_cli.testing.samples import STOP, VALID


def _expected(spec: P.OpSchema | Any) -> tuple[Any, bool]:
    """The annotation a field's checker stands for, and whether the field is optional."""
    optional = isinstance(spec, P.Opt)
    check = spec.check if optional else spec
    assert check in P.ANNOTATIONS, f"checker {check} declares no Python type"
    return P.ANNOTATIONS[check], optional


def _agree(cls: type, fields: dict[str, Any], where: str) -> None:
    hints = typing.get_type_hints(cls)
    own = {f.name: f for f in dataclasses.fields(cls) if f.init}
    assert set(own) == set(fields), f"{where}: {cls.__name__} fields {sorted(own)} != schema {sorted(fields)}"
    for name, spec in fields.items():
        annotation, optional = _expected(spec)
        f = own[name]
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        assert has_default == optional, f"{where}.{name}: optional in the schema is {optional}, default in the class is {has_default}"
        declared = hints[name]
        # An optional field is annotated ``T | None`` (null means absent) unless its record gives a non-null default.
        allowed = {annotation, annotation | None} if optional else {annotation}
        assert declared in allowed, f"{where}.{name}: class says {declared}, schema says {annotation}"


@pytest.mark.parametrize("op", list(P.OP_SCHEMAS), ids=lambda op: op.value)
def test_every_op_has_a_header_class_that_agrees_with_its_schema(op: P.Op) -> None:
    assert op in H.HEADERS, f"op {op.value!r} has a schema but no header class"
    _agree(H.HEADERS[op], P.OP_SCHEMAS[op].fields, op.value)


def test_every_header_class_belongs_to_an_op_with_a_schema() -> None:
    assert set(H.HEADERS) == set(P.OP_SCHEMAS)


def test_nested_records_agree_with_their_schemas() -> None:
    # The records the schema builds (JobSpec, SamplingParams, the job updates) are checked the same way.
    built = [c for c in P.ANNOTATIONS if P.ANNOTATIONS[c] in (P.JobSpec, P.SamplingParams, H.StageUpdate, H.JobEnd)]
    assert {P.ANNOTATIONS[c] for c in built} == {P.JobSpec, P.SamplingParams, H.StageUpdate, H.JobEnd}
    for check in built:
        _agree(P.ANNOTATIONS[check], RECORD_FIELDS[check], P.ANNOTATIONS[check].__name__)


def test_parsing_a_valid_header_gives_its_typed_form() -> None:
    for op, (header, payload) in [*VALID.items(), (P.Op.STOP, STOP)]:
        typed = P.parse({"op": op, **header}, len(payload))
        assert type(typed) is H.HEADERS[op]
        for name in (f.name for f in dataclasses.fields(typed)):
            if name in header and not isinstance(header[name], list | dict):
                assert getattr(typed, name) == header[name], (op, name)
    submit = P.parse({"op": P.Op.SUBMIT, "rid": 1, "jobs": [{"job_id": "a", "task": "t", "sampling": {"max_tokens": 8}}]}, 1)
    (spec,) = submit.jobs
    assert isinstance(spec, P.JobSpec) and isinstance(spec.sampling, P.SamplingParams)
    assert spec.sampling.max_tokens == 8 and spec.sampling.is_set("max_tokens") and not spec.sampling.is_set("top_p")
    # Forwarded (broker -> node), the sampling keeps to the fields the submitter gave.
    assert spec.to_wire()["sampling"] == {"max_tokens": 8}


def test_a_record_given_a_class_builds_it_and_names_a_bad_field() -> None:
    check = Record({"job_id": P.schema.Str(), "attempt": P.schema.Int(1, 10), "stage": P.schema.Str()}, cls=H.StageUpdate)
    assert check({"job_id": "a", "attempt": 2, "stage": "run"}, "u") == H.StageUpdate("a", 2, "run")
    with pytest.raises(ProtocolError, match=r"'u.attempt' must be in \[1, 10\], got 0"):
        check({"job_id": "a", "attempt": 0, "stage": "run"}, "u")
    with pytest.raises(ProtocolError, match="'u.stage' is missing"):
        check({"job_id": "a", "attempt": 1}, "u")


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_tokens": 0}, "sampling.max_tokens must be a positive integer, got 0"),
    ({"max_tokens": 2.5}, "sampling.max_tokens must be a positive integer, got 2.5"),
    ({"temperature": -0.1}, "sampling.temperature must be >= 0, got -0.1"),
    ({"temperature": float("nan")}, "sampling.temperature must be >= 0, got nan"),
    ({"top_p": 0}, r"sampling.top_p must be in \(0, 1\], got 0"),
    ({"top_p": 1.5}, r"sampling.top_p must be in \(0, 1\], got 1.5"),
    ({"top_k": 0}, r"sampling.top_k must be -1 \(off\) or positive, got 0"),
    ({"ignore_eos": 1}, "sampling.ignore_eos must be true or false, got 1"),
])
def test_sampling_built_in_python_refuses_a_value_no_engine_honours(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        P.SamplingParams(**fields)
    # Read off the wire, the same value is a protocol error naming the field, whichever check sees it first.
    with pytest.raises(ProtocolError, match=f"sampling.{next(iter(fields))}"):
        P.SamplingParams.from_wire(fields, "sampling")
    with pytest.raises(ProtocolError, match=f"sampling.{next(iter(fields))}"):
        P.SamplingParams.from_given(**fields)


def test_every_sampling_the_wire_accepts_builds() -> None:
    # The schema's bounds lie within the record's own: a checked frame never fails when the record is built.
    for fields in ({"max_tokens": 1, "temperature": 0, "top_p": 1e-9, "top_k": -1},
                   {"max_tokens": 1 << 24, "temperature": 1e6, "top_p": 1, "top_k": 1 << 24, "ignore_eos": True}):
        sampling = P.SamplingParams.from_wire(fields, "sampling")
        assert sampling.to_wire() == fields and sampling.given == frozenset(fields)


def test_the_nodes_ops_are_checked_and_a_bad_job_record_fails_alone() -> None:
    with pytest.raises(ProtocolError, match=r"op 'cancel_job': field 'job_ids\[1\]' must be a string"):
        P.parse({"op": P.Op.CANCEL_JOB, "job_ids": ["a", 5]})
    with pytest.raises(ProtocolError, match=r"op 'generate_held': field 'held' must be a boolean"):
        P.parse({"op": P.Op.GENERATE_HELD, "rid": 3, "job_id": "a", "held": "yes"})
    # An assignment is taken whole; each of its job records is read on its own, so one bad one fails alone.
    good = {"job_id": "ok", "task": "t"}
    assign = P.parse({"op": P.Op.ASSIGN, "jobs": [{"job_id": "bad", "task": "t", "timeout_s": -1}, good]}, 2)
    assert isinstance(assign, H.Assign)
    with pytest.raises(ProtocolError, match=r"'jobs\[0\].timeout_s' must be in \(0, 1e\+09\], got -1"):
        P.JobSpec.from_wire(assign.jobs[0], "jobs[0]")
    assert P.JobSpec.from_wire(assign.jobs[1], "jobs[1]") == P.JobSpec(job_id="ok", task="t")


@pytest.mark.parametrize(("sampling", "expected"), [
    (None, 77),  # no sampling: the handler's setting
    ({"temperature": 0.5}, 77),  # sampling without max_tokens: still the handler's setting
    ({"max_tokens": 9}, 9),  # the submitter's own choice wins
])
def test_a_handlers_max_tokens_applies_only_where_the_submitter_gave_none(
    tmp_path: Any, sampling: dict[str, Any] | None, expected: int
) -> None:
    import logging

    from prorl_cli.config import ProrlConfig
    from prorl_cli.node.handler import AgentHandler, JobContext, Services
    from prorl_cli.node.settings import HandlerSettings

    class Capped(AgentHandler):
        name = "capped"
        defaults = HandlerSettings(max_tokens=77)

        async def init(self, ctx: JobContext) -> None: ...
        async def run(self, ctx: JobContext) -> None: ...
        async def eval(self, ctx: JobContext) -> None: ...

    wire = {"job_id": "j", "task": "capped", **({"sampling": sampling} if sampling is not None else {})}
    spec = P.JobSpec.from_wire(P.JobSpec.from_wire(wire).to_wire())  # as the node gets it, forwarded by the broker
    ctx = JobContext(spec, {}, "n1", tmp_path, ProrlConfig(), Services(), logging.getLogger("test"), handler=Capped())
    assert ctx.agent_sampling().max_tokens == expected
    if sampling and "temperature" in sampling:
        assert ctx.agent_sampling().temperature == 0.5
