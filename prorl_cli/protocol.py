"""prorl's wire protocol: every op, header field and job-record field, written once.

Transport: ZeroMQ ROUTER at the broker, DEALER at every peer (client, node,
inference bridge). A message is a multipart ``[header, *payload]``:

* ``header`` is a msgpack map with at least ``v`` (protocol version), ``op``
  (one of :class:`Op`) and, for requests, ``rid`` (a request id the reply
  echoes).
* payload frames carry bulk data the broker forwards without decoding: job
  instances and results (msgpack), token arrays (int32 little-endian) and
  log-probs (float32 little-endian).

``docs/protocol.md`` describes the same ops for people; keep them in step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import msgpack

from prorl_cli.exceptions import ProtocolError

PROTOCOL_VERSION = 1

# Liveness: a peer that has been silent for HEARTBEAT_LIVENESS intervals is dead.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 3

# Whole messages are bounded by config broker.max_message_bytes (ZMQ_MAXMSGSIZE drops
# the connection); headers must stay small because the broker decodes every one of them.
MAX_HEADER_BYTES = 4 * 1024 * 1024


class Op(str, enum.Enum):
    """Every op on the wire. The comment says who sends it to whom."""

    # client -> broker (the paper's endpoints, plus result streaming)
    SUBMIT = "submit"  # paper: /process. jobs=[JobSpec], payload: one instance per job
    CANCEL = "cancel"  # paper: /cancel. job_ids=[...]
    WATCH = "watch"  # job_ids=[...]: push results of these jobs to the caller
    STATUS = "status"  # paper: /status
    ADD_LLM_SERVER = "add_llm_server"  # paper: /add_llm_server. url=..., model?
    CLEAR_LLM_SERVER = "clear_llm_server"  # paper: /clear_llm_server. url? (all when absent)
    LIST_LLM_SERVERS = "list_llm_servers"
    PAUSE_GENERATION = "pause_generation"  # hold new generate calls (weight sync); drain_timeout_s: answer once drained
    RESUME_GENERATION = "resume_generation"
    # client -> broker -> every live bridge: load the weights in ``checkpoint`` in place, as ``policy_version``.
    UPDATE_WEIGHTS = "update_weights"  # checkpoint, policy_version, load_timeout_s?
    START = "start"  # paper: /start. (re)open job placement on nodes
    HOLD = "hold"  # stop placing queued jobs on nodes; running ones go on
    STOP = "stop"  # paper: /stop. cancel everything, stop nodes and bridges, exit
    FORGET = "forget"  # job_ids=[...]: drop the retained results of these finished jobs
    LIST_JOBS = "list_jobs"  # prefix?, group_id?, after?: ids and states of the jobs held that match (paged)
    PING = "ping"

    # broker -> requester
    REPLY = "reply"  # ok=True plus op-specific fields, or ok=False plus error={code, message}
    # broker -> client (pushed)
    RESULT = "result"  # jobs=[{job_id, state}], payload: one JobResult per job

    # node -> broker
    REGISTER = "register"  # NodeHello fields
    HEARTBEAT = "heartbeat"  # node/bridge: stats; broker -> peer: liveness only
    UNREGISTER = "unregister"  # node/bridge leaving for good (jobs/requests it held fail over)
    # node -> broker: draining (preemption warning): place nothing more here; job_ids (never started) go back
    RELEASE = "release"
    JOB_STAGE = "job_stage"  # updates=[{job_id, attempt, stage}]
    JOB_DONE = "job_done"  # jobs=[{job_id, attempt, state}], payload: one JobResult per job
    GENERATE = "generate"  # job_id, sampling; payload: [prompt int32]. Also broker -> bridge.

    # broker -> node
    ASSIGN = "assign"  # jobs=[JobSpec + attempt], timing?=[{since_submit_s, events}], payload: one instance per job
    CANCEL_JOB = "cancel_job"  # job_ids=[...]
    SHUTDOWN = "shutdown"  # leave: cancel everything, clean up, exit

    # inference bridge -> broker
    REGISTER_BACKEND = "register_backend"  # BackendHello fields
    GENERATE_REPLY = "generate_reply"  # rid, finish_reason, policy_version? | error; payload: [ids int32, logprobs f32]
    WEIGHTS_UPDATED = "weights_updated"  # rid (the broker's update_weights forward id), error?
    # node -> broker: the node gave up on its generate ``rid`` (no reply);
    # broker -> bridge: stop forwarded generate ``rid`` at the engine (its job ended, or its node gave up).
    GENERATE_CANCEL = "generate_cancel"  # rid, job_id
    # node -> broker, after it called a redirected HTTP backend itself (no reply):
    # lets the broker count in-flight requests and served calls of HTTP backends.
    GENERATE_DONE = "generate_done"  # job_id, backend_id
    # broker -> node: its generate ``rid`` (of ``job_id``) is held at the broker (``held`` true: generation
    # paused, or no backend up) or leaves the hold for a backend (``held`` false). The node's clocks of that
    # job (stage deadline, budget, ``generate_timeout_s``) stand still while one of its calls is held.
    GENERATE_HELD = "generate_held"  # rid, job_id, held


class ErrorCode(str, enum.Enum):
    """Codes of ``error`` replies; the message says what exactly was wrong."""

    BAD_FRAME = "bad_frame"  # header is not a msgpack map, or too large
    BAD_VERSION = "bad_version"
    UNKNOWN_OP = "unknown_op"
    MISSING_FIELD = "missing_field"
    BAD_FIELD = "bad_field"
    UNKNOWN_JOB = "unknown_job"
    UNKNOWN_PEER = "unknown_peer"  # a node/bridge op from a peer that has not registered
    UNKNOWN_TASK = "unknown_task"
    BACKEND_ERROR = "backend_error"
    SHUTTING_DOWN = "shutting_down"
    DRAIN_TIMEOUT = "drain_timeout"  # pause_generation's wait ran out with calls in flight (``running`` names them)
    RELOAD_FAILED = "reload_failed"  # a backend could not load new weights (``failed`` names it and why)


class JobState(str, enum.Enum):
    """queued -> assigned -> init -> run -> eval -> done | failed | cancelled | timed_out.

    ``assigned``: placed on a node that has not yet reported the job's first stage.
    """

    QUEUED = "queued"
    ASSIGNED = "assigned"
    INIT = "init"
    RUN = "run"
    EVAL = "eval"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT})
STAGES = (JobState.INIT, JobState.RUN, JobState.EVAL)


# ---------------------------------------------------------------------------
# Framing


def encode(header: dict[str, Any], payload: Sequence[bytes] = ()) -> list[bytes]:
    """Frames for ``header`` (the version is added) and ``payload``."""
    return [msgpack.packb({"v": PROTOCOL_VERSION, **header}, use_bin_type=True), *payload]


def decode_map(frame: bytes) -> dict[str, Any]:
    """Decode a header frame into a map, checking nothing else (so an error reply can still echo its ``rid``)."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header frame is {len(frame)} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header frame is not msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header must be a msgpack map, got {type(header).__name__}")
    return header


