"""Each op is declared once, by its header class: the tables, checkers and wire form all come from it."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Annotated, Any

import pytest

from prorl_cli import protocol as P
from prorl_cli.exceptions import ProtocolDeclarationError, ProtocolError
from prorl_cli.protocol import headers as H
from prorl_cli.protocol.checks import Int, Str, declared_fields
from prorl_cli.protocol.schema import RECORD_FIELDS, Record
from prorl_cli.testing.grammar import SAMPLES
from prorl_cli.testing.samples import STOP, VALID


def test_every_op_has_exactly_one_declaration() -> None:
    declared = set(H.HEADERS)
    assert declared | H.UNDECLARED_OPS == set(P.Op), set(P.Op) - declared - H.UNDECLARED_OPS
    assert not declared & H.UNDECLARED_OPS
    # The derived tables hold the same ops, from the same classes.
    assert set(P.OP_SCHEMAS) == declared
    for op, cls in H.HEADERS.items():
        assert op in cls.OPS
        assert P.OP_SCHEMAS[op].fields == declared_fields(cls), op
    assert set(P.REPLY_SCHEMAS) == set(H.REPLIES)


def test_an_op_without_a_header_class_fails_the_import_check() -> None:
    H.check_declared()
    without: dict[P.Op, type[H.Header]] = {op: cls for op, cls in H.HEADERS.items() if op is not P.Op.GENERATE_HELD}
    with pytest.raises(ProtocolDeclarationError, match=r"\['generate_held'\] have no header class"):
        H.check_declared(without)


def test_a_header_class_without_its_checks_is_refused() -> None:
    with pytest.raises(ProtocolDeclarationError, match=r"Bare.job_id must be declared Annotated\[type, check\]"):
        @H.header(P.Op.GENERATE_HELD)
        @dataclass(slots=True)
        class Bare(H.Header):
            job_id: str

    with pytest.raises(ProtocolDeclarationError, match=r"Wrong.count is annotated .*str.* but its check reads a .*int"):
        @H.header(P.Op.GENERATE_HELD)
        @dataclass(slots=True)
        class Wrong(H.Header):
            count: Annotated[str, Int()]

    with pytest.raises(ProtocolDeclarationError, match="Twice.job_id must be declared"):
        @H.reply(P.Op.PING)
        @dataclass(slots=True)
        class Twice:
            job_id: Annotated[str, "a note, not a check"]

    # An op has one header class: a second declaration of it is refused, and the first stays.
    with pytest.raises(ProtocolDeclarationError, match="op 'ping' is declared twice"):
        @H.header(P.Op.PING)
        @dataclass(slots=True)
        class Again(H.Header):
            rid: H.RequestId
    assert H.HEADERS[P.Op.PING] is H.Request


def test_a_field_with_a_default_is_optional_and_one_without_is_required() -> None:
    @dataclass(slots=True)
    class Probe(H.Wire):
        need: Annotated[int, Int(1, 5)]
        maybe: Annotated[str | None, Str(3)] = None

    check = Record(declared_fields(Probe), strict=False, cls=Probe)
    assert check({"need": 2, "maybe": None}, "") == Probe(2)
    with pytest.raises(ProtocolError, match="'need' is missing"):
        check({"maybe": "abc"}, "")
    with pytest.raises(ProtocolError, match=r"'maybe' must have 1 to 3 characters, got 4"):
        check({"need": 2, "maybe": "abcd"}, "")


@pytest.mark.parametrize("op", list(SAMPLES), ids=lambda op: op.value)
def test_a_typed_header_goes_back_on_the_wire_as_it_came(op: P.Op) -> None:
    header, payload = SAMPLES[op]
    typed = P.parse({"op": op, **header}, len(payload))
    wire = typed.to_wire(op)
    assert wire["op"] == op.value
    assert P.parse({**wire, "op": op}, len(payload)) == typed
    if op is not P.Op.SUBMIT:  # a JobSpec's wire form also names its default attempt
        assert wire == {"op": op.value, **header}
    if len(type(typed).OPS) == 1:
        assert typed.to_wire() == wire
    else:
        with pytest.raises(ProtocolDeclarationError, match="name the op"):
            typed.to_wire()


def test_a_header_leaves_out_optional_fields_it_does_not_give() -> None:
    assert H.Heartbeat(node_id="n1").to_wire() == {"op": "heartbeat", "node_id": "n1"}
    assert H.Shutdown().to_wire() == {"op": "shutdown"}
    assert H.JobIds(rid=3, job_ids=["a"]).to_wire(P.Op.CANCEL) == {"op": "cancel", "rid": 3, "job_ids": ["a"]}
    assert H.JobStage([H.StageUpdate("a", 1, "run")]).to_wire() == {
        "op": "job_stage", "updates": [{"job_id": "a", "attempt": 1, "stage": "run"}]}
    with pytest.raises(ProtocolDeclarationError, match="not the header of op 'ping'"):
        H.Shutdown().to_wire(P.Op.PING)


def _agree(cls: type, fields: dict[str, Any], where: str) -> None:
    """``cls``'s fields are ``fields``, typed as their checkers say, with a default exactly where optional."""
    hints = typing.get_type_hints(cls)
    own = {f.name: f for f in dataclasses.fields(cls) if f.init}
    assert set(own) == set(fields), f"{where}: {cls.__name__} fields {sorted(own)} != schema {sorted(fields)}"
    for name, spec in fields.items():
        optional = isinstance(spec, P.Opt)
        check = spec.check if optional else spec
        assert check in P.ANNOTATIONS, f"checker {check} declares no Python type"
        annotation, f = P.ANNOTATIONS[check], own[name]
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        assert has_default == optional, f"{where}.{name}: optional in the schema is {optional}, default in the class is {has_default}"
        allowed = {annotation, annotation | None} if optional else {annotation}
        assert hints[name] in allowed, f"{where}.{name}: class says {hints[name]}, schema says {annotation}"


