"""The ops' headers: each op declared once, as a class whose fields carry their checks.

A header class is a dataclass whose every field says ``Annotated[type, check]`` (a checker of
:mod:`prorl_cli.protocol.checks`); a field with a default is optional (absent or null on the wire:
the default). :func:`header` names the op(s) it is the header of and their payload frames. From
these classes alone come the per-op checkers :func:`parse` uses (built once, at import), the
tables ``HEADERS`` and ``OP_SCHEMAS``, and what the fuzz grammar generates; :func:`reply` does the
same for the broker's success replies the client reads (``REPLIES``, ``REPLY_SCHEMAS``,
:func:`parse_reply`). A class declared without its checks, or with a type its check does not
produce, fails at import, and so does an op with no header class (:func:`check_declared`).

A header in hand is valid: its handler reads attributes and checks nothing again. A sender builds
one and sends ``to_wire()``: the map with ``op`` and every field given (``None`` ones left out).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, TypeVar

from prorl_cli.exceptions import ProtocolDeclarationError, ProtocolError
from prorl_cli.protocol.checks import (
    ANY,
    BIG,
    HTTP_URL,
    MAX_JOBS_PER_MESSAGE,
    MAX_LISTED_JOBS,
    METRIC_SAMPLES,
    URL,
    Bool,
    Check,
    Dict,
    FieldSpec,
    Id,
    Int,
    List,
    Num,
    Opt,
    Record,
    Str,
    builds,
    declared_fields,
    read_by,
    record_of,
)
from prorl_cli.protocol.framing import JOB_ITEM_OPS, ErrorCode, Op
from prorl_cli.protocol.records import (
    MAX_STOP_CHARS,
    BackendStatus,
    ForgetOutcome,
    JobSpec,
    SamplingParams,
    StatusReport,
)
from prorl_cli.protocol.schema import (
    ERROR,
    FAILURE_GROUP,
    JOB_IDS,
    JOB_SPEC,
    JOB_STATE,
    POSITIVE_S,
    SAMPLING,
    STAGE_STATS,
    TOKEN,
)

#: A request id: a string, or any integer msgpack carries.
Rid = str | int
#: The rid of a request built before its connection numbers it: ``BrokerConnection.request`` sends its own instead.
NEW_RID: Rid = 0
#: The fields most ops share, declared once.
RequestId = Annotated[Rid, Id()]
JobId = Annotated[str, Str()]
JobIdList = Annotated[list[str], JOB_IDS]
Version = Annotated[int, Int(0, BIG)]
Attempt = Annotated[int, Int(1, 1_000_000)]


class Wire:
    """Base of the header classes and their nested records: the map a sender puts on the wire."""

    __slots__ = ()
    #: (name, optional, holds records) of each declared field, in order (set when the class is declared).
    WIRE_FIELDS: ClassVar[tuple[tuple[str, bool, bool], ...]] = ()

    def to_wire(self) -> dict[str, Any]:
        """The fields as a msgpack-ready map: an optional field that is ``None`` is left out, records by their wire form."""
        return self._fill({})

    def _fill(self, out: dict[str, Any]) -> dict[str, Any]:
        for name, optional, records in self.WIRE_FIELDS:
            value = getattr(self, name)
            if value is None:
                if optional:
                    continue
            elif records:
                value = [v.to_wire() for v in value] if type(value) is list else value.to_wire()
            out[name] = value
        return out


class Header(Wire):
    """Base of every header class (see :func:`header`)."""

    __slots__ = ()
    #: The ops this class is the header of.
    OPS: ClassVar[tuple[Op, ...]] = ()
    #: The op's name on the wire when the class has one op (``None``: several, ``to_wire`` is told which).
    WIRE_OP: ClassVar[str | None] = None

    def to_wire(self, op: Op | None = None) -> dict[str, Any]:
        """This header as sent: ``op`` (this class's only op when not given), then its fields."""
        if op is None:
            if self.WIRE_OP is None:
                raise ProtocolDeclarationError(
                    f"{type(self).__name__} is the header of {[o.value for o in self.OPS]}: name the op to send")
            return self._fill({"op": self.WIRE_OP})
        if op not in self.OPS:
            raise ProtocolDeclarationError(f"{type(self).__name__} is not the header of op {op.value!r}")
        return self._fill({"op": op.value})


@dataclass(frozen=True)
class OpSchema:
    """The header fields of one op (derived from its class) and how many payload frames it carries.

    ``payload``: an exact count of frames, ``"jobs"`` (one item per entry of the header's ``jobs``, packed in one
    frame: :func:`~prorl_cli.protocol.framing.job_items`) or ``None`` (any).
    """

    fields: dict[str, FieldSpec]
    payload: int | str | None = 0


#: The header class of each op (several ops share one shape), its fields and payload, its checker.
HEADERS: dict[Op, type[Header]] = {}
OP_SCHEMAS: dict[Op, OpSchema] = {}
_OP_CHECKS: dict[Op, tuple[Check, int | str | None]] = {}
#: The typed success reply of each request op the client reads, and its fields.
REPLIES: dict[Op, type] = {}
REPLY_SCHEMAS: dict[Op, dict[str, FieldSpec]] = {}
_REPLY_CHECKS: dict[Op, Check] = {}
#: Ops with no header class of their own: a ``reply`` is read per request op (:func:`parse_reply`), a ``result``
#: by the client that watches (its jobs' records are the payload frames).
UNDECLARED_OPS = frozenset({Op.REPLY, Op.RESULT})

W = TypeVar("W", bound="Header")
T = TypeVar("T")


def _declare(cls: type[Wire]) -> dict[str, FieldSpec]:
    fields = declared_fields(cls)
    cls.WIRE_FIELDS = tuple((name, isinstance(spec, Opt), builds(spec.check if isinstance(spec, Opt) else spec))
                            for name, spec in fields.items())
    return fields


def header(*ops: Op, payload: int | str | None = 0) -> Callable[[type[W]], type[W]]:
    """Class decorator: ``cls`` is the header of ``ops``, carrying ``payload`` frames (see :class:`OpSchema`).

    Its fields and their checks come from its annotations (:func:`~prorl_cli.protocol.checks.declared_fields`).
    Raises :class:`ProtocolDeclarationError` on a field without its check, or an op declared twice.
    """

    def declare(cls: type[W]) -> type[W]:
        if not ops or not issubclass(cls, Header):
            raise ProtocolDeclarationError(f"{cls.__name__}: a header class subclasses Header and names its op(s)")
        fields = _declare(cls)
        if payload == "jobs" and "jobs" not in fields:
            raise ProtocolDeclarationError(f"{cls.__name__}: payload='jobs' needs a 'jobs' field")
        if any((payload == "jobs") != (op in JOB_ITEM_OPS) for op in ops):
            # The framing packs exactly these ops' items into one frame (and unpacks them on arrival).
            raise ProtocolDeclarationError(f"{cls.__name__}: payload='jobs' is declared for exactly the ops of "
                                           "framing.JOB_ITEM_OPS")
        check = Record(fields, strict=False, cls=cls)
        for op in ops:
            if op in HEADERS or op in UNDECLARED_OPS:
                raise ProtocolDeclarationError(f"op {op.value!r} is declared twice ({cls.__name__})")
        for op in ops:
            HEADERS[op], OP_SCHEMAS[op], _OP_CHECKS[op] = cls, OpSchema(fields, payload), (check, payload)
        cls.OPS = ops
        cls.WIRE_OP = ops[0].value if len(ops) == 1 else None
        return cls

    return declare


def reply(op: Op) -> Callable[[type[T]], type[T]]:
    """Class decorator: ``cls`` is the broker's success reply to ``op``, its fields declared as a header's are."""

    def declare(cls: type[T]) -> type[T]:
        if op in REPLIES:
            raise ProtocolDeclarationError(f"the reply to op {op.value!r} is declared twice ({cls.__name__})")
        fields = declared_fields(cls)
        REPLIES[op], REPLY_SCHEMAS[op], _REPLY_CHECKS[op] = cls, fields, Record(fields, strict=False, cls=cls)
        return cls

    return declare


def check_declared(headers: dict[Op, type[Header]] | None = None) -> None:
    """Raise :class:`ProtocolDeclarationError` naming every op with no header class (run at import)."""
    missing = set(Op) - set(HEADERS if headers is None else headers) - UNDECLARED_OPS
    if missing:
        raise ProtocolDeclarationError(
            f"op(s) {sorted(op.value for op in missing)} have no header class: declare one with @header(Op...)")


# ----------------------------------------------------------------- nested records


@dataclass(slots=True)
class StageUpdate(Wire):
    """A job's new stage (``job_stage``), or a job a re-registering node still runs (``register``)."""

    job_id: JobId
    attempt: Attempt
    stage: Annotated[str, JOB_STATE]


UPDATE = record_of(StageUpdate)
_declare(StageUpdate)


@dataclass(slots=True)
class JobEnd(Wire):
    """A finished job of ``job_done``; its result is the payload frame at the same index."""

    job_id: JobId
    attempt: Attempt
    state: Annotated[str, JOB_STATE]


JOB_END = record_of(JobEnd)
_declare(JobEnd)


# ----------------------------------------------------------------- client -> broker


@header(Op.SUBMIT, payload="jobs")
@dataclass(slots=True)
class Submit(Header):
    rid: RequestId
    jobs: Annotated[list[JobSpec], List(JOB_SPEC)]


@header(Op.CANCEL, Op.WATCH, Op.FORGET, Op.RELEASE)
@dataclass(slots=True)
class JobIds(Header):
    """``cancel``, ``watch``, ``forget`` (client), ``release`` (node)."""

    rid: RequestId
    job_ids: JobIdList


@header(Op.LIST_JOBS)
@dataclass(slots=True)
class ListJobs(Header):
    rid: RequestId
    prefix: Annotated[str | None, Str()] = None
    group_id: Annotated[str | None, Str()] = None
    after: Annotated[int | None, Int(0, BIG)] = None


@header(Op.STATUS, Op.LIST_LLM_SERVERS, Op.START, Op.HOLD, Op.STOP, Op.PING)
@dataclass(slots=True)
class Request(Header):
    """An op with nothing but its request id (``status``, ``start``, ``hold``, ``stop``, ``ping``, ...)."""

    rid: RequestId


@header(Op.ADD_LLM_SERVER)
@dataclass(slots=True)
class AddLlmServer(Header):
    rid: RequestId
    url: Annotated[str, HTTP_URL]
    model: Annotated[str | None, Str()] = None


@header(Op.CLEAR_LLM_SERVER)
@dataclass(slots=True)
class ClearLlmServer(Header):
    rid: RequestId
    #: Absent: clear every HTTP backend.
    url: Annotated[str | None, URL] = None


@header(Op.PAUSE_GENERATION)
@dataclass(slots=True)
class PauseGeneration(Header):
    rid: RequestId
    policy_version: Annotated[int | None, Int(0, BIG)] = None
    #: Answer once the calls in flight drained (or this ran out); absent: answer at once.
    drain_timeout_s: Annotated[float | None, Num(0.0, 1e6)] = None


@header(Op.RESUME_GENERATION)
@dataclass(slots=True)
class ResumeGeneration(Header):
    rid: RequestId
    policy_version: Annotated[int | None, Int(0, BIG)] = None


@header(Op.UPDATE_WEIGHTS)
@dataclass(slots=True)
class UpdateWeights(Header):
    rid: RequestId
    checkpoint: Annotated[str, Str(4096)]
    policy_version: Version
    load_timeout_s: Annotated[float | None, POSITIVE_S] = None


# ----------------------------------------------------------------- node / bridge -> broker


@header(Op.REGISTER)
@dataclass(slots=True)
class Register(Header):
    rid: RequestId
    node_id: Annotated[str, Str()]
    host: Annotated[str, Str()]
    credit: Annotated[int, Int(1, 1_000_000)]
    tasks: Annotated[list[str], List(Str(), 4096)]
    pid: Annotated[int | None, Int(0, (1 << 31) - 1)] = None
    #: Jobs the node still runs (a broker that restarted learns them back).
    running: Annotated[list[StageUpdate] | None, List(UPDATE, 1_000_000)] = None
    liveness_token: Annotated[str | None, TOKEN] = None
    #: The sandbox runtime the node picked (``sandbox.runtime: auto`` resolved); absent when it has none.
    sandbox_runtime: Annotated[str | None, Str(32)] = None
    #: The node is draining (it sent ``release``): a restarted broker places nothing more on it.
    draining: Annotated[bool | None, Bool()] = None


@header(Op.HEARTBEAT)
@dataclass(slots=True)
class Heartbeat(Header):
    """A node's or bridge's heartbeat (or a node's liveness sidecar's, with ``liveness_token``)."""

    rid: Annotated[Rid | None, Id()] = None
    node_id: Annotated[str | None, Str()] = None
    backend_id: Annotated[str | None, Str()] = None
    #: Per-stage pool counters: ``{stage: {active, queued, limit}}``.
    stages: Annotated[dict[str, dict[str, Any]] | None, STAGE_STATS] = None
    inflight: Annotated[int | None, Int(0, BIG)] = None
    liveness_token: Annotated[str | None, TOKEN] = None
    #: A bridge's engine figures.
    stats: Annotated[dict[str, float] | None, Dict(Str(64), Num(-float(BIG), float(BIG)), max_len=32)] = None
    #: A node's or bridge's Prometheus figures (docs/observability.md).
    metrics: Annotated[list[list[Any]] | None, METRIC_SAMPLES] = None
    #: A node's failed jobs grouped: ``{task, stage, type, count, sample}`` (shown by ``prorl top``).
    failures: Annotated[list[dict[str, Any]] | None, List(FAILURE_GROUP, 256)] = None


@header(Op.UNREGISTER)
@dataclass(slots=True)
class Unregister(Header):
    rid: Annotated[Rid | None, Id()] = None
    node_id: Annotated[str | None, Str()] = None
    backend_id: Annotated[str | None, Str()] = None
    #: Why a peer leaves when it did not mean to (a bridge whose engine died); absent: a planned exit.
    reason: Annotated[str | None, Str()] = None


@header(Op.JOB_STAGE)
@dataclass(slots=True)
class JobStage(Header):
    updates: Annotated[list[StageUpdate], List(UPDATE, 1_000_000)]


@header(Op.JOB_DONE, payload="jobs")
@dataclass(slots=True)
class JobDone(Header):
    """Finished jobs; payload: one result per job."""

    jobs: Annotated[list[JobEnd], List(JOB_END, 1_000_000)]


@header(Op.GENERATE, payload=1)
@dataclass(slots=True)
class Generate(Header):
    """A generate call (node -> broker, and broker -> bridge); payload: the prompt (int32)."""

    rid: RequestId
    job_id: JobId
    #: Absent: the engine's defaults (:class:`SamplingParams`).
    sampling: Annotated[SamplingParams | None, SAMPLING] = None
    #: The caller's host (the ``local_first`` routing policy prefers a backend there).
    host: Annotated[str | None, Str()] = None


@header(Op.REGISTER_BACKEND)
@dataclass(slots=True)
class RegisterBackend(Header):
    rid: RequestId
    backend_id: Annotated[str, Str()]
    host: Annotated[str, Str()]
    model: Annotated[str, Str(1024)]
    max_model_len: Annotated[int | None, Int(1, 1 << 31)] = None
    capacity: Annotated[int | None, Int(0, 1_000_000)] = None
    #: The weights version the bridge serves (``None``: the weights it was started on).
    policy_version: Annotated[int | None, Int(0, BIG)] = None


@header(Op.GENERATE_REPLY, payload=None)
@dataclass(slots=True)
class GenerateReply(Header):
    """A bridge's answer to a forwarded generate call; payload: ids (int32) and log-probs (float32)."""

    rid: RequestId
    finish_reason: Annotated[str | None, Str(64)] = None
    #: The bridge's weights version when the call ran (absent: the broker stamps its own).
    policy_version: Annotated[int | None, Int(0, BIG)] = None
    #: Seconds the call spent in the engine (queued there and generating), as the bridge timed it.
    engine_s: Annotated[float | None, Num(0.0, 1e7)] = None
    #: The ``sampling.stop`` string that ended the generation (``finish_reason`` ``stop``); absent otherwise.
    stop_string: Annotated[str | None, Str(MAX_STOP_CHARS)] = None
    #: ``{code, message}`` when the call failed.
    error: Annotated[dict[str, Any] | None, ERROR] = None


@header(Op.WEIGHTS_UPDATED)
@dataclass(slots=True)
class WeightsUpdated(Header):
    rid: RequestId
    error: Annotated[dict[str, Any] | None, ERROR] = None


#: The most of a backend's fault a node reports in ``generate_done`` (a server's 502 page can be long).
FAULT_CHARS = 512


@header(Op.GENERATE_DONE)
@dataclass(slots=True)
class GenerateDone(Header):
    """A node's call to an HTTP backend the broker redirected it to is over."""

    job_id: JobId
    backend_id: Annotated[str, URL]
    #: The backend failed the call (unreachable, no answer in time, HTTP 5xx): what the node saw, cut to
    #: :data:`FAULT_CHARS`.
    fault: Annotated[str | None, Str(FAULT_CHARS)] = None
    #: True: the node gave the call up before an answer (its job was cancelled or timed out, its node stops),
    #: which says nothing of the backend. Absent, with no fault: the backend answered (a 4xx too: it is up).
    abandoned: Annotated[bool | None, Bool()] = None


@header(Op.GENERATE_CANCEL)
@dataclass(slots=True)
class GenerateCancel(Header):
    rid: RequestId
    job_id: JobId


# ----------------------------------------------------------------- broker -> node


@header(Op.ASSIGN, payload="jobs")
@dataclass(slots=True)
class Assign(Header):
    """Jobs placed on a node; payload: one instance per job.

    ``jobs`` stay as read here: the node reads each with ``JobSpec.from_wire`` on its own, so one bad
    record fails that job (reported FAILED) and not the jobs beside it.
    """

    jobs: Annotated[list[Any], List(ANY)]
    #: Per job: where its timeline starts (``since_submit_s``) and the broker's events so far.
    timing: Annotated[list[Any] | None, List(ANY)] = None


@header(Op.CANCEL_JOB)
@dataclass(slots=True)
class CancelJob(Header):
    """Stop these jobs (the broker -> node form of ``cancel``)."""

    job_ids: JobIdList


@header(Op.GENERATE_HELD)
@dataclass(slots=True)
class GenerateHeld(Header):
    rid: RequestId
    job_id: JobId
    held: Annotated[bool, Bool()]


@header(Op.SHUTDOWN)
@dataclass(slots=True)
class Shutdown(Header):
    """The broker tells a node or bridge to leave."""

    rid: Annotated[Rid | None, Id()] = None


check_declared()


# ----------------------------------------------------------------- broker -> client: success replies
# What :func:`parse_reply` turns a success reply into. A list or map field has a default: the client always took
# it as empty when absent, and still does; a wrong one is an error. A reply that is nothing but its record
# (``status``, a backend) requires it. Fields not declared (``op``, ``rid``, ``ok``, ``boot_id``, a newer
# broker's) are ignored.

_STATUS_REPORT = read_by(StatusReport)
_BACKEND_STATUS = read_by(BackendStatus)
_URLS = List(URL, 4096)


@reply(Op.SUBMIT)
@dataclass(slots=True)
class SubmitReply:
    """``submit``: the ids taken as new jobs, and those the broker already had (a submit is idempotent)."""

    accepted: JobIdList = field(default_factory=list)
    existing: JobIdList = field(default_factory=list)


@reply(Op.WATCH)
@dataclass(slots=True)
class WatchReply:
    """``watch``: the ids the broker does not know (the others' results come as they finish)."""

    unknown: JobIdList = field(default_factory=list)


@reply(Op.CANCEL)
@dataclass(slots=True)
class CancelReply:
    """``cancel``: each known job's state after the cancel (ids the broker does not know are absent)."""

    states: Annotated[dict[str, str], Dict(Str(), Str(32), max_len=MAX_JOBS_PER_MESSAGE)] = field(default_factory=dict)


@reply(Op.LIST_JOBS)
@dataclass(slots=True)
class JobPage:
    """``list_jobs``: one page of ids and states, in submission order; ``next`` is the next page's ``after``."""

    jobs: Annotated[dict[str, str], Dict(Str(), Str(32), max_len=MAX_LISTED_JOBS)] = field(default_factory=dict)
    next: Annotated[int | None, Int(0, BIG)] = None


@reply(Op.UPDATE_WEIGHTS)
@dataclass(slots=True)
class WeightsUpdateReply:
    """``update_weights``: bridges that loaded the weights, HTTP backends skipped, the version now served."""

    updated: Annotated[list[str], _URLS] = field(default_factory=list)
    skipped: Annotated[list[str], _URLS] = field(default_factory=list)
    policy_version: Annotated[int | None, Int(0, BIG)] = None
    #: A bridge loaded the weights; false when none was up to (they are the current weights all the same, and the
    #: first bridge to join loads them). Absent (an older broker): read as whether ``updated`` names one.
    verified: Annotated[bool | None, Bool()] = None


@reply(Op.STATUS)
@dataclass(slots=True)
class StatusReply:
    """``status``: the broker's report."""

    status: Annotated[StatusReport, _STATUS_REPORT]


@reply(Op.ADD_LLM_SERVER)
@dataclass(slots=True)
class BackendReply:
    """``add_llm_server``: the backend as registered."""

    backend: Annotated[BackendStatus, _BACKEND_STATUS]


@reply(Op.CLEAR_LLM_SERVER)
@dataclass(slots=True)
class ClearedReply:
    """``clear_llm_server``: the backends that take no new jobs now."""

    cleared: Annotated[list[str], _URLS]


@reply(Op.LIST_LLM_SERVERS)
@dataclass(slots=True)
class BackendList:
    """``list_llm_servers``: every backend the broker knows."""

    backends: Annotated[list[BackendStatus], List(_BACKEND_STATUS, 4096)]


@reply(Op.GENERATE)
@dataclass(slots=True)
class GenerateAnswer:
    """``generate`` (to the node): a bridge's output (the payload frames), or a redirect to an HTTP backend."""

    backend_id: Annotated[str | None, URL] = None
    finish_reason: Annotated[str | None, Str(64)] = None
    #: The weights version that served the call (the bridge's, else the broker's when it routed the call).
    policy_version: Annotated[int | None, Int(0, BIG)] = None
    engine_s: Annotated[float | None, Num(0.0, 1e7)] = None
    #: The ``sampling.stop`` string that ended the generation, as the bridge said (absent: none did).
    stop_string: Annotated[str | None, Str(MAX_STOP_CHARS)] = None
    #: An HTTP backend's ``/v1`` URL: the node calls ``redirect/completions`` itself.
    redirect: Annotated[str | None, HTTP_URL] = None
    #: The model the node names in those calls (``backends add --model``). Absent (none was given, or an older
    #: broker): the first the server's ``/models`` lists.
    model: Annotated[str | None, Str(1024)] = None


# ``forget``'s reply is the :class:`ForgetOutcome` record (its fields declared in ``records.py``).
reply(Op.FORGET)(ForgetOutcome)


def parse_reply(op: Op, header: dict[str, Any]) -> Any:
    """The typed success reply to ``op`` (its class in :data:`REPLIES`), checked.

    ``header`` is a success reply (``ok`` true) as the connection hands it over. Raises
    :class:`ProtocolError` (``bad_field``) naming the op and the field that is malformed.
    """
    try:
        return _REPLY_CHECKS[op](header, "")
    except ProtocolError as e:
        raise ProtocolError(e.code, f"reply to {op.value!r}: field {e.message}") from None


def parse(header: dict[str, Any], n_payload: int | None = None) -> Any:
    """The typed header (its op's class in :data:`HEADERS`) of ``header``, checked.

    ``header`` is decoded and its envelope checked (:func:`~prorl_cli.protocol.framing.decode_header`);
    every field its op's class declares is checked for type and range, and the payload count when
    ``n_payload`` is given (for an op carrying per-job items, the number of items unpacked from its frame). Raises :class:`ProtocolError` (``missing_field`` / ``bad_field``) naming
    the op and the field.
    """
    op: Op = header["op"]
    found = _OP_CHECKS.get(op)
    if found is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP.value, f"op {op.value!r} has no header schema")
    check, payload = found
    try:
        typed = check(header, "")
    except ProtocolError as e:
        raise ProtocolError(e.code, f"op {op.value!r}: field {e.message}") from None
    if n_payload is not None:
        check_payload(header, n_payload)
    return typed


