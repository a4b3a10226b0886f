"""The image cache: keys, per-key file locks, and ``manifest.json``.

Layout of a cache directory (on a shared filesystem, used by many users and
login nodes at once)::

    manifest.json                 what each image was built from (atomic replace)
    manifest.lock                 serialises read-modify-write of the manifest
    locks/<key>.lock              held while an image with that key is built
    images/<name>/<key>.sif       finished images, published by rename
    images/<name>/.<key>.tmp-*    a build in progress (or one that was killed)
    logs/<name>/<key>.{def,log}   the rendered definition and Apptainer's output

Locks are POSIX record locks (``fcntl.lockf``): the kernel (or NFS lockd)
drops them when the holder dies, so a killed build never blocks the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import ConfigError, ImageBuildError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK_BYTES = 1 << 20
# POSIX locks are per process: threads of one process need their own exclusion too.
_MANIFEST_THREAD_LOCK = threading.Lock()


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def sha256_path(path: Path) -> str:
    """Hex SHA-256 of a file, or of a folder's tree (relative names, modes, link targets, contents)."""
    if not path.is_dir():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        st = p.lstat()
        h.update(f"{rel}\0{stat.S_IMODE(st.st_mode):o}\0".encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(b"L" + os.readlink(p).encode())
        elif stat.S_ISREG(st.st_mode):
            h.update(b"F" + sha256_file(p).encode())
        else:
            h.update(b"D")
    return h.hexdigest()


def cache_key(mode: str, inputs: dict[str, Any]) -> str:
    """``<mode>-<16 hex>`` from canonical JSON of ``inputs``: the same inputs give the same key in any process."""
    canon = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return f"{mode}-{hashlib.sha256(canon.encode()).hexdigest()[:16]}"


def changed_inputs(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the inputs that differ (for the "why rebuild" line)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(changed_inputs(a, b, f"{prefix}{k}."))
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; a shared cache must stay readable by its other users
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


_HOLDER_ID_WAIT_S = 2.0


def holder_id() -> str:
    """Who holds a lock, for the messages of those waiting on it."""
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _wait_naming_holder(fd: int, on_wait: Callable[[str], None]) -> bool:
    """Tell ``on_wait`` who holds the lock on ``fd``; False if it was taken meanwhile.

    The holder writes its id just after it locks, so a waiter arriving in that
    gap reads an empty file: look again for a moment before saying "another process".
    """
    deadline = time.monotonic() + _HOLDER_ID_WAIT_S
    while True:
        # Read through the locked fd: opening and closing a second fd would drop our own locks.
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if holder or time.monotonic() >= deadline:
            on_wait(holder or "another process")
            return True
        time.sleep(0.01)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False  # the holder finished while we looked
        except (BlockingIOError, PermissionError):
            continue


@contextlib.contextmanager
def file_lock(path: Path, on_wait: Callable[[str], None] | None = None) -> Iterator[float]:
    """Hold an exclusive POSIX lock on ``path``; yields the seconds spent waiting.

    When another process holds it, ``on_wait`` is called once with the
    holder's description before blocking.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    t0 = time.monotonic()
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            if on_wait is None or _wait_naming_holder(fd, on_wait):
                fcntl.lockf(fd, fcntl.LOCK_EX)
        waited_s = time.monotonic() - t0
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder_id().encode(), 0)
        yield waited_s
    finally:
        os.close(fd)  # closing releases the lock


class Cache:
    """One cache directory: image paths, per-key locks and the manifest."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.manifest_path = self.root / MANIFEST_NAME

    def image_path(self, name: str, key: str) -> Path:
        return self.root / "images" / name / f"{key}.sif"

    def tmp_image_path(self, name: str, key: str) -> Path:
        return self.root / "images" / name / f".{key}.tmp-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}.sif"

    def stale_tmp_images(self, name: str | None = None, key: str | None = None) -> list[Path]:
        """Leftovers of killed builds (only safe to delete while holding that key's lock)."""
        pattern = f".{key}.tmp-*" if key else ".*.tmp-*"
        dirs = [self.root / "images" / name] if name else sorted((self.root / "images").glob("*"))
        return sorted(p for d in dirs if d.is_dir() for p in d.glob(pattern))

    def log_path(self, name: str, key: str, suffix: str) -> Path:
        return self.root / "logs" / name / f"{key}.{suffix}"

    def key_lock(self, key: str, on_wait: Callable[[str], None] | None = None) -> contextlib.AbstractContextManager[float]:
        return file_lock(self.root / "locks" / f"{key}.lock", on_wait)

    # -- manifest ---------------------------------------------------------------------------

    def read_manifest(self) -> dict[str, Any]:
        """The manifest (empty when none was written yet); readers need no lock (it is replaced atomically)."""
        try:
            text = self.manifest_path.read_text()
        except FileNotFoundError:
            return {"format": MANIFEST_FORMAT, "images": {}, "builds": {}}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{self.manifest_path}: not valid JSON ({e}); remove it to start an empty cache") from e
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ConfigError(f"{self.manifest_path}: unknown manifest format {data.get('format') if isinstance(data, dict) else data!r}")
        data.setdefault("images", {})
        data.setdefault("builds", {})
        return data

    def update_manifest(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply ``change`` to the manifest under its lock and replace the file atomically."""
        with _MANIFEST_THREAD_LOCK, file_lock(self.root / "manifest.lock"):
            data = self.read_manifest()
            change(data)
            _atomic_write(self.manifest_path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
            return data

    def record(self, entry: dict[str, Any]) -> None:
        """Make ``entry`` (a finished or reused build) the current image of its name."""

        def change(data: dict[str, Any]) -> None:
            data["builds"][entry["key"]] = entry
            data["images"][entry["name"]] = entry["key"]

        self.update_manifest(change)

    def current(self, name: str, manifest: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The manifest entry of the image that ``name`` resolves to now."""
        data = manifest if manifest is not None else self.read_manifest()
        key = data["images"].get(name)
        return data["builds"].get(key) if key else None

    def latest_build(self, name: str, mode: str, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """The most recent build of ``name`` in ``mode`` (to explain what changed)."""
        same = [b for b in manifest["builds"].values() if b.get("name") == name and b.get("mode") == mode]
        return max(same, key=lambda b: b.get("built_at", ""), default=None)

    def resolve(self, name: str) -> Path:
        """The .sif that image ``name`` resolves to; raises when it was never built or its file is gone."""
        data = self.read_manifest()
        entry = self.current(name, data)
        if entry is None:
            known = sorted(data["images"])
            raise ImageBuildError(f"image {name!r} is not in {self.manifest_path} (built: {known or 'none'}); run `prorl build-images {name}`")
        path = self.root / entry["path"]
        if not path.is_file():
            raise ImageBuildError(f"image {name!r}: {path} is listed in {self.manifest_path} but missing; rebuild it")
        return path


def resolve_image(name: str, cache_dir: str | os.PathLike[str]) -> Path:
    """The built .sif for image ``name`` in ``cache_dir`` (what node servers call for a handler's image)."""
    return Cache(Path(os.path.expandvars(os.path.expanduser(str(cache_dir))))).resolve(name)
