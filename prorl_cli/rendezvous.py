"""The rendezvous file: how every peer finds a deployment's broker.

``$PRORL_HOME/<deployment>/broker.json`` (mode 0600) holds the broker's
address and, when it listens beyond loopback, its CURVE public key.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prorl_cli.exceptions import RendezvousError

RENDEZVOUS_NAME = "broker.json"


@dataclass
class Rendezvous:
    address: str
    deployment: str
    host: str
    pid: int
    started_at: float
    curve_public_key: str | None = None


def rendezvous_path(deployment_dir: Path) -> Path:
    return deployment_dir / RENDEZVOUS_NAME


def write_rendezvous(deployment_dir: Path, info: Rendezvous) -> Path:
    """Write the file atomically with mode 0600."""
    deployment_dir.mkdir(parents=True, exist_ok=True)
    path = rendezvous_path(deployment_dir)
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(info), f)
    os.replace(tmp, path)
    return path


def read_rendezvous(deployment_dir: Path) -> Rendezvous:
    path = rendezvous_path(deployment_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise RendezvousError(
            f"{path}: no rendezvous file; is the broker of deployment {deployment_dir.name!r} running?"
        ) from e
    except (OSError, ValueError) as e:
        raise RendezvousError(f"{path}: unreadable rendezvous file: {e}") from e
    try:
        return Rendezvous(**data)
    except TypeError as e:
        raise RendezvousError(f"{path}: malformed rendezvous file: {e}") from e


def wait_rendezvous(deployment_dir: Path, timeout_s: float) -> Rendezvous:
    """Poll for the rendezvous file (it appears once the broker has bound its socket)."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.02
    while True:
        try:
            return read_rendezvous(deployment_dir)
        except RendezvousError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, 0.5)


def remove_rendezvous(deployment_dir: Path, pid: int) -> None:
    """Remove the file if it is still ours (a newer broker may have replaced it)."""
    path = rendezvous_path(deployment_dir)
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        return
