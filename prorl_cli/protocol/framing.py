"""Framing of prorl's wire protocol: the ops, error codes, job states, and how frames are made and read.

Transport: ZeroMQ ROUTER at the broker, DEALER at every peer (client, node,
inference bridge). A message is a multipart ``[header, *payload]``:

* ``header`` is a msgpack map with at least ``v`` (protocol version), ``op``
  (one of :class:`Op`) and, for requests, ``rid`` (a request id the reply
  echoes).
* payload frames carry bulk data the broker forwards without decoding: job
  instances and results (msgpack), token arrays (int32 little-endian) and
  log-probs (float32 little-endian). The ops that carry one item per job
  (:data:`JOB_ITEM_OPS`: an instance or a result each) pack their items in
  one frame, a msgpack array of bin (:func:`encode`, :func:`job_items`).

Each op's header fields are checked in :mod:`prorl_cli.protocol.schema`, which
turns a valid header into its typed form (:mod:`prorl_cli.protocol.headers`).
``docs/protocol.md`` describes the same ops for people; keep them in step.
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack

from prorl_cli.exceptions import ProtocolError

#: 2: the per-job items of :data:`JOB_ITEM_OPS` travel packed in one frame (1: a frame per job).
PROTOCOL_VERSION = 2

# Liveness: a peer that has been silent for HEARTBEAT_LIVENESS intervals is dead.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 3

MAX_ID_CHARS = 256
#: A request id may be any integer msgpack carries (int64 and uint64): the broker echoes it as sent.
#: msgpack's integer range: an integer outside it cannot be sent at all.
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
RID_MIN, RID_MAX = INT_MIN, INT_MAX

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
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # a generate call's prompt leaves the model no room
    SHUTTING_DOWN = "shutting_down"
    DRAIN_TIMEOUT = "drain_timeout"  # pause_generation's wait ran out with calls in flight (``running`` names them)
    RELOAD_FAILED = "reload_failed"  # a backend could not load new weights (``failed`` names it and why)
    JOURNAL_UNWRITABLE = "journal_unwritable"  # the broker cannot write its journal: a submit is refused whole


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

#: The ops whose payload is one item per entry of the header's ``jobs`` (an instance or a result), sent as
#: one frame: a msgpack array of bin. Every ZeroMQ frame costs the sender, the receiver and both I/O threads a
#: few microseconds, which a frame per job paid on every hop. The ops' own values are members too, so a
#: header naming its op by string or by :class:`Op` is found.
_JOB_ITEM_OPS = (Op.SUBMIT, Op.ASSIGN, Op.JOB_DONE, Op.RESULT)
JOB_ITEM_OPS: frozenset[Any] = frozenset({*_JOB_ITEM_OPS, *(op.value for op in _JOB_ITEM_OPS)})


def encode(header: dict[str, Any], payload: Sequence[bytes] = ()) -> list[bytes]:
    """Frames for ``header`` (the version is added) and ``payload``.

    For an op of :data:`JOB_ITEM_OPS`, ``payload`` is its per-job items, packed here into one frame.
    """
    head = msgpack.packb({"v": PROTOCOL_VERSION, **header}, use_bin_type=True)
    if header.get("op") in JOB_ITEM_OPS:
        return [head, msgpack.packb(payload if isinstance(payload, list) else list(payload), use_bin_type=True)]
    return [head, *payload]


def job_items(op: Op, payload: list[bytes]) -> list[bytes]:
    """The payload of a received message as its op uses it: the per-job items of a :data:`JOB_ITEM_OPS` op
    unpacked from their frame, any other op's frames as they came.

    Raises :class:`ProtocolError` (``bad_frame``) when a job-item op does not carry exactly one frame holding
    a msgpack array of bin.
    """
    if op not in JOB_ITEM_OPS:
        return payload
    if len(payload) != 1:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"op {op.value!r} carries its jobs' items packed in one payload frame "
                                                 f"(protocol version {PROTOCOL_VERSION}); got {len(payload)} frames")
    try:
        items = msgpack.unpackb(payload[0], raw=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(ErrorCode.BAD_FRAME, f"op {op.value!r}: the payload frame is not msgpack: "
                                                 f"{type(e).__name__}: {e}") from e
    if not isinstance(items, list) or not all(type(item) is bytes for item in items):
        got = type(items).__name__ if not isinstance(items, list) else \
            f"an array holding {sorted({type(i).__name__ for i in items if type(i) is not bytes})}"
        raise ProtocolError(ErrorCode.BAD_FRAME, f"op {op.value!r}: the payload frame must be a msgpack array of bin "
                                                 f"(one item per job), got {got}")
    return items


def decode_map(frame: bytes) -> dict[str, Any]:
    """Decode a header frame into a map, checking nothing else (so an error reply can still echo its ``rid``)."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header frame is {len(frame)} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        # Keys of any hashable type decode: a map keyed by numbers fails its field's check, which names
        # the field and echoes the rid, instead of making the whole header unreadable.
        header = msgpack.unpackb(frame, raw=False, strict_map_key=False)
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


def header_rid(header: dict[str, Any]) -> Any:
    """The request id of a (maybe invalid) header, if it has a usable one: error replies echo it."""
    rid = header.get("rid")
    if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS:
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool) and RID_MIN <= rid <= RID_MAX:
        return rid
    return None


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
