"""Real prorl deployments for tests and benchmarks: :class:`prorl_cli.embedded.LocalStack`
with short heartbeats and small pools, so failures are detected in test time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prorl_cli.embedded import LocalStack
from prorl_cli.node.registry import ENV_HANDLER_PATHS

#: The test handlers as a handler path entry (``--handlers``, ``node.handler_paths``): a package name,
#: so it names them wherever prorl is installed.
TEST_HANDLERS = "prorl_cli.testing.handlers"


def merge_config(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, mappings key by key (other values replace)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


DEFAULT_TEST_CONFIG: dict[str, Any] = {
    "broker": {"heartbeat_interval_s": 0.25, "heartbeat_liveness": 8},
    "node": {"n_init": 4, "n_run": 8, "n_eval": 4, "stop_grace_s": 3.0},
    "jobs": {"timeout_s": 60.0},
    "log_level": "INFO",
}


class Deployment(LocalStack):
    """A test deployment under ``home``; ``config`` is merged over the test defaults.

    Its nodes serve the test handlers besides the built-in ones (through
    ``PRORL_HANDLER_PATHS``, so ``--handlers`` given to a node adds to them).
    """

    def __init__(self, home: Path, name: str = "test", config: dict[str, Any] | None = None) -> None:
        super().__init__(home, name, merge_config(DEFAULT_TEST_CONFIG, config or {}))

    def env(self) -> dict[str, str]:
        env = super().env()
        extra = [p for p in env.get(ENV_HANDLER_PATHS, "").split(os.pathsep) if p]
        if TEST_HANDLERS not in extra:
            env[ENV_HANDLER_PATHS] = os.pathsep.join([TEST_HANDLERS, *extra])
        return env


def bare_dealer(address: str, deployment_dir: Path | None = None, *, unbounded: bool = False, ctx: Any = None) -> Any:
    """A raw DEALER socket to the broker (for scripts and tests that speak the protocol themselves).

    ``deployment_dir``: where the deployment's CURVE keys are (every broker but a ``curve: off`` one wants them).
    ``unbounded``: no high-water marks, so a load generator never blocks or drops on its own side.
    """
    import zmq

    from prorl_cli.security import secure_peer

    sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if unbounded:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    if deployment_dir is not None:
        secure_peer(sock, deployment_dir)
    sock.connect(address)
    return sock


def next_message(sock: Any, op: str = "reply", rid: Any = None, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """The next header of ``op`` (and, given, ``rid``) on a raw socket from :func:`bare_dealer`.

    Whatever else the broker pushes meanwhile is read past: a socket registered as a node gets the broker's
    liveness heartbeats whenever they fall due, and assignments, so the next frame is not always the answer.
    """
    import time

    import msgpack

    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not sock.poll(left_ms):
            raise TimeoutError(f"no {op} (rid {rid!r}) from the broker within {timeout_s} s")
        header: dict[str, Any] = msgpack.unpackb(sock.recv_multipart()[0], raw=False, strict_map_key=False)
        if header.get("op") == op and (rid is None or header.get("rid") == rid):
            return header


def fixed_port() -> int:
    """A free TCP port below the kernel's ephemeral range, for a broker that must bind the same port again
    after a restart (ports the kernel hands out, to ``bind(0)`` or outgoing connections, come from that range)."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # the Linux default, where the file cannot be read
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")
