"""``prorl images prune``: drop what no image name resolves to."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

from prorl_cli.images.cache import Cache, cache_mount_lock, make_dirs, share_file
from prorl_cli.sandbox.runtime import remove_tree

log = logging.getLogger("prorl.images")
_TMP_RE = re.compile(r"^\.(?P<key>[a-z]+-[0-9a-f]+)\.tmp-")


@contextlib.contextmanager
def _try_key_lock(cache: Cache, key: str) -> Iterator[bool]:
    """Hold the key's lock if free (yield True); a key being built or reused now is left alone."""
    path = cache.root / "locks" / f"{key}.lock"
    make_dirs(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        share_file(path)  # as file_lock does: the other users of a shared cache must open it read-write later
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _orphan_logs(cache: Cache, builds: dict[str, Any]) -> dict[tuple[str, str], list[Any]]:
    """``logs/NAME/KEY.{def,log}`` of keys with no build entry (failed or killed builds), by (name, key)."""
    found: dict[tuple[str, str], list[Any]] = {}
    for path in sorted((cache.root / "logs").glob("*/*")):
        key, _, suffix = path.name.rpartition(".")
        if suffix in ("def", "log") and key and key not in builds and path.is_file():
            found.setdefault((path.parent.name, key), []).append(path)
    return found


def prune_build_cache(cache: Cache, dry_run: bool = False) -> list[str]:
    """Remove this user's kept ``RUN --mount=type=cache`` folders that no build holds now; returns what went."""
    removed: list[str] = []
    for folder in sorted(p for p in cache.build_cache_dir().glob("*") if p.is_dir()):
        with cache_mount_lock(folder, exclusive=True, wait=False) as free:
            if not free:
                continue  # a build is using it
            if not dry_run:
                # What a step wrote there as another user (apt's `_apt`) belongs to a subordinate id on the host:
                # remove_tree removes it from a user namespace that maps those ids.
                remove_tree(folder, log)
                if folder.exists():
                    continue  # remove_tree said why
                folder.with_name(folder.name + ".lock").unlink(missing_ok=True)
            removed.append(f"build cache {folder.name} ({folder})")
    return removed


def prune(cache: Cache, dry_run: bool = False) -> list[str]:
    """Remove non-current builds, killed builds' temp files, entries whose image is gone and the logs of builds
    that failed (or were killed); returns what went."""
    removed: list[str] = []

    def change(data: dict[str, Any]) -> None:
        current = set(data["images"].values())
        for key, entry in list(data["builds"].items()):
            path = cache.root / entry["path"]
            if key in current and path.is_file():
                continue
            with _try_key_lock(cache, key) as free:
                if not free:
                    continue
                removed.append(f"{entry['name']} {key} ({path})")
                if dry_run:
                    continue
                path.unlink(missing_ok=True)
                for suffix in ("def", "log"):
                    cache.log_path(entry["name"], key, suffix).unlink(missing_ok=True)
                del data["builds"][key]
                if data["images"].get(entry["name"]) == key:
                    del data["images"][entry["name"]]
        for tmp in cache.stale_tmp_images():
            m = _TMP_RE.match(tmp.name)
            if not m:
                continue
            with _try_key_lock(cache, m.group("key")) as free:
                if free:
                    removed.append(f"leftover {tmp}")
                    if not dry_run:
                        tmp.unlink(missing_ok=True)
        # A failed build leaves its definition and log for the user to read, and no entry: once pruned, the next
        # build of that key writes them anew. A key being built now holds its lock and keeps them.
        for (name, key), paths in _orphan_logs(cache, data["builds"]).items():
            with _try_key_lock(cache, key) as free:
                if free:
                    removed.append(f"{name} {key}: a failed build's {' and '.join(p.suffix[1:] for p in paths)}")
                    if not dry_run:
                        for path in paths:
                            path.unlink(missing_ok=True)
        # Apptainer's own temp folders are private to each build; nothing else lives in images/<name>/.
        for d in sorted((cache.root / "images").glob("*")):
            if d.is_dir() and not any(d.iterdir()) and not dry_run:
                shutil.rmtree(d, ignore_errors=True)

    if dry_run:
        change(cache.read_manifest())
    else:
        cache.update_manifest(change)
    return removed
