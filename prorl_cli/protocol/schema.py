"""The wire schema: every op's header fields, and every nested record, checked for type and range in one place.

A tiny DSL: each checker takes ``(value, path)`` and returns the value, typed, or raises
:class:`ProtocolError` naming the path. Header fields not named here are ignored (newer peers may
send more); nested records named here are strict. A :func:`Record` given a class builds it from
the checked fields, so checking a header (:func:`parse`) is also what types it: its op's class in
:mod:`prorl_cli.protocol.headers`, with :class:`~prorl_cli.protocol.records.JobSpec` and
:class:`~prorl_cli.protocol.records.SamplingParams` inside. Nothing downstream checks those fields again.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from prorl_cli.exceptions import ProtocolError
from prorl_cli.protocol import headers as H
from prorl_cli.protocol.framing import (
    MAX_ID_CHARS,
    RID_MAX,
    RID_MIN,
    STAGES,
    ErrorCode,
    JobState,
    Op,
)
from prorl_cli.protocol.records import (
    RECORD_CHECKS,
    BackendStatus,
    JobSpec,
    SamplingParams,
    StatusReport,
)

MAX_JOBS_PER_MESSAGE = 100_000
MAX_META_BYTES = 4096
#: Most job ids one ``list_jobs`` reply carries; the reply's ``next`` pages on (a header stays far below MAX_HEADER_BYTES).
MAX_LISTED_JOBS = 10_000
_BIG = 1 << 62

Check = Callable[[Any, str], Any]

#: The Python type each checker stands for (what a typed header's field is annotated with).
ANNOTATIONS: dict[Check, Any] = {}


#: What each checker accepts, for generators (``prorl_cli/testing/grammar.py``): a kind and its bounds.
GRAMMAR: dict[Check, tuple[str, dict[str, Any]]] = {}


def _typed(check: Check, annotation: Any) -> Check:
    ANNOTATIONS[check] = annotation
    return check


def _grammar(check: Check, kind: str, **bounds: Any) -> Check:
    GRAMMAR[check] = (kind, bounds)
    return check


class FieldError(ProtocolError):
    """A :class:`ProtocolError` about one field: ``path`` (where) and ``detail`` (what), joined in its message.

    Checkers name a value by the path their caller gave; containers pass their items an empty path
    and put the item's place in front only when it fails, so a valid message builds no path strings.
    """

    def __init__(self, code: str, path: str, detail: str) -> None:
        super().__init__(code, f"{path!r} {detail}")
        self.path, self.detail = path, detail


def _bad(path: str, message: str, code: ErrorCode | None = None) -> FieldError:
    return FieldError((code or ErrorCode.BAD_FIELD).value, path, message)


def _join(path: str, sub: str) -> str:
    """``path`` followed by a relative ``sub`` path (``name``, ``[3]``, ``name[3].x`` or empty)."""
    if not sub:
        return path
    if not path or sub.startswith("["):
        return path + sub
    return f"{path}.{sub}"


def _within(path: str, sub: str, e: FieldError) -> FieldError:
    """``e``, raised for an item at ``sub`` of the value at ``path``, with its full path."""
    return FieldError(e.code, _join(path, _join(sub, e.path)), e.detail)


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

    return _grammar(_typed(check, str), "str", min_len=min_len, max_len=max_len, choices=choices)


def Int(lo: int = 0, hi: int = _BIG) -> Check:
    """An integer in ``[lo, hi]`` (booleans are not integers here)."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, int) or isinstance(v, bool):
            raise _bad(path, f"must be an integer, got {_type_name(v)}")
        if not lo <= v <= hi:
            raise _bad(path, f"must be in [{lo}, {hi}], got {v}")
        return v

    return _grammar(_typed(check, int), "int", lo=lo, hi=hi)


