"""Malformed messages for the broker, and an honest client to run beside them.

Used by ``tests/chaos/test_fuzz_broker.py`` (short, hypothesis-driven) and
``scripts/chaos/fuzz_broker.py`` (10,000+ frames, seeded). Every message
starts from a valid header of some op (``prorl_cli/testing/samples.py``) and gets
one or more mutations: a leaf replaced by a value of another type or out of
range (NaN, infinities, huge ints, long strings), a field removed, an extra
or missing payload frame, a garbage frame, a wrong version.
"""

from __future__ import annotations

import copy
import math
import random
import time
from pathlib import Path
from typing import Any

import msgpack

from prorl_cli import protocol as P
from prorl_cli.testing.harness import bare_dealer
from prorl_cli.testing.samples import VALID

# Ops the fuzzer sends: everything but ``stop`` and ``hold`` (valid ones would end or pause the honest run).
FUZZ_OPS = [op for op in VALID if op not in (P.Op.HOLD,)]
# Ops that may name the honest jobs: reports from the wrong node must be ignored.
SPOOF_OPS = {P.Op.JOB_DONE, P.Op.JOB_STAGE, P.Op.REGISTER, P.Op.GENERATE, P.Op.GENERATE_CANCEL}


def _junk(rng: random.Random) -> Any:
    return rng.choice([
        math.nan, math.inf, -math.inf, -1, 0, 1 << 70, -(1 << 70), 1e308, True, None, "", "x" * rng.choice([1, 300, 70_000]),
        [], [1, "a", None], {}, {"a": [1]}, {1: 2}, b"\x00\xff", [[[[]]]], {"job_id": ["x"]}, 3.5,
    ])


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*path, i))
    return out


def _set(header: dict[str, Any], path: tuple[Any, ...], value: Any, delete: bool = False) -> None:
    target: Any = header
    for k in path[:-1]:
        target = target[k]
    if delete and isinstance(target, dict):
        target.pop(path[-1], None)
    else:
        target[path[-1]] = value


def malformed(rng: random.Random, honest_ids: list[str]) -> list[bytes]:
    """One malformed (or, sometimes, valid but foreign) message: its frames, header first."""
    kind = rng.random()
    if kind < 0.05:
        return [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))]
    if kind < 0.08:
        return []
    op = rng.choice(FUZZ_OPS)
    header, payload = copy.deepcopy(VALID[op][0]), list(VALID[op][1])
    header = {"v": P.PROTOCOL_VERSION, "op": op.value, **header}
    if op in SPOOF_OPS and honest_ids and rng.random() < 0.5:
        for path in _paths(header):
            if path[-1] == "job_id":
                _set(header, path, rng.choice(honest_ids))
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        paths = _paths(header)
        path = rng.choice(paths)
        if path == ("op",) and rng.random() < 0.7:
            continue  # mostly keep the op, so the schemas get exercised
        _set(header, path, _junk(rng), delete=rng.random() < 0.2)
    r = rng.random()
    if r < 0.1:
        payload.append(b"\xc1junk")
    elif r < 0.2 and payload:
        payload.pop()
    elif r < 0.25:
        header["v"] = rng.choice([0, 2, "1", None])
    try:
        head = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        head = b"\xc1"
    return [head, *payload]


class Peer:
    """A DEALER that sends fuzz and throws away whatever comes back."""

    def __init__(self, address: str, deployment_dir: Path, register_as: str | None = None) -> None:
        self.sock = bare_dealer(address, deployment_dir)
        if register_as is not None:
            self.sock.send_multipart(P.encode({"op": "register", "rid": 0, "node_id": register_as, "host": "fuzz",
                                               "pid": 1, "credit": 1, "tasks": ["zzz-no-such-task"]}))

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def drain(self) -> int:
        n = 0
        while self.sock.poll(0):
            self.sock.recv_multipart()
            n += 1
        return n

    def close(self) -> None:
        self.sock.close(0)


class HonestClient:
    """Submits jobs over a bare socket and counts every result pushed for each."""

    def __init__(self, address: str, deployment_dir: Path, prefix: str) -> None:
        self.sock = bare_dealer(address, deployment_dir)
        self.prefix = prefix
        self.ids: list[str] = []
        self.results: dict[str, list[str]] = {}

    def submit(self, n: int, instance: Any) -> None:
        ids = [f"{self.prefix}-{len(self.ids) + i}" for i in range(n)]
        jobs = [{"job_id": j, "task": "test", "max_attempts": 20, "timeout_s": 120.0} for j in ids]
        self.sock.send_multipart(P.encode({"op": "submit", "rid": f"s{len(self.ids)}", "jobs": jobs},
                                          [P.pack_obj(instance)] * n))
        self.ids += ids

    def pump(self, timeout_ms: int = 0) -> None:
        while self.sock.poll(timeout_ms):
            frames = self.sock.recv_multipart()
            h = msgpack.unpackb(frames[0], raw=False)
            if h.get("op") == "reply" and not h.get("ok"):
                raise AssertionError(f"honest request refused: {h}")
            if h.get("op") == "result":
                for info, _ in zip(h["jobs"], P.job_items(P.Op.RESULT, frames[1:]), strict=True):
                    self.results.setdefault(info["job_id"], []).append(info["state"])
            timeout_ms = 0

    def wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.results) < len(self.ids) and time.monotonic() < deadline:
            self.pump(200)

    def close(self) -> None:
        self.sock.close(0)
