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
from collections.abc import Callable, Iterator, Sequence
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


def sha256_path(path: Path, _outer: tuple[Path, ...] = ()) -> str:
    """Hex SHA-256 of a file, or of a folder's tree (relative names, modes, contents).

    A symbolic link counts by what it points to: Apptainer copies ``%files``
    with ``cp -L``, so the image holds the target's bytes, and a changed target
    must change the key. A link that dangles, or leads back into a folder being
    hashed, counts by its text.
    """
    if not path.is_dir():
        return sha256_file(path)
    outer = (*_outer, path.resolve())
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        st = p.lstat()
        h.update(f"{rel}\0{stat.S_IMODE(st.st_mode):o}\0".encode())
        if stat.S_ISLNK(st.st_mode):
            target = p.resolve()
            if p.is_file():
                h.update(b"F" + sha256_file(p).encode())
            elif p.is_dir() and not any(target == o or target in o.parents for o in outer):
                h.update(b"D" + sha256_path(p, outer).encode())
            else:
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


def _group_shared(folder: Path) -> bool:
    return bool(folder.stat().st_mode & stat.S_IWGRP)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` that keeps a group-shared cache shared, whatever each user's umask.

    A folder made inside a group-writable folder is group-writable and setgid
    too (new files then belong to the folder's group), so every member of the
    group can build, lock and publish in a cache whose root was made so once
    (``chmod 2775``, ``chgrp GROUP``).
    """
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue  # another process made it meanwhile
        if _group_shared(d.parent):
            os.chmod(d, stat.S_IMODE(d.stat().st_mode) | stat.S_IRWXG | stat.S_ISGID)


def share_file(path: Path) -> None:
    """Make a file this process created readable by all, and group-writable in a group-shared folder."""
    st = path.stat()
    if st.st_uid != os.geteuid():
        return  # not ours: its owner made it so
    mode = stat.S_IMODE(st.st_mode) | 0o444
    if _group_shared(path.parent):
        mode |= stat.S_IRGRP | stat.S_IWGRP
    if mode != stat.S_IMODE(st.st_mode):
        os.chmod(path, mode)


def _atomic_write(path: Path, text: str) -> None:
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        # mkstemp makes 0600; a shared cache must stay readable by its other users (and writable by its group).
        os.fchmod(fd, 0o664 if _group_shared(path.parent) else 0o644)
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
    make_dirs(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    share_file(path)  # other users of a shared cache open it read-write to lock it
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


@contextlib.contextmanager
def cache_mount_lock(folder: Path, *, exclusive: bool, on_wait: Callable[[], None] | None = None,
                     wait: bool = True) -> Iterator[bool]:
    """Hold a kept cache mount's folder for a build: shared, or ``exclusive`` (``sharing=locked``, and
    ``prorl images prune --build-cache``); yields whether it is held (always, when ``wait``).

    ``flock``, not ``lockf``: it binds the open file, so two build threads of one process exclude each other
    too, and one closing its file keeps the other's lock.
    """
    fd = os.open(folder.with_name(folder.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, mode)
        yield True
    finally:
        os.close(fd)


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

    def build_cache_dir(self) -> Path:
        """This user's kept ``RUN --mount=type=cache`` folders: a user's own, as a build writes them as that user
        (the cache's other users could not write into them)."""
        return self.root / "build-cache" / str(os.getuid())

    def log_path(self, name: str, key: str, suffix: str) -> Path:
        return self.root / "logs" / name / f"{key}.{suffix}"

    def key_lock(self, key: str, on_wait: Callable[[str], None] | None = None) -> contextlib.AbstractContextManager[float]:
        return file_lock(self.key_lock_path(key), on_wait)

    def key_lock_path(self, key: str) -> Path:
        return self.root / "locks" / f"{key}.lock"

    def can_lock(self, key: str) -> bool:
        """Whether this user can take ``key``'s lock (open its file read-write, or create it)."""
        path = self.key_lock_path(key)
        if path.exists():
            return os.access(path, os.R_OK | os.W_OK)
        folder = path.parent if path.parent.exists() else self.root
        return os.access(folder if folder.exists() else folder.parent, os.W_OK | os.X_OK)

    def not_writable(self, path: Path | str) -> str:
        """What to do when this user cannot write ``path`` of this cache."""
        return (f"{path}: permission denied: the image cache {self.root} is not writable by this user. Use a cache "
                "of your own (images.cache_dir in prorl.yaml, or build-images --cache-dir), or have its owner make "
                "it group-writable (chgrp GROUP DIR && chmod 2775 DIR; docs/images.md)")

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


def _expand(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(str(path))))


def find_in_dirs(name: str, search_dirs: Sequence[str | os.PathLike[str]]) -> tuple[Path | None, list[Path]]:
    """The first ``DIR/NAME.sif`` file or ``DIR/NAME`` folder (an Apptainer sandbox directory) in ``search_dirs``,
    and every path that was looked at (for the error that names them)."""
    looked: list[Path] = []
    for folder in search_dirs:
        root = _expand(folder)
        sif, sandbox_dir = root / f"{name}.sif", root / name
        looked += [sif, sandbox_dir]
        if sif.is_file():
            return sif, looked
        # A root file system, not some other folder that happens to share the name.
        if (sandbox_dir / "usr").is_dir() or (sandbox_dir / ".singularity.d").is_dir():
            return sandbox_dir, looked
    return None, looked


def resolve_image(name: str, cache_dir: str | os.PathLike[str], search_dirs: Sequence[str | os.PathLike[str]] = ()) -> Path:
    """The image ``name`` stands for (what node servers call for a handler's image).

    The current build of ``name`` in the cache ``cache_dir`` (``prorl build-images NAME``) wins; else the first
    ``NAME.sif`` or ``NAME/`` sandbox directory in ``search_dirs`` (``images.search_dirs``: images built some
    other way, such as the provisioned test images). Neither: :class:`ImageBuildError` saying where it looked
    and what to run.
    """
    cache = Cache(_expand(cache_dir))
    try:
        return cache.resolve(name)
    except ImageBuildError as e:
        if cache.current(name) is not None:
            raise  # listed in the manifest but its file is gone: rebuilding is the fix
        found, looked = find_in_dirs(name, search_dirs)
        if found is not None:
            return found
        where = ", ".join(str(p) for p in looked) if looked else "none (images.search_dirs is empty)"
        raise ImageBuildError(
            f"image {name!r} is not in {cache.manifest_path} "
            f"(built: {sorted(cache.read_manifest()['images']) or 'none'}) and no image file or sandbox directory "
            f"of that name is in images.search_dirs (looked at: {where}). `prorl build-images {name}` builds it "
            f"where the image list defines {name!r} (images.config_file, ./images.yaml or the shipped list; needs "
            f"the network); else add the folder holding {name}.sif or {name}/ to images.search_dirs, or give the "
            f"image as a path"
        ) from e