def Num(lo: float = 0.0, hi: float = float(_BIG), *, lo_open: bool = False) -> Check:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); NaN and infinities are refused."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise _bad(path, f"must be a number, got {_type_name(v)}")
        # Only a float can be NaN or infinite; an int compares exactly with the bounds, however large
        # (``math.isfinite`` and ``:g`` convert it to a float first, an OverflowError past 1e308).
        if isinstance(v, float) and not math.isfinite(v):
            raise _bad(path, f"must be a finite number, got {v}")
        if v > hi or v < lo or (lo_open and v == lo):
            got = f"{v:g}" if isinstance(v, float) else str(v)
            raise _bad(path, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {got}")
        return v

    return _grammar(_typed(check, float), "num", lo=lo, hi=hi, lo_open=lo_open)


def Bool() -> Check:
    def check(v: Any, path: str) -> Any:
        if not isinstance(v, bool):
            raise _bad(path, f"must be a boolean, got {_type_name(v)}")
        return v

    return _grammar(_typed(check, bool), "bool")


def Id() -> Check:
    """A request id: a string of at most ``MAX_ID_CHARS`` characters, or any msgpack integer (int64 or uint64)."""
    as_str, as_int = Str(MAX_ID_CHARS, min_len=0), Int(RID_MIN, RID_MAX)

    def check(v: Any, path: str) -> Any:
        return as_str(v, path) if isinstance(v, str) else as_int(v, path)

    return _grammar(_typed(check, str | int), "one_of", checks=(as_str, as_int))


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

    return _grammar(_typed(check, str | int | float | bool | None), "one_of", checks=(s, n, Bool()))


def List(item: Check, max_len: int = MAX_JOBS_PER_MESSAGE) -> Check:
    """A list of at most ``max_len`` items, each checked by ``item`` (and built, when ``item`` builds records)."""
    builds = item in _BUILDERS

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, list):
            raise _bad(path, f"must be a list, got {_type_name(v)}")
        if len(v) > max_len:
            raise _bad(path, f"has {len(v)} items; the limit is {max_len}")
        if item is _ANY:
            return v
        i = 0
        try:
            if builds:
                out = []
                for i, x in enumerate(v):  # noqa: B007 (``i`` names the failing item below)
                    out.append(item(x, ""))
                return out
            for i, x in enumerate(v):  # noqa: B007
                item(x, "")
        except FieldError as e:
            raise _within(path, f"[{i}]", e) from None
        return v

    if builds:
        _BUILDERS.add(check)
    _grammar(check, "list", item=item, max_len=max_len)
    return _typed(check, list[ANNOTATIONS.get(item, Any)])  # type: ignore[misc]