def check_envelope(header: dict[str, Any]) -> dict[str, Any]:
    """Check a decoded header's version and op (replacing the op name by its :class:`Op`)."""
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION, f"protocol version {version!r} is not supported (this peer speaks {PROTOCOL_VERSION})"
        )
    op = header.get("op")
    if not isinstance(op, str):
        raise ProtocolError(ErrorCode.MISSING_FIELD, "header has no 'op' string")
    try:
        header["op"] = Op(op)
    except ValueError as e:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}") from e
    return header


def decode_header(frame: bytes) -> dict[str, Any]:
    """Decode and check a header frame; raise :class:`ProtocolError` naming the problem."""
    return check_envelope(decode_map(frame))


# ---------------------------------------------------------------------------
# Schemas: one per op, checked in one place (the broker's dispatch) before any
# handler runs. A tiny DSL: each checker takes (value, path) and returns the
# value or raises ProtocolError naming the path. Header fields not named here
# are ignored (newer peers may send more); nested records named here are strict.

MAX_ID_CHARS = 256
#: A request id may be any integer msgpack carries (int64 and uint64): the broker echoes it as sent.
RID_MIN, RID_MAX = -(1 << 63), (1 << 64) - 1
MAX_JOBS_PER_MESSAGE = 100_000
MAX_META_BYTES = 4096
#: Most job ids one ``list_jobs`` reply carries; the reply's ``next`` pages on (a header stays far below MAX_HEADER_BYTES).
MAX_LISTED_JOBS = 10_000
_BIG = 1 << 62

