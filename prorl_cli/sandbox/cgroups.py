"""Per-sandbox cgroups: the kernel's process and memory limits for a whole sandbox, where the node may make them.

rlimits bind one process (``RLIMIT_AS``) or one user (``RLIMIT_NPROC``, which
the kernel does not apply to the host's uid 0: a root node's sandboxes run as
uid 0 of the host, so without a cgroup nothing bounds their processes). A
cgroup bounds the sandbox as a whole: ``pids.max`` counts every process and
thread in it, the memory limit counts every page its processes use, tmpfs
pages they write included (the kernel's OOM killer then ends a process inside).

Where the node may make cgroups:

* cgroup v1 (separate ``pids`` and ``memory`` hierarchies): a directory for each
  sandbox under the node's own cgroup in both, when both are writable (root).
* cgroup v2: a sibling of the node's own cgroup, when the node's cgroup has
  both controllers (so its parent distributes them) and the parent is
  writable to this user (a delegated subtree, e.g. systemd's ``Delegate=yes``),
  or under the hierarchy's root (root on a host without a cgroup namespace).

Anything else (the common case for an ordinary user) means no cgroups: the
rlimits alone apply, and :func:`find_parents` says why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("pids", "memory")
#: Prefix of the cgroups made here (``<prefix><sandbox id>``); nothing else is ever removed.
PREFIX = "prorl-sandbox-"
#: Passes of :meth:`SandboxCgroup.kill` (each lists the cgroup, signals, and lets the signalled exit).
KILL_PASSES = 50
#: How long :meth:`SandboxCgroup.remove` waits for a busy cgroup (its killed processes still exiting).
REMOVE_WAIT_S = 5.0


def _unescape(path: str) -> str:
    """A path field of /proc/self/mountinfo (spaces and the like are octal escapes)."""
    return path.encode().decode("unicode_escape") if "\\" in path else path


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fs type, super options) of each cgroup mount this process sees."""
    found: list[tuple[str, str, str, set[str]]] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((_unescape(fields[3]), _unescape(fields[4]), tail[0], set(tail[2].split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and ``""`` for the v2 hierarchy."""
    own: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return own
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if parts[0] == "0" and controllers == "":
            own[""] = path
        for name in controllers.split(","):
            if name:
                own[name] = path
    return own


def _join(mount_root: str, mount_point: str, path: str) -> Path | None:
    """Where cgroup ``path`` lies under a mount of the hierarchy's ``mount_root``; None if outside it."""
    rel = os.path.relpath(path, mount_root)
    if rel.startswith(".."):
        return None
    return Path(mount_point) if rel == "." else Path(mount_point) / rel


def _read_set(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


@dataclass(frozen=True)
class CgroupParents:
    """Where this node makes its sandboxes' cgroups: one directory per controller (v1) or one (v2)."""

    version: int
    dirs: tuple[Path, ...]

    def describe(self) -> str:
        return f"cgroup v{self.version} under {', '.join(map(str, self.dirs))}"

    def create(self, sandbox_id: str, max_procs: int, mem_bytes: int) -> SandboxCgroup:
        """Make the sandbox's cgroup(s) and set their limits (0: that limit off); raise ``OSError`` if refused."""
        made: list[Path] = []
        try:
            for parent in self.dirs:
                path = parent / f"{PREFIX}{sandbox_id}"
                path.mkdir()
                made.append(path)
            group = SandboxCgroup(self.version, tuple(made))
            group.set_limits(max_procs, mem_bytes)
        except OSError:
            SandboxCgroup(self.version, tuple(made)).remove()
            raise
        return group


@dataclass(frozen=True)
class SandboxCgroup:
    """The cgroup directories of one sandbox (two under v1, one under v2)."""

    version: int
    dirs: tuple[Path, ...]

    def _file(self, controller: str, name: str) -> Path | None:
        """``name`` in the directory of ``controller`` (v2: the one directory)."""
        for d in self.dirs:
            if (d / name).exists():
                return d / name
        return None

    def set_limits(self, max_procs: int, mem_bytes: int) -> None:
        if max_procs > 0:
            pids = self._file("pids", "pids.max")
            if pids is None:
                raise OSError(errno.ENOENT, "no pids.max in the sandbox's cgroup")
            pids.write_text(str(max_procs))
        if mem_bytes > 0:
            name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
            mem = self._file("memory", name)
            if mem is None:
                raise OSError(errno.ENOENT, f"no {name} in the sandbox's cgroup")
            mem.write_text(str(mem_bytes))
            # Swap is no way around the limit (v1: memory+swap; v2: no swap at all).
            swap = self._file("memory", "memory.memsw.limit_in_bytes" if self.version == 1 else "memory.swap.max")
            if swap is not None:
                with contextlib.suppress(OSError):  # off in the kernel, or no swap accounting
                    swap.write_text(str(mem_bytes) if self.version == 1 else "0")

    @property
    def procs_files(self) -> list[Path]:
        """The ``cgroup.procs`` files a process writes its pid to, to join the sandbox's cgroup(s)."""
        return [d / "cgroup.procs" for d in self.dirs]

    def members(self) -> list[int]:
        """Pids of the processes in the sandbox's cgroup(s)."""
        pids: set[int] = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(p) for p in procs.read_text().split())
        return sorted(pids)

    def kill(self) -> list[int]:
        """SIGKILL every process in the cgroup(s) until none is left (bounded); return the pids signalled.

        Everything in a ``prorl-sandbox-*`` cgroup belongs to that sandbox, whatever session or
        group it made for itself. Passes repeat while a process forked during the last one.
        """
        signalled: set[int] = set()
        for _ in range(KILL_PASSES):
            members = self.members()
            if not members:
                break
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            signalled.update(members)
            time.sleep(0.02)  # let the signalled processes exit before listing again
        return sorted(signalled)

    def events(self) -> dict[str, int]:
        """Limit events so far: ``oom_kill`` (processes the OOM killer ended) and ``pids_max`` (forks refused)."""
        out = {"oom_kill": 0, "pids_max": 0}
        oom = self._file("memory", "memory.events" if self.version == 2 else "memory.oom_control")
        pids = self._file("pids", "pids.events")
        for path, key, field_name in ((oom, "oom_kill", "oom_kill"), (pids, "pids_max", "max")):
            if path is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                for line in path.read_text().splitlines():
                    name, _, value = line.partition(" ")
                    if name == field_name:
                        out[key] = int(value)
        return out

    def remove(self, timeout_s: float = REMOVE_WAIT_S) -> list[Path]:
        """Remove the cgroup directories; return those that could not be removed.

        A directory is busy until the kernel has let go of the processes that
        were in it (killed ones take a moment): retried, killing any member
        again, for up to ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        failed: list[Path] = []  # not for waiting: no right to remove, or no cgroup at all
        left = list(self.dirs)
        while True:
            busy: list[Path] = []
            for d in left:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    (busy if e.errno == errno.EBUSY else failed).append(d)
            if not busy or time.monotonic() >= deadline:
                return failed + busy
            left = busy
            SandboxCgroup(self.version, tuple(busy)).kill()
            time.sleep(0.05)


def remove_paths(paths: list[str]) -> list[Path]:
    """Kill what is left in recorded sandbox cgroups and remove them (a dead node's); only ``prorl-sandbox-*``."""
    dirs = tuple(Path(p) for p in paths if Path(p).name.startswith(PREFIX))
    version = 1 if len(dirs) > 1 else 2
    group = SandboxCgroup(version, dirs)
    group.kill()
    return group.remove()


def find_parents() -> tuple[CgroupParents | None, str]:
    """Where this process may make sandbox cgroups with the pids and memory controllers; else (None, why not)."""
    mounts = _mounts()
    own = _own_cgroups()
    v2 = next(((root, point) for root, point, kind, _ in mounts if kind == "cgroup2"), None)
    if v2 is not None and "" in own:
        mine = _join(v2[0], v2[1], own[""])
        if mine is not None and set(CONTROLLERS) <= _read_set(mine / "cgroup.controllers"):
            return _v2_parent(mine, own[""] == v2[0])
    dirs = []
    for name in CONTROLLERS:
        mount = next(((root, point) for root, point, kind, opts in mounts if kind == "cgroup" and name in opts), None)
        if mount is None or name not in own:
            return None, f"no cgroup v2 with the pids and memory controllers, and no v1 {name} hierarchy"
        mine = _join(mount[0], mount[1], own[name])
        if mine is None or not os.access(mine, os.W_OK | os.X_OK):
            return None, f"cgroup v1: {mine or mount[1]} is not writable to this user"
        dirs.append(mine)
    return CgroupParents(1, tuple(dirs)), ""


def _v2_parent(mine: Path, at_root: bool) -> tuple[CgroupParents | None, str]:
    """v2: a sibling of our cgroup (its parent distributes both controllers), or our cgroup at the root."""
    if at_root:
        # The root cgroup may hold processes and still distribute controllers.
        control = mine / "cgroup.subtree_control"
        if not set(CONTROLLERS) <= _read_set(control):
            try:
                control.write_text(" ".join(f"+{c}" for c in CONTROLLERS))
            except OSError as e:
                return None, f"cgroup v2: cannot enable pids and memory in {control}: {e.strerror}"
        return CgroupParents(2, (mine,)), ""
    parent = mine.parent
    if not (os.access(parent, os.W_OK | os.X_OK) and os.access(parent / "cgroup.procs", os.W_OK)):
        return None, (f"cgroup v2: {parent} (the parent of this process's cgroup) is not delegated to this user; "
                      "start the node in a cgroup of its own whose parent it may write (systemd Delegate=yes)")
    return CgroupParents(2, (parent,)), ""