def Dict(key: Check, value: Check, max_len: int = 64, max_packed_bytes: int | None = None) -> Check:
    """A map of at most ``max_len`` entries with checked keys and values."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, dict):
            raise _bad(path, f"must be a map, got {_type_name(v)}")
        if len(v) > max_len:
            raise _bad(path, f"has {len(v)} entries; the limit is {max_len}")
        for k, x in v.items():
            try:
                key(k, "")
            except FieldError as e:
                raise _within(path, "key", e) from None
            try:
                value(x, "")
            except FieldError as e:
                raise _within(path, f"[{k!r}]", e) from None
        if max_packed_bytes is not None and len(msgpack.packb(v, use_bin_type=True)) > max_packed_bytes:
            raise _bad(path, f"packs to more than {max_packed_bytes} bytes")
        return v

    _grammar(check, "dict", key=key, value=value, max_len=max_len)
    return _typed(check, dict[ANNOTATIONS.get(key, Any), ANNOTATIONS.get(value, Any)])  # type: ignore[misc]


@dataclass(frozen=True)
class Opt:
    """A field that may be absent or null."""

    check: Check


FieldSpec = Check | Opt


def Record(
    fields: dict[str, FieldSpec], *, strict: bool = True, cls: type | None = None, build: Callable[..., Any] | None = None
) -> Check:
    """A map with named fields; ``strict`` refuses fields not named.

    With ``cls``, the checked fields (those given and not null) build a ``cls`` (by calling ``build``,
    ``cls`` itself by default), the rest keep its defaults; without, the map itself is the value.
    """
    make = build or cls
    specs = [(name, spec.check if isinstance(spec, Opt) else spec, isinstance(spec, Opt)) for name, spec in fields.items()]
    names = frozenset(fields)

    def check(v: Any, path: str) -> Any:
        if type(v) is not dict:
            raise _bad(path, f"must be a map, got {_type_name(v)}")
        if strict and not v.keys() <= names:
            raise _bad(path, f"has unknown field(s) {sorted(str(k) for k in v if k not in names)}")
        out = {}
        name = ""
        try:
            for name, spec, optional in specs:
                value = v.get(name)
                if value is None:
                    if optional:
                        continue
                    if name not in v:
                        raise _bad("", "is missing", ErrorCode.MISSING_FIELD)
                out[name] = spec(value, "")
        except FieldError as e:
            raise _within(path, name, e) from None
        return v if make is None else make(**out)

    RECORD_FIELDS[check] = fields
    _grammar(check, "record", fields=fields, strict=strict)
    if cls is None:
        return _typed(check, dict[str, Any])
    _BUILDERS.add(check)
    return _typed(check, cls)


#: Checkers whose value is built (a record, or a list of them) rather than the map as read.
_BUILDERS: set[Check] = set()
#: The fields of each :func:`Record` checker (what the typed classes are held to).
RECORD_FIELDS: dict[Check, dict[str, FieldSpec]] = {}


def _any(v: Any, path: str) -> Any:
    """Anything: the receiver reads each item itself (``assign``'s jobs, one by one)."""
    return v


_ANY = _grammar(_typed(_any, Any), "any")


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

_JOB_IDS = List(Str())
_UPDATE = Record({"job_id": Str(), "attempt": Int(1, 1_000_000), "stage": Str(32, choices=_JOB_STATES)},
                 strict=False, cls=H.StageUpdate)
_DONE = Record({"job_id": Str(), "attempt": Int(1, 1_000_000), "state": Str(32, choices=_JOB_STATES)},
               strict=False, cls=H.JobEnd)
_STAGE_STATS = Dict(Str(32), Record({"active": Int(0, 1 << 31), "queued": Int(0, 1 << 31), "limit": Int(0, 1 << 31)}), max_len=8)
_TOKEN = Str(256)
_URL = Str(2048)


def _http_url(v: Any, path: str) -> Any:
    """An ``http://`` or ``https://`` address with a host (an HTTP backend the broker routes generate calls to).

    Parsed here, by ``urllib.parse``, so that no receiver slices a URL the check let through
    (``http://``, ``https:///``, a bad port, whitespace).
    """
    text = _URL(v, path)
    if not text.startswith(("http://", "https://")):
        raise _bad(path, f"must start with http:// or https://, got {v!r}")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise _bad(path, f"must not contain whitespace or control characters, got {v!r}")
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 (raises ValueError on a port that is not 0-65535)
    except ValueError as e:
        raise _bad(path, f"not a URL ({e}): {v!r}") from None
    if not parts.hostname:
        raise _bad(path, f"names no host: {v!r}")
    return v


ANNOTATIONS[_http_url] = str
GRAMMAR[_http_url] = ("url", {"max_len": 2048})


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


ANNOTATIONS[_metric_sample] = list[Any]
GRAMMAR[_metric_sample] = ("metric", {})

#: Heartbeat ``metrics`` of a node or bridge (cumulative; names in ``prorl_cli/observe/metrics.py``).
METRIC_SAMPLES = List(_metric_sample, 4096)


#: A node's failures of one kind (task, stage, exception type): how many so far and the latest message.
FAILURE_GROUP = Record({"task": Str(), "stage": Str(64), "type": Str(128), "count": Int(0, _BIG),
                        "sample": Str(1024, min_len=0)}, strict=False)


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
    Op.ADD_LLM_SERVER: OpSchema({**_RID, "url": _http_url, "model": Opt(Str())}),
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
        # Seconds the call spent in the bridge's engine (queued there and generating).
        "engine_s": Opt(Num(0.0, 1e7)),
        "error": Opt(Record({"code": Str(64), "message": Str(64 * 1024, min_len=0)}, strict=False)),
    }, payload=None),
    Op.GENERATE_DONE: OpSchema({"job_id": Str(), "backend_id": _URL}),
    Op.GENERATE_CANCEL: OpSchema({**_RID, "job_id": Str()}),
    # broker -> node: the node reads each of ``jobs`` itself (one bad record fails that job alone).
    Op.ASSIGN: OpSchema({"jobs": List(_ANY), "timing": Opt(List(_ANY))}, payload="jobs"),
    Op.CANCEL_JOB: OpSchema({"job_ids": _JOB_IDS}),
    Op.GENERATE_HELD: OpSchema({**_RID, "job_id": Str(), "held": Bool()}),
    Op.SHUTDOWN: OpSchema({"rid": Opt(Id())}),
}


#: One checker per op, built once (``parse`` runs on every message the broker reads): it checks and types.
_OP_CHECKS = {op: Record(schema.fields, strict=False, cls=H.HEADERS[op]) for op, schema in OP_SCHEMAS.items()}


