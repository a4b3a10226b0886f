"""Messages built from the protocol's own grammar: every field of every op at its bounds and just past them.

The checkers (``prorl_cli/protocol/checks.py``) record what each accepts (``GRAMMAR``: a kind
and its bounds); each op's fields are its header class's (``prorl_cli/protocol/headers.py``). From it, :func:`edge_values` gives, for
one field, values at each bound and one step past it, the empty and the
oversized, unicode and control characters, wrong types and nested
containers, and, for URLs, addresses that pass a prefix check but name no
host. :func:`variants` puts each of them, one field at a time (nested record
fields included), into the op's valid sample (``prorl_cli/testing/samples.py``),
and :func:`values` is the same grammar as a hypothesis strategy, for
messages with several bad fields at once.

Used by ``tests/chaos/test_grammar_fuzz.py`` against a live broker, node and
bridge: whatever arrives, each server answers what has a request id and
keeps serving.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

from prorl_cli import protocol as P
from prorl_cli.protocol.checks import GRAMMAR, Check, Opt
from prorl_cli.protocol.framing import INT_MAX, INT_MIN
from prorl_cli.protocol.headers import OP_SCHEMAS
from prorl_cli.testing.samples import RELEASE, STOP, TO_BRIDGE, TO_NODE, VALID

#: A valid sample of every op, whoever sends it (the broker's input, then a node's and a bridge's).
SAMPLES: dict[P.Op, tuple[dict[str, Any], list[bytes]]] = {
    **TO_NODE, **TO_BRIDGE, **VALID, P.Op.STOP: STOP, P.Op.RELEASE: RELEASE,
    P.Op.SHUTDOWN: ({"rid": 1}, []),
}

#: Lists longer than this are not grown one past their limit (a million small items is a slow test, not a new case).
MAX_GROWN_LIST = 5000
#: Values of the wrong type for any field.
WRONG_TYPES: list[Any] = [None, True, 0, -1, 1.5, "", "x", [], [None], {}, {"k": []}, b"\x00\xff", [[[[]]]]]
#: Strings that trip naive handling: control characters, bidi overrides, surrogates' neighbours, paths, format specs.
ODD_STRINGS = ["\x00", "a\x00b", "\n", " ", "\u202e", "🙂", "é" * 3, "../../etc/passwd", "/", "%s%n{0}", "\\", "a b"]
#: Addresses that start with ``http://`` or ``https://`` but are not usable URLs, and others that are.
URLS = ["http://", "https://", "https:///", "http:///v1", "http://:80", "http://host:99999", "http://host:-1",
        "http://host:port", "http://[::1", "http://ho st", "http://host\x00", "http://é.example/v1", "HTTP://x",
        "ftp://host", "http:/host", "http://127.0.0.1:1/v1", "https://[::1]:9/v1", "http://" + "a" * 2100]


def _clamp_ints(values: list[Any]) -> list[Any]:
    return [v for v in values if not (isinstance(v, int) and not isinstance(v, bool)) or INT_MIN <= v <= INT_MAX]


def edge_values(check: Check, depth: int = 0) -> list[Any]:
    """Values for a field checked by ``check``: at and past its bounds, odd ones and wrong types."""
    kind, b = GRAMMAR.get(check, ("any", {}))
    out: list[Any] = []
    if kind == "str":
        lo, hi, choices = b["min_len"], b["max_len"], b["choices"]
        out += ["x" * lo, "x" * max(lo - 1, 0), "é" * min(hi, 70_000), "x" * (hi + 1), *ODD_STRINGS]
        if choices:
            first = sorted(choices)[0]
            out += [first, first.upper(), first + " ", first + "\x00"]
    elif kind == "int":
        lo, hi = b["lo"], b["hi"]
        out += _clamp_ints([lo, hi, lo - 1, hi + 1, 0, -1, 1, INT_MIN, INT_MAX, (1 << 63) - 1, 1.0 * lo, str(lo)])
    elif kind == "num":
        lo, hi = float(b["lo"]), float(b["hi"])
        out += [lo, hi, math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf), lo - 1, hi + 1, math.nan, math.inf,
                -math.inf, -0.0, 5e-324, 1.7e308, INT_MAX, INT_MIN, "1.0"]
    elif kind == "bool":
        out += [True, False, 0, 1, "true"]
    elif kind == "one_of":
        for sub in b["checks"]:
            out += edge_values(sub, depth)
    elif kind == "url":
        out += URLS
    elif kind == "list":
        item, hi = b["item"], b["max_len"]
        sample = _valid_value(item)
        out += [[], [sample], [sample, sample]]
        if hi <= MAX_GROWN_LIST:
            out += [[sample] * hi, [sample] * (hi + 1)]
        if depth < 2:
            out += [[v] for v in edge_values(item, depth + 1)[:12]]
    elif kind == "dict":
        key, value, hi = b["key"], b["value"], b["max_len"]
        out += [{}, {1: 2}, {"": 1}, {"k" * 300: 1}, {str(i): 1 for i in range(hi + 1)}]
        if depth < 2:
            out += [{"k": v} for v in edge_values(value, depth + 1)[:12]]
            out += [{k: _valid_value(value)} for k in edge_values(key, depth + 1)[:12] if isinstance(k, str | int | float | bytes)]
    elif kind == "record":
        out += [{}, {"unknown_field": 1}, {"a": {"b": {"c": [1]}}}]
    elif kind == "metric":
        out += [["m", [], 1.0], ["m", [], math.nan], ["", [], 1], ["m", ["x"] * 17, 1], ["m", [], 1, [-1]],
                ["m", [], 1, [1] * 65], ["m"], [1, 2, 3, 4, 5]]
    else:
        out += [[1, "a", None], {"job_id": ["x"]}, "x" * 70_000]
    return out + WRONG_TYPES


def _valid_value(check: Check) -> Any:
    """A value ``check`` accepts, for lists that must hold something before their limit is passed."""
    kind, b = GRAMMAR.get(check, ("any", {}))
    if kind == "str":
        return sorted(b["choices"])[0] if b["choices"] else "x" * max(b["min_len"], 1)
    if kind == "int":
        return max(b["lo"], min(b["hi"], 1))
    if kind == "num":
        return min(float(b["hi"]), max(float(b["lo"]), 1.0))
    if kind == "bool":
        return True
    if kind == "record":
        return {name: _valid_value(spec.check if isinstance(spec, Opt) else spec)
                for name, spec in b["fields"].items() if not isinstance(spec, Opt)}
    if kind == "list":
        return []
    if kind == "dict":
        return {}
    if kind == "one_of":
        return _valid_value(b["checks"][0])
    if kind == "url":
        return "http://127.0.0.1:9/v1"
    return "x"


def _fields(check_fields: dict[str, Any], prefix: tuple[Any, ...], base: Any) -> Iterator[tuple[tuple[Any, ...], Check]]:
    """(path, checker) of every field of a record, and of the records nested in it where the sample has them."""
    for name, spec in check_fields.items():
        check = spec.check if isinstance(spec, Opt) else spec
        path = (*prefix, name)
        yield path, check
        kind, b = GRAMMAR.get(check, ("any", {}))
        value = base.get(name) if isinstance(base, dict) else None
        if kind == "record" and isinstance(value, dict):
            yield from _fields(b["fields"], path, value)
        elif kind == "list" and isinstance(value, list) and value and GRAMMAR.get(b["item"], ("",))[0] == "record":
            yield from _fields(GRAMMAR[b["item"]][1]["fields"], (*path, 0), value[0])


def _put(header: dict[str, Any], path: tuple[Any, ...], value: Any, delete: bool) -> dict[str, Any]:
    out = copy.deepcopy(header)
    cur: Any = out
    for step in path[:-1]:
        cur = cur[step]
    if delete:
        cur.pop(path[-1], None)
    else:
        cur[path[-1]] = value
    return out


def variants(op: P.Op, sample: tuple[dict[str, Any], list[bytes]] | None = None
             ) -> Iterator[tuple[str, dict[str, Any], list[bytes]]]:
    """(what, header, payload) for ``op``: its valid sample with one field at a time at an edge, or removed."""
    base, payload = sample or SAMPLES[op]
    schema = OP_SCHEMAS[op]
    for path, check in _fields(schema.fields, (), base):
        where = ".".join(str(p) for p in path)
        yield f"{op.value} {where} removed", {"v": P.PROTOCOL_VERSION, "op": op.value, **_put(base, path, None, True)}, list(payload)
        for value in edge_values(check):
            header = {"v": P.PROTOCOL_VERSION, "op": op.value, **_put(base, path, value, False)}
            yield f"{op.value} {where}={_short(value)}", header, list(payload)
    yield f"{op.value} extra payload frame", {"v": P.PROTOCOL_VERSION, "op": op.value, **base}, [*payload, b"\xc1"]
    if payload:
        yield f"{op.value} no payload", {"v": P.PROTOCOL_VERSION, "op": op.value, **base}, []


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def values(check: Check) -> Any:
    """A hypothesis strategy over :func:`edge_values` and well-formed values of ``check``."""
    from hypothesis import strategies as st

    return st.sampled_from([*edge_values(check), _valid_value(check)])


def headers(op: P.Op) -> Any:
    """A hypothesis strategy: ``op``'s valid sample with any number of its top-level fields at edges."""
    from hypothesis import strategies as st

    base, _ = SAMPLES[op]
    fields = OP_SCHEMAS[op].fields
    per_field = {name: st.one_of(st.just(base.get(name)), values(spec.check if isinstance(spec, Opt) else spec))
                 for name, spec in fields.items()}
    return st.fixed_dictionaries(per_field).map(
        lambda h: {"v": P.PROTOCOL_VERSION, "op": op.value, **{k: v for k, v in h.items() if v is not None}})
