"""The checker DSL of the wire protocol: each checker takes ``(value, path)`` and returns the value, typed.

A checker raises :class:`FieldError` (a :class:`ProtocolError`) naming the path of what is wrong.
Each one records the Python type it stands for (``ANNOTATIONS``) and what it accepts (``GRAMMAR``:
a kind and its bounds, for ``prorl_cli/testing/grammar.py``). :func:`declared_fields` reads a
dataclass whose fields say ``Annotated[type, check]`` into a :func:`Record`'s fields: that is how
each header class (:mod:`prorl_cli.protocol.headers`) declares its fields and their checks once.
"""

from __future__ import annotations

import dataclasses
import math
import typing
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from prorl_cli.exceptions import ProtocolDeclarationError, ProtocolError
from prorl_cli.protocol.framing import MAX_ID_CHARS, RID_MAX, RID_MIN, ErrorCode

MAX_JOBS_PER_MESSAGE = 100_000
MAX_META_BYTES = 4096
#: Most job ids one ``list_jobs`` reply carries; the reply's ``next`` pages on (a header stays far below MAX_HEADER_BYTES).
MAX_LISTED_JOBS = 10_000
BIG = 1 << 62

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


def Int(lo: int = 0, hi: int = BIG) -> Check:
    """An integer in ``[lo, hi]`` (booleans are not integers here)."""

    def check(v: Any, path: str) -> Any:
        if not isinstance(v, int) or isinstance(v, bool):
            raise _bad(path, f"must be an integer, got {_type_name(v)}")
        if not lo <= v <= hi:
            raise _bad(path, f"must be in [{lo}, {hi}], got {v}")
        return v

    return _grammar(_typed(check, int), "int", lo=lo, hi=hi)


def Num(lo: float = 0.0, hi: float = float(BIG), *, lo_open: bool = False) -> Check:
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
    s, n = Str(max_len, min_len=0), Num(-float(BIG), float(BIG))

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
        if item is ANY:
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


ANY = _grammar(_typed(_any, Any), "any")


URL = Str(2048)


def _http_url(v: Any, path: str) -> Any:
    """An ``http://`` or ``https://`` address with a host (an HTTP backend the broker routes generate calls to).

    Parsed here, by ``urllib.parse``, so that no receiver slices a URL the check let through
    (``http://``, ``https:///``, a bad port, whitespace).
    """
    text = URL(v, path)
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


def read_by(cls: Any) -> Check:
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



#: An ``http://`` or ``https://`` address with a host (``add_llm_server``'s ``url``).
HTTP_URL: Check = _http_url


def _check_of(cls: type, name: str, hint: Any) -> Check:
    """The one checker in the ``Annotated`` metadata of field ``name`` of ``cls``."""
    found = [m for m in getattr(hint, "__metadata__", ()) if callable(m) and m in ANNOTATIONS]
    if len(found) != 1:
        raise ProtocolDeclarationError(
            f"{cls.__name__}.{name} must be declared Annotated[type, check] with exactly one checker of "
            f"prorl_cli.protocol.checks, got {hint!r}")
    check: Check = found[0]
    return check


def declared_fields(cls: type) -> dict[str, FieldSpec]:
    """The :func:`Record` fields that dataclass ``cls`` declares: each field's checker, :class:`Opt` when it has a default.

    Every field must say ``Annotated[type, check]``, and ``type`` must be the Python type ``check``
    stands for (``T | None`` when the field defaults to ``None``): a class cannot be declared without
    its checks, nor with a type its check does not produce. Raises :class:`ProtocolDeclarationError`.
    """
    if not dataclasses.is_dataclass(cls):
        raise ProtocolDeclarationError(f"{cls.__name__} must be a dataclass to declare wire fields")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields: dict[str, FieldSpec] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        check = _check_of(cls, f.name, hints[f.name])
        optional = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        declared, stands_for = hints[f.name].__origin__, ANNOTATIONS[check]
        # An optional field is ``T | None`` (null on the wire means absent) unless its default is not None.
        if declared not in ({stands_for, stands_for | None} if optional else {stands_for}):
            raise ProtocolDeclarationError(
                f"{cls.__name__}.{f.name} is annotated {declared!r} but its check reads a {stands_for!r}")
        fields[f.name] = Opt(check) if optional else check
    return fields


def builds(check: Check) -> bool:
    """Whether ``check`` builds records (a record class, or a list of them) rather than keeping the value as read."""
    return check in _BUILDERS


def record_of(cls: type, *, strict: bool = False) -> Check:
    """The :func:`Record` checker that reads and builds dataclass ``cls`` from its declared fields."""
    return Record(declared_fields(cls), strict=strict, cls=cls)