def _read_by(cls: Any) -> Check:
    """A record ``cls`` reads itself (``cls.from_wire``: its shape and nested records, not each field's range)."""

    def check(v: Any, path: str) -> Any:
        try:
            return cls.from_wire(v)
        except FieldError:
            raise
        except ProtocolError as e:
            why = e.message.removeprefix(f"{cls.__name__}: ").removeprefix(f"{cls.__name__} ")
            raise _bad(path, f"is not a {cls.__name__}: {why}", ErrorCode(e.code)) from None

    _BUILDERS.add(check)
    return _typed(check, cls)


_STATUS_REPORT = _read_by(StatusReport)
_BACKEND_STATUS = _read_by(BackendStatus)

#: The broker's success replies the client reads, per request op: their fields, checked and typed in one place
#: (:func:`parse_reply`) into the classes of ``headers.REPLIES``. Fields not named here (``op``, ``rid``, ``ok``,
#: ``boot_id``, a newer broker's) are ignored; an optional one may be absent (the client takes it as empty).
REPLY_SCHEMAS: dict[Op, dict[str, FieldSpec]] = {
    Op.SUBMIT: {"accepted": Opt(_JOB_IDS), "existing": Opt(_JOB_IDS)},
    Op.WATCH: {"unknown": Opt(_JOB_IDS)},
    Op.CANCEL: {"states": Opt(Dict(Str(), Str(32), max_len=MAX_JOBS_PER_MESSAGE))},
    Op.LIST_JOBS: {"jobs": Opt(Dict(Str(), Str(32), max_len=MAX_LISTED_JOBS)), "next": Opt(Int(0, _BIG))},
    Op.FORGET: {"forgotten": Opt(_JOB_IDS), "running": Opt(_JOB_IDS), "unknown": Opt(_JOB_IDS)},
    Op.UPDATE_WEIGHTS: {"updated": Opt(List(_URL, 4096)), "skipped": Opt(List(_URL, 4096)),
                        "policy_version": Opt(Int(0, _BIG))},
    Op.STATUS: {"status": _STATUS_REPORT},
    Op.ADD_LLM_SERVER: {"backend": _BACKEND_STATUS},
    Op.CLEAR_LLM_SERVER: {"cleared": List(_URL, 4096)},
    Op.LIST_LLM_SERVERS: {"backends": List(_BACKEND_STATUS, 4096)},
}
_REPLY_CHECKS = {op: Record(fields, strict=False, cls=H.REPLIES[op]) for op, fields in REPLY_SCHEMAS.items()}


def parse_reply(op: Op, header: dict[str, Any]) -> Any:
    """The typed success reply to ``op`` (its class in :data:`~prorl_cli.protocol.headers.REPLIES`), checked.

    ``header`` is a success reply (``ok`` true) as the connection hands it over. Raises
    :class:`ProtocolError` (``bad_field``) naming the op and the field that is malformed.
    """
    try:
        return _REPLY_CHECKS[op](header, "")
    except ProtocolError as e:
        raise ProtocolError(e.code, f"reply to {op.value!r}: field {e.message}") from None


def parse(header: dict[str, Any], n_payload: int | None = None) -> Any:
    """The typed header (its op's class in :mod:`~prorl_cli.protocol.headers`) of ``header``, checked.

    ``header`` is decoded and its envelope checked (:func:`~prorl_cli.protocol.framing.decode_header`);
    every field of its op's schema is checked for type and range, and the payload count when
    ``n_payload`` is given. Raises :class:`ProtocolError` (``missing_field`` / ``bad_field``) naming
    the op and the field.
    """
    op: Op = header["op"]
    schema = OP_SCHEMAS.get(op)
    if schema is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP.value, f"op {op.value!r} has no header schema")
    try:
        typed = _OP_CHECKS[op](header, "")
    except ProtocolError as e:
        raise ProtocolError(e.code, f"op {op.value!r}: field {e.message}") from None
    if n_payload is not None and schema.payload is not None:
        want = len(header["jobs"]) if schema.payload == "jobs" else schema.payload
        if n_payload != want:
            raise ProtocolError(
                ErrorCode.BAD_FIELD.value,
                f"op {op.value!r} carries {n_payload} payload frame(s) but needs {want}"
                + (" (one instance/result frame per item of 'jobs': the job records and frames must pair up)"
                   if schema.payload == "jobs" else ""),
            )
    return typed


def validate(header: dict[str, Any], n_payload: int | None = None) -> None:
    """Check ``header`` as :func:`parse` does, keeping nothing (for callers that only need the verdict)."""
    parse(header, n_payload)
