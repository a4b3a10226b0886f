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
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from prorl_cli.exceptions import ProtocolError

PROTOCOL_VERSION = 1

# Liveness: a peer that has been silent for HEARTBEAT_LIVENESS intervals is dead.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 3

# Size limits. The broker's ROUTER refuses whole messages above MAX_MESSAGE_BYTES
# (ZMQ_MAXMSGSIZE drops the connection); headers must stay small because the
# broker decodes every one of them.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
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
    PAUSE_GENERATION = "pause_generation"  # hold new generate calls (weight sync)
    RESUME_GENERATION = "resume_generation"
    START = "start"  # paper: /start. (re)open job placement on nodes
    HOLD = "hold"  # stop placing queued jobs on nodes; running ones go on
    STOP = "stop"  # paper: /stop. cancel everything, stop nodes and bridges, exit
    PING = "ping"

    # broker -> requester
    REPLY = "reply"  # ok=True plus op-specific fields, or ok=False plus error={code, message}
    # broker -> client (pushed)
    RESULT = "result"  # jobs=[{job_id, state}], payload: one JobResult per job

    # node -> broker
    REGISTER = "register"  # NodeHello fields
    HEARTBEAT = "heartbeat"  # node/bridge: stats; broker -> peer: liveness only
    UNREGISTER = "unregister"  # node/bridge leaving for good (jobs/requests it held fail over)
    JOB_STAGE = "job_stage"  # updates=[{job_id, attempt, stage}]
    JOB_DONE = "job_done"  # jobs=[{job_id, attempt, state}], payload: one JobResult per job
    GENERATE = "generate"  # job_id, sampling; payload: [prompt int32]. Also broker -> bridge.

    # broker -> node
    ASSIGN = "assign"  # jobs=[JobSpec + attempt], payload: one instance per job
    CANCEL_JOB = "cancel_job"  # job_ids=[...]
    SHUTDOWN = "shutdown"  # leave: cancel everything, clean up, exit

    # inference bridge -> broker
    REGISTER_BACKEND = "register_backend"  # BackendHello fields
    GENERATE_REPLY = "generate_reply"  # rid, finish_reason | error; payload: [ids int32, logprobs f32]
    # node -> broker: the node gave up on its generate ``rid`` (no reply);
    # broker -> bridge: stop forwarded generate ``rid`` at the engine (its job ended, or its node gave up).
    GENERATE_CANCEL = "generate_cancel"  # rid, job_id
    # broker -> node, answering GENERATE for an HTTP backend: call it yourself.
    REDIRECT = "redirect"  # rid, backend_id, url
    # node -> broker, after it called a redirected HTTP backend itself (no reply):
    # lets the broker count in-flight requests and served calls of HTTP backends.
    GENERATE_DONE = "generate_done"  # job_id, backend_id


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
    NO_BACKEND = "no_backend"
    BACKEND_ERROR = "backend_error"
    SHUTTING_DOWN = "shutting_down"


class JobState(str, enum.Enum):
    """queued -> init -> run -> eval -> done | failed | cancelled | timed_out."""

    QUEUED = "queued"
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