Check = Callable[[Any, str], Any]


def _bad(path: str, message: str, code: ErrorCode | None = None) -> ProtocolError:
    return ProtocolError((code or ErrorCode.BAD_FIELD).value, f"{path!r} {message}")


def _type_name(value: Any) -> str:
    return type(value).__name__


def Str(max_len: int = MAX_ID_CHARS, *, min_len: int = 1, choices: Sequence[str] | None = None) -> Check:
    """A string of ``min_len``..``max_len`` characters (one of ``choices`` when given)."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, str):
            raise _bad(path, f"must be a string, got {_type_name(v)}")
        if not min_len <= len(v) <= max_len:
            raise _bad(path, f"must have {min_len} to {max_len} characters, got {len(v)}")
        if choices is not None and v not in choices:
            raise _bad(path, f"must be one of {sorted(choices)}, got {v!r}")
        return v

    return check


def Int(lo: int = 0, hi: int = _BIG) -> Check:
    """An integer in ``[lo, hi]`` (booleans are not integers here)."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, int) or isinstance(v, bool):
            raise _bad(path, f"must be an integer, got {_type_name(v)}")
        if not lo <= v <= hi:
            raise _bad(path, f"must be in [{lo}, {hi}], got {v}")
        return v

    return check


def Num(lo: float = 0.0, hi: float = float(_BIG), *, lo_open: bool = False) -> Check:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); NaN and infinities are refused."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise _bad(path, f"must be a number, got {_type_name(v)}")
        if not math.isfinite(v):
            raise _bad(path, f"must be a finite number, got {v}")
        if v > hi or v < lo or (lo_open and v == lo):
            raise _bad(path, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}")
        return v

    return check


def Bool() -> Check:
    def check(v: Any, path: str) -> Any:
        if not isinstance(v, bool):
            raise _bad(path, f"must be a boolean, got {_type_name(v)}")
        return v

    return check


def Id() -> Check:
    """A request id: a string of at most ``MAX_ID_CHARS`` characters, or any msgpack integer (int64 or uint64)."""
    as_str, as_int = Str(MAX_ID_CHARS, min_len=0), Int(RID_MIN, RID_MAX)

    def check(v: Any, path: str) -> Any:
        return as_str(v, path) if isinstance(v, str) else as_int(v, path)

    return check


def Scalar(max_len: int = 1024) -> Check:
    """A string, number, boolean or null (numbers finite)."""
    s, n = Str(max_len, min_len=0), Num(-float(_BIG), float(_BIG))

    def check(v: Any, path: str) -> Any:
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, str):
            return s(v, path)
        if isinstance(v, int | float):
            return n(v, path)
        raise _bad(path, f"must be a string, number, boolean or null, got {_type_name(v)}")

    return check


def List(item: Check, max_len: int = MAX_JOBS_PER_MESSAGE) -> Check:
    """A list of at most ``max_len`` items, each checked by ``item``."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, list):
            raise _bad(path, f"must be a list, got {_type_name(v)}")
        if len(v) > max_len:
            raise _bad(path, f"has {len(v)} items; the limit is {max_len}")
        for i, x in enumerate(v):
            item(x, f"{path}[{i}]")
        return v

    return check


def Dict(key: Check, value: Check, max_len: int = 64, max_packed_bytes: int | None = None) -> Check:
    """A map of at most ``max_len`` entries with checked keys and values."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, dict):
            raise _bad(path, f"must be a map, got {_type_name(v)}")
        if len(v) > max_len:
            raise _bad(path, f"has {len(v)} entries; the limit is {max_len}")
        for k, x in v.items():
            key(k, f"{path}.key")
            value(x, f"{path}[{k!r}]")
        if max_packed_bytes is not None and len(msgpack.packb(v, use_bin_type=True)) > max_packed_bytes:
            raise _bad(path, f"packs to more than {max_packed_bytes} bytes")
        return v

    return check


@dataclass(frozen=True)
class Opt:
    """A field that may be absent or null."""

    check: Check


