"""prorl's wire protocol: every op, header field and job-record field, written once.

* :mod:`~prorl_cli.protocol.framing`: the ops, error codes and job states; header and payload frames.
* :mod:`~prorl_cli.protocol.checks`: the checker DSL (``Str``, ``Int``, ``List``, ``Record``, ...).
* :mod:`~prorl_cli.protocol.schema`: the job records' checkers and the fields several ops share.
* :mod:`~prorl_cli.protocol.headers`: each op declared once, as its header class whose fields carry
  their checks; :func:`parse` checks a header and returns it typed, :func:`parse_reply` a broker's
  reply; ``OP_SCHEMAS``, ``HEADERS``, ``REPLY_SCHEMAS`` and ``REPLIES`` are derived from the classes.
* :mod:`~prorl_cli.protocol.records`: job specs, results, sampling and status records.

Everything is importable from ``prorl_cli.protocol`` itself. ``docs/protocol.md`` describes
the same ops for people; keep them in step.
"""

from prorl_cli.protocol import headers
from prorl_cli.protocol.framing import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_LIVENESS,
    JOB_ITEM_OPS,
    MAX_HEADER_BYTES,
    MAX_ID_CHARS,
    PROTOCOL_VERSION,
    RID_MAX,
    RID_MIN,
    STAGES,
    TERMINAL_STATES,
    ErrorCode,
    JobState,
    Op,
    check_envelope,
    decode_header,
    decode_map,
    encode,
    error_reply,
    header_rid,
    job_items,
    pack_floats,
    pack_obj,
    pack_tokens,
    reply,
    unpack_floats,
    unpack_obj,
    unpack_tokens,
)
from prorl_cli.protocol.headers import (
    OP_SCHEMAS,
    REPLY_SCHEMAS,
    OpSchema,
    check_payload,
    parse,
    parse_reply,
    validate,
)
from prorl_cli.protocol.records import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    BackendStatus,
    ErrorInfo,
    ForgetOutcome,
    JobResult,
    JobSpec,
    NodeStatus,
    SamplingParams,
    StageStats,
    StatusReport,
    WeightsStatus,
    derive_seed,
)
from prorl_cli.protocol.schema import (
    ANNOTATIONS,
    FAILURE_GROUP,
    JOB_SPEC,
    JOB_SPEC_META,
    MAX_JOBS_PER_MESSAGE,
    MAX_LISTED_JOBS,
    MAX_META_BYTES,
    METRIC_SAMPLES,
    SAMPLING,
    STAGE_NAMES,
    Opt,
)

__all__ = [
    "ANNOTATIONS", "FAILURE_GROUP", "HEARTBEAT_INTERVAL_S", "HEARTBEAT_LIVENESS", "JOB_ITEM_OPS", "JOB_SPEC", "JOB_SPEC_META",
    "MAX_HEADER_BYTES", "MAX_ID_CHARS", "MAX_JOBS_PER_MESSAGE", "MAX_LISTED_JOBS", "MAX_META_BYTES", "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "METRIC_SAMPLES", "OP_SCHEMAS", "PROTOCOL_VERSION", "REPLY_SCHEMAS", "RID_MAX", "RID_MIN", "SAMPLING", "STAGES", "STAGE_NAMES",
    "TERMINAL_STATES", "BackendStatus", "ErrorCode", "ErrorInfo", "ForgetOutcome", "JobResult", "JobSpec",
    "JobState", "NodeStatus", "Op", "OpSchema", "Opt", "SamplingParams", "StageStats", "StatusReport", "WeightsStatus",
    "check_envelope", "check_payload", "decode_header", "decode_map", "derive_seed", "encode", "error_reply", "header_rid", "headers", "job_items",
    "pack_floats", "pack_obj", "pack_tokens", "parse", "parse_reply", "reply", "unpack_floats", "unpack_obj", "unpack_tokens",
    "validate",
]