def decode_header(frame: bytes) -> dict[str, Any]:
    """Decode and check a header frame; raise :class:`ProtocolError` naming the problem."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header frame is {len(frame)} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header frame is not msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header must be a msgpack map, got {type(header).__name__}")
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


# Required header fields per op and their types; checked by require_fields().
_ANY_ID = (str, int)
OP_FIELDS: dict[Op, dict[str, type | tuple[type, ...]]] = {
    Op.SUBMIT: {"rid": _ANY_ID, "jobs": list},
    Op.CANCEL: {"rid": _ANY_ID, "job_ids": list},
    Op.WATCH: {"rid": _ANY_ID, "job_ids": list},
    Op.STATUS: {"rid": _ANY_ID},
    Op.ADD_LLM_SERVER: {"rid": _ANY_ID, "url": str},
    Op.CLEAR_LLM_SERVER: {"rid": _ANY_ID},
    Op.LIST_LLM_SERVERS: {"rid": _ANY_ID},
    Op.PAUSE_GENERATION: {"rid": _ANY_ID},
    Op.RESUME_GENERATION: {"rid": _ANY_ID},
    Op.START: {"rid": _ANY_ID},
    Op.HOLD: {"rid": _ANY_ID},
    Op.STOP: {"rid": _ANY_ID},
    Op.PING: {"rid": _ANY_ID},
    Op.REGISTER: {"rid": _ANY_ID, "node_id": str, "host": str, "credit": int, "tasks": list},
    Op.HEARTBEAT: {},
    Op.UNREGISTER: {},
    Op.JOB_STAGE: {"updates": list},
    Op.JOB_DONE: {"jobs": list},
    Op.GENERATE: {"rid": _ANY_ID, "job_id": str},
    Op.REGISTER_BACKEND: {"rid": _ANY_ID, "backend_id": str, "host": str, "model": str},
    Op.GENERATE_REPLY: {"rid": _ANY_ID},
    Op.GENERATE_DONE: {"job_id": str, "backend_id": str},
    Op.GENERATE_CANCEL: {"rid": _ANY_ID, "job_id": str},
}


def require_fields(header: dict[str, Any]) -> None:
    """Check that ``header`` has the fields its op needs, with the right types."""
    for name, typ in OP_FIELDS.get(header["op"], {}).items():
        if name not in header:
            raise ProtocolError(ErrorCode.MISSING_FIELD, f"op {header['op'].value!r} needs field {name!r}")
        if not isinstance(header[name], typ) or isinstance(header[name], bool):
            expected = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"field {name!r} of op {header['op'].value!r} must be {expected}, got {type(header[name]).__name__}",
            )


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


class _Record:
    """Mixin: to/from a msgpack-ready dict, rejecting wrong shapes with a named field."""

    def to_wire(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, _Record):
                v = v.to_wire()
            out[f.name] = v
        return out

    @classmethod
    def from_wire(cls, data: Any, what: str | None = None) -> Any:
        what = what or cls.__name__
        if not isinstance(data, dict):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{what} must be a map, got {type(data).__name__}")
        names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - set(names)
        if unknown:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{what} has unknown field(s) {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ProtocolError(ErrorCode.MISSING_FIELD, f"{what}: {e}") from e


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

    def __post_init__(self) -> None:
        if not isinstance(self.job_id, str) or not self.job_id:
            raise ProtocolError(ErrorCode.BAD_FIELD, "job_id must be a non-empty string")
        if len(self.job_id) > 256:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"job_id is {len(self.job_id)} characters; the limit is 256")
        if not isinstance(self.task, str) or not self.task:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: task must be a non-empty string")
        if self.timeout_s is not None and (
            not isinstance(self.timeout_s, int | float) or isinstance(self.timeout_s, bool) or self.timeout_s <= 0
        ):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: timeout_s must be a positive number")
        if self.stage_timeouts_s is not None:
            if not isinstance(self.stage_timeouts_s, dict):
                raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: stage_timeouts_s must be a map")
            for k, v in self.stage_timeouts_s.items():
                if k not in ("init", "run", "eval"):
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: stage_timeouts_s has unknown stage {k!r}")
                if not isinstance(v, int | float) or isinstance(v, bool) or v <= 0:
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: stage_timeouts_s[{k!r}] must be a positive number")
        if self.sampling is not None and not isinstance(self.sampling, dict):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"job {self.job_id!r}: sampling must be a map")
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

    @property
    def job_state(self) -> JobState:
        return JobState(self.state)

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
    #: The trainer's policy version, as last given to pause/resume_generation (0 until given).
    policy_version: int = 0
    #: ``broker.routing_policy``: how generate calls pick a backend.
    routing_policy: str = "least_loaded_sticky"

    def node_statuses(self) -> list[NodeStatus]:
        return [NodeStatus.from_wire(n) for n in self.nodes]

    def backend_statuses(self) -> list[BackendStatus]:
        return [BackendStatus.from_wire(b) for b in self.backends]