def check_payload(header: dict[str, Any], n_payload: int) -> None:
    """Check the payload count of a header :func:`parse` accepted: its op's frames, or for an op carrying
    per-job items, the items unpacked from its frame (one per entry of ``jobs``)."""
    op: Op = header["op"]
    payload = _OP_CHECKS[op][1]
    if payload is None:
        return
    want = len(header["jobs"]) if payload == "jobs" else payload
    if n_payload != want:
        raise ProtocolError(
            ErrorCode.BAD_FIELD.value,
            f"op {op.value!r} carries {n_payload} payload item(s) but needs {want}"
            + (" (one instance/result per entry of 'jobs': the job records and items must pair up)"
               if payload == "jobs" else " (frames)"),
        )


def validate(header: dict[str, Any], n_payload: int | None = None) -> None:
    """Check ``header`` as :func:`parse` does, keeping nothing (for callers that only need the verdict)."""
    parse(header, n_payload)


__all__ = [name for name, value in dict(globals()).items() if isinstance(value, type) and value.__module__ == __name__]
__all__ += ["HEADERS", "NEW_RID", "OP_SCHEMAS", "REPLIES", "REPLY_SCHEMAS", "UNDECLARED_OPS", "check_declared", "check_payload", "header",
            "parse", "parse_reply", "reply", "validate"]