FieldSpec = Check | Opt


def Record(fields: dict[str, FieldSpec], *, strict: bool = True) -> Check:
    """A map with named fields; ``strict`` refuses fields not named."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, dict):
            raise _bad(path, f"must be a map, got {_type_name(v)}")
        if strict:
            unknown = [k for k in v if k not in fields]
            if unknown:
                raise _bad(path, f"has unknown field(s) {sorted(map(str, unknown))}")
        for name, spec in fields.items():
            sub = f"{path}.{name}" if path else name
            value = v.get(name)
            if isinstance(spec, Opt):
                if value is not None:
                    spec.check(value, sub)
            elif name not in v:
                raise _bad(sub, "is missing", ErrorCode.MISSING_FIELD)
            else:
                spec(value, sub)
        return v

    return check


#: The stage names, in order (``stage_timeouts_s`` keys, the node's stage pools).
STAGE_NAMES = tuple(s.value for s in STAGES)
_JOB_STATES = tuple(s.value for s in JobState)
_POSITIVE_S = Num(0.0, 1e9, lo_open=True)
JOB_SPEC_META = Dict(Str(64), Scalar(), max_len=64, max_packed_bytes=MAX_META_BYTES)


def _positive_finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0

SAMPLING = Record({
    "max_tokens": Opt(Int(1, 1 << 24)),
    "temperature": Opt(Num(0.0, 1e6)),
    "top_p": Opt(Num(0.0, 1.0)),
    "top_k": Opt(Int(-1, 1 << 24)),
    "seed": Opt(Int(-_BIG, _BIG)),
    "stop_token_ids": Opt(List(Int(0, (1 << 31) - 1), 4096)),
    "ignore_eos": Opt(Bool()),
})

JOB_SPEC = Record({
    "job_id": Str(),
    "task": Str(),
    "timeout_s": Opt(_POSITIVE_S),
    "stage_timeouts_s": Opt(Dict(Str(choices=STAGE_NAMES), _POSITIVE_S, max_len=3)),
    "sampling": Opt(SAMPLING),
    "attempt": Opt(Int(1, 1_000_000)),
    "max_attempts": Opt(Int(1, 1_000_000)),
    "group_id": Opt(Str()),
    "meta": Opt(JOB_SPEC_META),
})

_JOB_IDS = List(Str())
_UPDATE = Record({"job_id": Str(), "attempt": Int(1, 1_000_000), "stage": Str(32, choices=_JOB_STATES)}, strict=False)
_DONE = Record({"job_id": Str(), "attempt": Int(1, 1_000_000), "state": Str(32, choices=_JOB_STATES)}, strict=False)
_STAGE_STATS = Dict(Str(32), Record({"active": Int(0, 1 << 31), "queued": Int(0, 1 << 31), "limit": Int(0, 1 << 31)}), max_len=8)
_TOKEN = Str(256)
_URL = Str(2048)


def _metric_sample(v: Any, path: str) -> Any:
    """One heartbeat metric sample: ``[family, [label values], value]`` or ``[family, [labels], sum, [bucket counts]]``.

    Checked with plain type tests (every node's heartbeat carries many of these each interval).
    """
    if type(v) is not list or len(v) not in (3, 4):
        raise _bad(path, "must be a list [family, labels, value] or [family, labels, sum, counts]")
    name, labels, value = v[0], v[1], v[2]
    if type(name) is not str or not 0 < len(name) <= 128:
        raise _bad(f"{path}[0]", "must be a metric family name (a string of 1 to 128 characters)")
    if type(labels) is not list or len(labels) > 16 or not all(type(x) is str and len(x) <= 256 for x in labels):
        raise _bad(f"{path}[1]", "must be a list of at most 16 label values (strings of at most 256 characters)")
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _bad(f"{path}[2]", "must be a finite number")
    if len(v) == 4:
        counts = v[3]
        if type(counts) is not list or len(counts) > 64 or not all(type(c) is int and c >= 0 for c in counts):
            raise _bad(f"{path}[3]", "must be a list of at most 64 bucket counts (non-negative integers)")
    return v


#: Heartbeat ``metrics`` of a node or bridge (cumulative; names in ``prorl_cli/observe/metrics.py``).
METRIC_SAMPLES = List(_metric_sample, 4096)


#: A node's failures of one kind (task, stage, exception type): how many so far and the latest message.
FAILURE_GROUP = Record({"task": Str(), "stage": Str(64), "type": Str(128), "count": Int(0, _BIG),
                        "sample": Str(1024, min_len=0)}, strict=False)

#: Heartbeat ``metrics`` of a node or bridge (cumulative; names in ``prorl_cli/observe/metrics.py``).
METRIC_SAMPLES = List(_metric_sample, 4096)


@dataclass(frozen=True)
class OpSchema:
    """The header fields of one op and how many payload frames it carries.

    ``payload``: an exact count, ``"jobs"`` (one frame per item of the header's ``jobs``) or ``None`` (any).
    """

    fields: dict[str, FieldSpec]
    payload: int | str | None = 0


_RID: dict[str, FieldSpec] = {"rid": Id()}

OP_SCHEMAS: dict[Op, OpSchema] = {
    Op.SUBMIT: OpSchema({**_RID, "jobs": List(JOB_SPEC)}, payload="jobs"),
    Op.CANCEL: OpSchema({**_RID, "job_ids": _JOB_IDS}),
    Op.WATCH: OpSchema({**_RID, "job_ids": _JOB_IDS}),
    Op.FORGET: OpSchema({**_RID, "job_ids": _JOB_IDS}),
    Op.LIST_JOBS: OpSchema({**_RID, "prefix": Opt(Str()), "group_id": Opt(Str()), "after": Opt(Int(0, _BIG))}),
    Op.STATUS: OpSchema(dict(_RID)),
    Op.ADD_LLM_SERVER: OpSchema({**_RID, "url": _URL, "model": Opt(Str())}),
    Op.CLEAR_LLM_SERVER: OpSchema({**_RID, "url": Opt(_URL)}),
    Op.LIST_LLM_SERVERS: OpSchema(dict(_RID)),
    Op.PAUSE_GENERATION: OpSchema({**_RID, "policy_version": Opt(Int(0, _BIG)), "drain_timeout_s": Opt(Num(0.0, 1e6))}),
    Op.UPDATE_WEIGHTS: OpSchema({**_RID, "checkpoint": Str(4096), "policy_version": Int(0, _BIG), "load_timeout_s": Opt(_POSITIVE_S)}),
    Op.WEIGHTS_UPDATED: OpSchema({
        **_RID, "error": Opt(Record({"code": Str(64), "message": Str(64 * 1024, min_len=0)}, strict=False)),
    }),
    Op.RESUME_GENERATION: OpSchema({**_RID, "policy_version": Opt(Int(0, _BIG))}),
    Op.START: OpSchema(dict(_RID)),
    Op.HOLD: OpSchema(dict(_RID)),
    Op.STOP: OpSchema(dict(_RID)),
    Op.PING: OpSchema(dict(_RID)),
    Op.REGISTER: OpSchema({
        **_RID,
        "node_id": Str(),
        "host": Str(),
        "pid": Opt(Int(0, (1 << 31) - 1)),
        "credit": Int(1, 1_000_000),
        "tasks": List(Str(), 4096),
        "running": Opt(List(_UPDATE, 1_000_000)),
        "liveness_token": Opt(_TOKEN),
        # The sandbox runtime the node picked (``sandbox.runtime: auto`` resolved); absent when it has none.
        "sandbox_runtime": Opt(Str(32)),
        # The node is draining (it sent ``release``): a restarted broker places nothing more on it.
        "draining": Opt(Bool()),
    }),
    Op.HEARTBEAT: OpSchema({
        "rid": Opt(Id()),
        "node_id": Opt(Str()),
        "backend_id": Opt(Str()),
        "stages": Opt(_STAGE_STATS),
        "inflight": Opt(Int(0, _BIG)),
        "liveness_token": Opt(_TOKEN),
        "stats": Opt(Dict(Str(64), Num(-float(_BIG), float(_BIG)), max_len=32)),  # a bridge's engine figures
        "metrics": Opt(METRIC_SAMPLES),  # a node's or bridge's Prometheus figures (docs/observability.md)
        "failures": Opt(List(FAILURE_GROUP, 256)),  # a node's failed jobs grouped (shown by prorl top)
    }),
    Op.UNREGISTER: OpSchema({"rid": Opt(Id()), "node_id": Opt(Str()), "backend_id": Opt(Str())}),
    Op.RELEASE: OpSchema({**_RID, "job_ids": _JOB_IDS}),
    Op.JOB_STAGE: OpSchema({"updates": List(_UPDATE, 1_000_000)}),
    Op.JOB_DONE: OpSchema({"jobs": List(_DONE, 1_000_000)}, payload="jobs"),
    Op.GENERATE: OpSchema({**_RID, "job_id": Str(), "sampling": Opt(SAMPLING), "host": Opt(Str())}, payload=1),
    Op.REGISTER_BACKEND: OpSchema({
        **_RID,
        "backend_id": Str(),
        "host": Str(),
        "model": Str(1024),
        "max_model_len": Opt(Int(1, 1 << 31)),
        "capacity": Opt(Int(0, 1_000_000)),
    }),
    Op.GENERATE_REPLY: OpSchema({
        **_RID,
        "finish_reason": Opt(Str(64)),
        # The bridge's own weights version when the call ran (absent: the broker stamps its current version).
        "policy_version": Opt(Int(0, _BIG)),
        "error": Opt(Record({"code": Str(64), "message": Str(64 * 1024, min_len=0)}, strict=False)),
    }, payload=None),
    Op.GENERATE_DONE: OpSchema({"job_id": Str(), "backend_id": _URL}),
    Op.GENERATE_CANCEL: OpSchema({**_RID, "job_id": Str()}),
}


#: One checker per op, built once (``validate`` runs on every message the broker reads).
_OP_CHECKS = {op: Record(schema.fields, strict=False) for op, schema in OP_SCHEMAS.items()}


def header_rid(header: dict[str, Any]) -> Any:
    """The request id of a (maybe invalid) header, if it has a usable one: error replies echo it."""
    rid = header.get("rid")
    if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS:
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool) and RID_MIN <= rid <= RID_MAX:
        return rid
    return None


def validate(header: dict[str, Any], n_payload: int | None = None) -> None:
    """Check ``header`` (decoded) against its op's schema, and the payload count when given.

    Raises :class:`ProtocolError` (``missing_field`` / ``bad_field``) naming the op and the field.
    """
    op: Op = header["op"]
    schema = OP_SCHEMAS.get(op)
    if schema is None:
        return
    try:
        _OP_CHECKS[op](header, "")
    except ProtocolError as e:
        raise ProtocolError(e.code, f"op {op.value!r}: field {e.message}") from None
    if n_payload is None or schema.payload is None:
        return
    want = len(header["jobs"]) if schema.payload == "jobs" else schema.payload
    if n_payload != want:
        raise ProtocolError(
            ErrorCode.BAD_FIELD.value,
            f"op {op.value!r} carries {n_payload} payload frame(s) but needs {want}"
            + (" (one instance/result frame per item of 'jobs': the job records and frames must pair up)" if schema.payload == "jobs" else ""),
        )


def require_fields(header: dict[str, Any]) -> None:
    """Check that ``header`` has the fields its op needs, with the right types and ranges."""
    validate(header)


def reply(rid: Any, **fields: Any) -> dict[str, Any]:
    """A success reply header."""
    return {"op": Op.REPLY.value, "rid": rid, "ok": True, **fields}


def error_reply(rid: Any, code: ErrorCode | str, message: str, **fields: Any) -> dict[str, Any]:
    """An error reply header: ``ok`` false and ``error`` = {code, message}."""
    code_s = code.value if isinstance(code, ErrorCode) else code
    return {"op": Op.REPLY.value, "rid": rid, "ok": False, "error": {"code": code_s, "message": message}, **fields}


# ---------------------------------------------------------------------------
# Bulk payloads


def _pack(typecode: str, values: Sequence[Any]) -> bytes:
    arr = array(typecode, values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _unpack(typecode: str, what: str, data: bytes) -> list[Any]:
    if len(data) % 4:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{what} frame of {len(data)} bytes is not a whole number of 4-byte items")
    arr = array(typecode)
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def pack_tokens(ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes."""
    return _pack("i", ids)


def unpack_tokens(data: bytes) -> list[int]:
    """Inverse of :func:`pack_tokens`."""
    return _unpack("i", "int32 token", data)


def pack_floats(values: Sequence[float]) -> bytes:
    """Log-probs as float32 little-endian bytes."""
    return _pack("f", values)


def unpack_floats(data: bytes) -> list[float]:
    """Inverse of :func:`pack_floats`."""
    return _unpack("f", "float32", data)


def pack_obj(obj: Any) -> bytes:
    """A msgpack payload frame (instances, results)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack_obj(data: bytes) -> Any:
    """Inverse of :func:`pack_obj`; raise :class:`ProtocolError` on garbage."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"payload frame is not msgpack: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------
# Records


#: Field names per record class, computed once (``dataclasses.fields`` on every call was a hot-path cost).
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


class _Record:
    """Mixin: to/from a msgpack-ready dict, rejecting wrong shapes with a named field."""

    def to_wire(self) -> dict[str, Any]:
        out = {}
        for name in _field_names(type(self)):
            v = getattr(self, name)
            if isinstance(v, _NESTED):
                v = v.value if isinstance(v, enum.Enum) else v.to_wire()
            out[name] = v
        return out

    @classmethod
    def from_wire(cls, data: Any, what: str | None = None) -> Self:
        if not isinstance(data, dict):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{what or cls.__name__} must be a map, got {type(data).__name__}")
        unknown = data.keys() - _field_names(cls)
        if unknown:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{what or cls.__name__} has unknown field(s) {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ProtocolError(ErrorCode.MISSING_FIELD, f"{what or cls.__name__}: {e}") from e


#: Field values that :meth:`_Record.to_wire` converts (a tuple: ``isinstance`` is faster with one than with a union).
_NESTED = (enum.Enum, _Record)


@dataclass
class ForgetOutcome(_Record):
    """The ``forget`` reply: results dropped, jobs still unfinished (kept), ids the broker does not know."""

    forgotten: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


@dataclass
class SamplingParams(_Record):
    """Sampling of one generate call (the generate contract)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    #: Keep sampling past end-of-sequence tokens (fixed-length generations); ``stop_token_ids`` still stop.
    ignore_eos: bool = False


@dataclass
class JobSpec(_Record):
    """A job as submitted. The task instance travels beside it as an opaque payload frame.

    ``timeout_s`` is the total in-stage budget; ``stage_timeouts_s`` optionally
    caps each stage (keys ``init``, ``run``, ``eval``). Queue waits never count.
    """

    job_id: str
    task: str
    timeout_s: float | None = None
    stage_timeouts_s: dict[str, float] | None = None
    sampling: dict[str, Any] | None = None
    attempt: int = 1
    max_attempts: int = 3
    #: The caller's group (e.g. the prompt of a GRPO group); echoed in the result.
    group_id: str | None = None
    #: A small map (str keys, scalar values, packed <= 4 KiB) echoed in the result.
    meta: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not self.job_id:
            raise ProtocolError(ErrorCode.BAD_FIELD, "job_id must be a non-empty string")
        if len(self.job_id) > 256:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"job_id is {len(self.job_id)} characters; the limit is 256")
        if not isinstance(self.task, str) or not self.task:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: task must be a non-empty string")
        if self.timeout_s is not None and not _positive_finite(self.timeout_s):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: timeout_s must be a positive number")
        if self.stage_timeouts_s is not None:
            if not isinstance(self.stage_timeouts_s, dict):
                raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: stage_timeouts_s must be a map")
            for k, v in self.stage_timeouts_s.items():
                if k not in STAGE_NAMES:
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: stage_timeouts_s has unknown stage {k!r}")
                if not _positive_finite(v):
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: stage_timeouts_s[{k!r}] must be a positive number")
        if self.sampling is not None and not isinstance(self.sampling, dict):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: sampling must be a map")
        if self.group_id is not None and not isinstance(self.group_id, str):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: group_id must be a string")
        if self.meta is not None:
            JOB_SPEC_META(self.meta, f"job {self.job_id!r}: meta")
        for name in ("attempt", "max_attempts"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: {name} must be a positive integer")


@dataclass
class ErrorInfo(_Record):
    """What went wrong in a stage: the stage, the exception type and its message."""

    stage: str
    type: str
    message: str


@dataclass
class JobResult(_Record):
    """The result of one job, always well formed whatever happened.

    ``output`` is what the handler's ``final_result`` returned (trajectory,
    messages, artifacts); ``reward`` is copied out of it for convenience.
    ``critical_error`` names the stage that failed (or ``None``).
    ``stage_s`` is the in-stage time of each stage; ``active_s`` their sum.
    """

    job_id: str
    task: str
    state: str
    attempt: int = 1
    node_id: str | None = None
    reward: float | None = None
    critical_error: str | None = None
    error: dict[str, str] | None = None
    stage_s: dict[str, float] = field(default_factory=dict)
    active_s: float = 0.0
    output: Any = None
    #: Echoed from the JobSpec.
    group_id: str | None = None
    meta: dict[str, Any] | None = None
    #: The job's timeline: ``[name, t_s, dur_s]`` or ``[name, t_s, dur_s, attrs]``, seconds since the broker
    #: accepted it (``prorl_cli/observe/timeline.py``, docs/observability.md); ``None`` from older peers.
    events: list[list[Any]] | None = None
    #: The job's own log file on its node (written only when the job logged something), else ``None``.
    log_path: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == JobState.DONE.value


@dataclass
class StageStats(_Record):
    """Per-stage pool counters of one node."""

    active: int = 0
    queued: int = 0
    limit: int = 0


@dataclass
class NodeStatus(_Record):
    node_id: str
    host: str
    pid: int
    alive: bool
    credit: int
    inflight: int
    tasks: list[str]
    stages: dict[str, dict[str, int]] = field(default_factory=dict)
    #: ``apptainer``, ``bwrap`` or ``local`` (no isolation), as the node's ``register`` said; None when not sent.
    sandbox_runtime: str | None = None
    #: Seconds since the broker last heard from the node (its heartbeats come every interval).
    silent_s: float = 0.0
    #: Why the broker declared the node lost (``silent for 2.1 s``, ``unregistered``, ...); None while alive.
    lost_reason: str | None = None
    #: Draining (a preemption or time-limit warning): running jobs finish, nothing new is placed on it.
    draining: bool = False


@dataclass
class BackendStatus(_Record):
    """An inference backend: a bridge (ZMQ peer) or a plain HTTP address."""

    backend_id: str
    kind: str  # "bridge" | "http"
    url: str | None
    host: str | None
    model: str | None
    max_model_len: int | None
    inflight: int
    jobs: int
    served: int
    cleared: bool
    alive: bool
    #: Engine figures from the bridge's heartbeat ``stats`` (str -> number); empty when it sends none.
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class StatusReport(_Record):
    """The broker's answer to ``status``."""

    deployment: str
    jobs: dict[str, int]
    queued: int
    nodes: list[dict[str, Any]]
    backends: list[dict[str, Any]]
    generation_paused: bool
    placing: bool
    uptime_s: float
    #: Generate calls held at the broker (generation paused, or no backend up).
    held_generates: int = 0
    #: Finished results kept for late watchers, and their size (instances and results).
    retained_results: int = 0
    retained_bytes: int = 0
    #: The trainer's policy version, as last given to pause/resume_generation (0 until given).
    policy_version: int = 0
    #: ``broker.routing_policy``: how generate calls pick a backend.
    routing_policy: str = "least_loaded_sticky"
    #: Where the broker serves Prometheus metrics (``broker.metrics_port``), or ``None`` when off.
    metrics_url: str | None = None
    #: Jobs by task, then by state.
    by_task: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Failed jobs grouped by task, stage and error type across nodes: ``{task, stage, type, count, sample, nodes}``.
    failures: list[dict[str, Any]] = field(default_factory=list)
    #: Tokens through each backend so far, as the nodes count them: ``{backend: {"prompt": n, "output": n}}``.
    tokens: dict[str, dict[str, float]] = field(default_factory=dict)

    def node_statuses(self) -> list[NodeStatus]:
        return [NodeStatus.from_wire(n) for n in self.nodes]

    def backend_statuses(self) -> list[BackendStatus]:
        return [BackendStatus.from_wire(b) for b in self.backends]
