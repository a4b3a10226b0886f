"""The cache's key lock across real processes: who holds it, as those waiting see it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.images import cache
from prorl_cli.images.build import Builder
from prorl_cli.images.plan import Plan
from prorl_cli.images.prune import prune
from prorl_cli.images.spec import parse_image

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


def test_prune_makes_lock_files_that_the_other_users_of_a_group_shared_cache_can_open(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o2775)  # a cache shared by a group
    key = "lock-0123456789abcdef"
    old_umask = os.umask(0o022)  # the pruning user's umask: new files 0644
    try:
        c = cache.Cache(root)
        # A build no name resolves to: prune takes its key's lock to remove it.
        c.update_manifest(lambda data: data["builds"].update(
            {key: {"name": "x", "key": key, "path": f"images/x/{key}.sif"}}))
        assert prune(c) == [f"x {key} ({root / 'images' / 'x' / (key + '.sif')})"]
    finally:
        os.umask(old_umask)
    lock = root / "locks" / f"{key}.lock"
    # Another member of the group building this key later opens the lock file read-write.
    assert stat.S_IMODE(lock.stat().st_mode) & 0o060 == 0o060
    assert lock.parent.stat().st_mode & (stat.S_IWGRP | stat.S_ISGID) == stat.S_IWGRP | stat.S_ISGID


def test_a_retried_build_replaces_the_earlier_log_and_leaves_it_group_writable(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o2775)  # a cache shared by a group
    fake = tmp_path / "apptainer"
    fake.write_text("#!/bin/sh\necho 'FATAL: no route to the registry'\nexit 1\n")
    fake.chmod(0o755)
    c = cache.Cache(root)
    key = "lock-0123456789abcdef"
    spec = parse_image("img", {"template": "x.def.j2", "base": "scratch"}, "images.yaml: images.img", tmp_path, None)
    plan = Plan(spec, "lock", key, {}, "Bootstrap: scratch\n", c.image_path("img", key), None, [])
    # An earlier failed try of this key by another member of the group: its log is that user's, mode 0644.
    log = c.log_path("img", key, "log")
    cache.make_dirs(log.parent)
    log.write_text("another user's failed try\n")
    log.chmod(0o644)
    earlier = tmp_path / "earlier.log"
    os.link(log, earlier)  # the same file under a second name: shows whether the build wrote into it
    old_umask = os.umask(0o022)
    try:
        result = Builder(c, apptainer=str(fake), timeout_s=60, on_event=lambda name, message: None).make_ready(plan)
    finally:
        os.umask(old_umask)
    assert result.action == "failed" and "FATAL: no route to the registry" in (result.error or "")
    assert log.read_text() == "FATAL: no route to the registry\n"
    # Replaced, not opened for writing: the other user's file is not writable by this one.
    assert earlier.read_text() == "another user's failed try\n"
    # The next member of the group to retry can open it for writing.
    assert stat.S_IMODE(log.stat().st_mode) & 0o060 == 0o060


_RACY_APPTAINER = """#!/bin/sh
# Fails fetching its base the first time (as when another build was writing Apptainer's layer cache), then builds.
n=$(cat "$0.count" 2>/dev/null || echo 0); echo $((n + 1)) > "$0.count"
echo 'INFO:    Fetching OCI image...'
if [ "$n" = 0 ]; then echo 'FATAL:   While performing build: conveyor failed to get: {error}'; exit 255; fi
for last; do :; done
eval "out=\\${{$(($# - 1))}}"
echo built > "$out"
"""


@pytest.mark.parametrize("error, tries", [("unexpected end of JSON input", 2), ("EOF", 2),
                                          ('while getting config: no descriptor found for reference "e4bc"', 2),
                                          ("manifest unknown", 1)])
def test_a_build_that_read_the_layer_cache_while_another_wrote_it_is_tried_again(
        tmp_path: Path, error: str, tries: int) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    fake = tmp_path / "apptainer"
    fake.write_text(_RACY_APPTAINER.format(error=error))
    fake.chmod(0o755)
    c = cache.Cache(root)
    key = "lock-0123456789abcdef"
    spec = parse_image("img", {"template": "x.def.j2", "base": "scratch"}, "images.yaml: images.img", tmp_path, None)
    plan = Plan(spec, "lock", key, {}, "Bootstrap: scratch\n", c.image_path("img", key), None, [])
    events: list[str] = []
    result = Builder(c, apptainer=str(fake), timeout_s=60,
                     on_event=lambda name, message: events.append(message)).make_ready(plan)
    assert (tmp_path / "apptainer.count").read_text().strip() == str(tries)
    if tries == 2:  # the race: built on the second try, and the user was told why it went again
        assert result.action == "built" and Path(result.path or "").read_text() == "built\n"
        assert any("trying again (2 of 3)" in m and error in m for m in events), events
    else:  # any other failure to fetch is the user's to see at once
        assert result.action == "failed" and error in (result.error or "")
        assert not any("trying again" in m for m in events), events
