"""LocalStack.start_broker against an earlier broker's rendezvous file (no processes: the waiting alone)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import prorl_cli.embedded as embedded
from prorl_cli.embedded import LocalStack
from prorl_cli.rendezvous import Rendezvous


class _Proc:
    pid = 4242

    def poll(self) -> int | None:
        return None


def test_a_stale_rendezvous_file_is_read_again_after_a_pause_not_in_a_busy_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file of a broker killed before (another pid) is there at once: each read of it is followed by a
    pause until the new broker has written its own."""
    stack = LocalStack(tmp_path / "home", "stale")
    events: list[str] = []
    reads = iter([1111, 1111, 1111, _Proc.pid])

    def read(deployment_dir: Path, timeout_s: float) -> Rendezvous:
        events.append("read")
        return Rendezvous(address="tcp://127.0.0.1:1", deployment="stale", host="h", pid=next(reads), started_at=0.0)

    def spawn(name: str, *args: str) -> Any:
        return _Proc()

    monkeypatch.setattr(embedded, "wait_rendezvous", read)
    monkeypatch.setattr(stack, "spawn", spawn)
    monkeypatch.setattr(time, "sleep", lambda s: events.append("sleep"))
    assert stack.start_broker(timeout_s=30).pid == _Proc.pid
    assert events == ["read", "sleep"] * 3 + ["read"]