def test_nested_records_agree_with_their_checkers() -> None:
    # The records the schema builds (JobSpec, SamplingParams, the job updates) each have their one checker.
    built = [c for c in P.ANNOTATIONS if P.ANNOTATIONS[c] in (P.JobSpec, P.SamplingParams, H.StageUpdate, H.JobEnd)]
    assert {P.ANNOTATIONS[c] for c in built} == {P.JobSpec, P.SamplingParams, H.StageUpdate, H.JobEnd}
    # JobSpec's and SamplingParams' checkers are written beside their classes (schema.py), so held to them here;
    # the job updates are declared on their classes.
    for check in built:
        _agree(P.ANNOTATIONS[check], RECORD_FIELDS[check], P.ANNOTATIONS[check].__name__)


def test_parsing_a_valid_header_gives_its_typed_form() -> None:
    for op, (header, payload) in [*VALID.items(), (P.Op.STOP, STOP)]:
        typed = P.parse({"op": op, **header}, len(payload))
        assert type(typed) is H.HEADERS[op]
        for name in P.OP_SCHEMAS[op].fields:
            if name in header and not isinstance(header[name], list | dict):
                assert getattr(typed, name) == header[name], (op, name)
    submit = P.parse({"op": P.Op.SUBMIT, "rid": 1, "jobs": [{"job_id": "a", "task": "t", "sampling": {"max_tokens": 8}}]}, 1)
    (spec,) = submit.jobs
    assert isinstance(spec, P.JobSpec) and isinstance(spec.sampling, P.SamplingParams)
    assert spec.sampling.max_tokens == 8 and spec.sampling.is_set("max_tokens") and not spec.sampling.is_set("top_p")
    # Forwarded (broker -> node), the sampling keeps to the fields the submitter gave.
    assert spec.to_wire()["sampling"] == {"max_tokens": 8}


def test_a_record_given_a_class_builds_it_and_names_a_bad_field() -> None:
    check = Record({"job_id": Str(), "attempt": Int(1, 10), "stage": Str()}, cls=H.StageUpdate)
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
    ({"stop": ["</search>", ""]}, r"sampling.stop\[1\] must have 1 to 1024 characters, got 0"),
    ({"stop": ["x" * 1025]}, r"sampling.stop\[0\] must have 1 to 1024 characters, got 1025"),
    ({"stop": ["s"] * 33}, "sampling.stop holds 33 strings; at most 32"),
    ({"stop": "</search>"}, "sampling.stop must be a list of strings, got str"),
    ({"stop": [7]}, r"sampling.stop\[0\] must be a string, got int"),
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
    for fields in ({"max_tokens": 1, "temperature": 0, "top_p": 1e-9, "top_k": -1, "stop": []},
                   {"max_tokens": 1 << 24, "temperature": 1e6, "top_p": 1, "top_k": 1 << 24, "ignore_eos": True,
                    "stop": ["\u00e9" * P.MAX_STOP_CHARS] * P.MAX_STOP_STRINGS},
                   {"stop": ["x"]}):
        sampling = P.SamplingParams.from_wire(fields, "sampling")
        assert sampling.to_wire() == fields and sampling.given == frozenset(fields)
    # No stop strings: vLLM's None, as a null off the wire.
    assert P.SamplingParams(stop=None).stop == P.SamplingParams.from_wire({"stop": None}, "sampling").stop == []  # type: ignore[arg-type]


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
