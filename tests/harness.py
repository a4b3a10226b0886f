"""Real prorl deployments for tests and benchmarks: :class:`prorl_cli.embedded.LocalStack`
with short heartbeats and small pools, so failures are detected in test time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
