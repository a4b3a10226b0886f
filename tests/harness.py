"""Real prorl deployments for tests and benchmarks: :class:`prorl_cli.embedded.LocalStack`
with short heartbeats and small pools, so failures are detected in test time."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.embedded import LocalStack

REPO = Path(__file__).resolve().parent.parent


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


DEFAULT_TEST_CONFIG: dict[str, Any] = {
    "broker": {"heartbeat_interval_s": 0.25, "heartbeat_liveness": 8},
    "node": {"n_init": 4, "n_run": 8, "n_eval": 4, "stop_grace_s": 3.0},
    "jobs": {"timeout_s": 60.0},
    "log_level": "INFO",
}


class Deployment(LocalStack):
    """A test deployment under ``home``; ``config`` is merged over the test defaults."""

    def __init__(self, home: Path, name: str = "test", config: dict[str, Any] | None = None) -> None:
        super().__init__(home, name, _merge(DEFAULT_TEST_CONFIG, config or {}))


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


def need_module(module: str, extra: str) -> None:
    """Skip the calling test, naming the extra to install, when ``module`` is not importable."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'prorl[{extra}]'; scripts/install.sh does it)")
