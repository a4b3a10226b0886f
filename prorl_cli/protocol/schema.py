"""The wire schema's shared checkers: the job records (``JOB_SPEC``, ``SAMPLING``) and the fields several ops use.

The checker DSL itself is :mod:`prorl_cli.protocol.checks` (re-exported here); each op's header
fields are declared once, on its class in :mod:`prorl_cli.protocol.headers`, which derives the
per-op checkers (:func:`~prorl_cli.protocol.headers.parse`). A record checker given a class builds
it from the checked fields: :class:`~prorl_cli.protocol.records.JobSpec` and
:class:`~prorl_cli.protocol.records.SamplingParams` are read off the wire here. Nothing downstream
checks those fields again.
"""

from __future__ import annotations

from typing import Any

from prorl_cli.protocol.checks import (
    ANNOTATIONS,
    ANY,
    BIG,
    GRAMMAR,
    HTTP_URL,
    MAX_JOBS_PER_MESSAGE,
    MAX_LISTED_JOBS,
    MAX_META_BYTES,
    METRIC_SAMPLES,
    RECORD_FIELDS,
    URL,
    Bool,
    Check,
    Dict,
    FieldError,
    FieldSpec,
    Id,
    Int,
    List,
    Num,
    Opt,
    Record,
    Scalar,
    Str,
    _bad,
    read_by,
)
from prorl_cli.protocol.framing import STAGES, JobState
from prorl_cli.protocol.records import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STRUCTURED_BYTES,
    MAX_STRUCTURED_CHARS,
    MAX_STRUCTURED_CHOICES,
    MAX_TOP_LOGPROBS,
    RECORD_CHECKS,
    JobSpec,
    SamplingParams,
)

_BIG = BIG


#: The stage names, in order (``stage_timeouts_s`` keys, the node's stage pools).
STAGE_NAMES = tuple(s.value for s in STAGES)
_JOB_STATES = tuple(s.value for s in JobState)
_POSITIVE_S = Num(0.0, 1e9, lo_open=True)
JOB_SPEC_META = Dict(Str(64), Scalar(), max_len=64, max_packed_bytes=MAX_META_BYTES)
_TOP_K = Int(-1, 1 << 24)


def _top_k(v: Any, path: str) -> Any:
    """``top_k``: -1 (off) or a positive number of tokens; 0 samples from nothing."""
    if _TOP_K(v, path) == 0:
        raise _bad(path, "must be -1 (off) or positive, got 0")
    return v


ANNOTATIONS[_top_k] = int
GRAMMAR[_top_k] = ("int", {"lo": -1, "hi": 1 << 24})

SAMPLING = Record({
    "max_tokens": Opt(Int(1, 1 << 24)),
    "temperature": Opt(Num(0.0, 1e6)),
    "top_p": Opt(Num(0.0, 1.0, lo_open=True)),
    "top_k": Opt(_top_k),
    "seed": Opt(Int(-_BIG, _BIG)),
    "stop_token_ids": Opt(List(Int(0, (1 << 31) - 1), 4096)),
    "ignore_eos": Opt(Bool()),
    "top_logprobs": Opt(Int(0, MAX_TOP_LOGPROBS)),
    "stop": Opt(List(Str(MAX_STOP_CHARS), MAX_STOP_STRINGS)),
    # Shapes here; "exactly one of them" where the record is built (SamplingParams refuses it, named).
    "structured": Opt(Record({
        "json": Opt(Dict(Str(256), ANY, max_packed_bytes=MAX_STRUCTURED_BYTES)),
        "json_object": Opt(Bool()),
        "regex": Opt(Str(MAX_STRUCTURED_CHARS)),
        "choice": Opt(List(Str(MAX_STOP_CHARS), MAX_STRUCTURED_CHOICES)),
        "grammar": Opt(Str(MAX_STRUCTURED_CHARS)),
    })),
}, cls=SamplingParams, build=SamplingParams.from_given)

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
}, cls=JobSpec)
RECORD_CHECKS[SamplingParams] = SAMPLING
RECORD_CHECKS[JobSpec] = JOB_SPEC

JOB_IDS = List(Str())
#: Seconds, above zero (a timeout).
POSITIVE_S = _POSITIVE_S
#: A job state's name (``job_stage`` updates, ``job_done`` ends).
JOB_STATE = Str(32, choices=_JOB_STATES)
STAGE_STATS = Dict(Str(32), Record({"active": Int(0, 1 << 31), "queued": Int(0, 1 << 31), "limit": Int(0, 1 << 31)}), max_len=8)
TOKEN = Str(256)
#: ``{code, message}`` of a failed call (``generate_reply``, ``weights_updated``).
ERROR = Record({"code": Str(64), "message": Str(64 * 1024, min_len=0)}, strict=False)
#: A node's failures of one kind (task, stage, exception type): how many so far and the latest message.
FAILURE_GROUP = Record({"task": Str(), "stage": Str(64), "type": Str(128), "count": Int(0, _BIG),
                        "sample": Str(1024, min_len=0)}, strict=False)

__all__ = [
    "ANNOTATIONS", "ANY", "BIG", "ERROR", "FAILURE_GROUP", "GRAMMAR", "HTTP_URL", "JOB_IDS", "JOB_SPEC", "JOB_SPEC_META",
    "JOB_STATE", "MAX_JOBS_PER_MESSAGE", "MAX_LISTED_JOBS", "MAX_META_BYTES", "METRIC_SAMPLES", "POSITIVE_S", "RECORD_FIELDS",
    "SAMPLING", "STAGE_NAMES", "STAGE_STATS", "TOKEN", "URL", "Bool", "Check", "Dict", "FieldError", "FieldSpec", "Id",
    "Int", "List", "Num", "Opt", "Record", "Scalar", "Str", "read_by",
]
