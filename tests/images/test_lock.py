"""The cache's key lock across real processes: who holds it, as those waiting see it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.images import cache

# A holder that locks first and writes its id only when told: the gap a waiter can fall into.
_HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("locked", flush=True)
for line in sys.stdin:
    if line.strip() == "write":
        os.pwrite(fd, b"pid 4242 on holder-host", 0)
        print("written", flush=True)
    elif line.strip() == "release":
        break
os.close(fd)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    lock = tmp_path / "key.lock"
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline() == "locked\n"
    yield lock, proc
    proc.kill()
    proc.wait(10)


def _tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def test_waiter_arriving_before_the_holder_writes_its_id_still_names_it(holder: tuple[Path, subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    lock, proc = holder
    real_sleep = time.sleep
    wrote = threading.Event()

    def sleep(seconds: float) -> None:
        # The waiter read an empty file and is about to look again: let the holder write now.
        if not wrote.is_set():
            _tell(proc, "write")
            assert proc.stdout is not None and proc.stdout.readline() == "written\n"
            wrote.set()
        real_sleep(seconds)

    monkeypatch.setattr(cache.time, "sleep", sleep)
    seen: list[str] = []

    def on_wait(who: str) -> None:
        seen.append(who)
        _tell(proc, "release")

    with cache.file_lock(lock, on_wait):
        assert lock.read_text() == cache.holder_id(), "the new holder writes its own id"
    assert wrote.is_set(), "the waiter found the file empty first"
    assert seen == ["pid 4242 on holder-host"]


def test_a_holder_that_never_writes_is_another_process(holder: tuple[Path, subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    lock, proc = holder
    monkeypatch.setattr(cache, "_HOLDER_ID_WAIT_S", 0.05)
    seen: list[str] = []

    def on_wait(who: str) -> None:
        seen.append(who)
        _tell(proc, "release")

    with cache.file_lock(lock, on_wait) as waited_s:
        assert waited_s >= 0
    assert seen == ["another process"]
