"""Running ``apptainer build --fakeroot`` for planned images, safely under concurrency.

Per image: take the key's file lock (another process building the same key
makes us wait, then reuse its result), re-check the cache, build into a temp
file beside the final path, and publish it with an atomic rename before
recording it in the manifest. A failed or interrupted build leaves no image
behind; its temp file is removed (or, if the process was killed, removed by
the next build holding the same lock, or by ``prorl images prune``).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import os
import queue
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli import __version__
from prorl_cli.exceptions import ImageBuildError
from prorl_cli.images.cache import Cache, _atomic_write, cache_mount_lock, make_dirs, share_file
from prorl_cli.images.dockerfile_mounts import CACHE_MOUNTS, SECRET_MOUNTS, SSH_MOUNTS
from prorl_cli.images.plan import Plan, decide
from prorl_cli.processes import stop_group

LOG_TAIL_LINES = 25
#: A step Apptainer announces ("INFO:    Running post scriptlet", "Creating SIF file..."): its message starts with a
#: verb in -ing. Its other INFO lines are hints ("To see mksquashfs output ... enable verbose logging", "Non-gzip
#: squashfs compression might not work ..."), which a failure must not be reported "at".
_STEP_RE = re.compile(r"^(INFO|VERBOSE):\s+([A-Z][a-z]+ing\b.*)")
_TERM_GRACE_S = 10.0
#: The trace of a RUN with mounts whose command failed (dockerfile_mounts.MountedStep.wrap).
_FAILED_MOUNTED_STEP = re.compile(r"^\+ prorl_rc=[1-9]")
_COMMAND_CHARS = 300  # of the failed command shown in the error (the log has it whole)
#: Apptainer's layer cache is not safe for concurrent builds (sylabs/singularity#3634): a build that reads a blob
#: or index another build is writing fails fetching its base with one of these (a bare ``get: EOF`` from a
#: blob read while it was cut short; apptainer/apptainer#1901's missing descriptor). Such a build is tried again.
_CACHE_RACE_ERRORS = ("unexpected end of JSON input", "unexpected EOF", "conveyor failed to get: EOF",
                      "no descriptor found for reference")
#: Tries of one build that failed that way (the other build has finished writing by then).
_CACHE_RACE_TRIES = 3


@dataclass
class Result:
    """What happened to one image."""

    name: str
    key: str
    mode: str
    action: str  # built | reused | failed | skipped
    reasons: list[str]
    path: str
    waited_s: float = 0.0
    build_s: float = 0.0
    size_bytes: int = 0
    error: str | None = None
    log: str | None = None
    log_tail: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


Event = Callable[[str, str], None]  # (image name, message)


class BuildFailed(ImageBuildError):
    """A build failed; carries the log file and the last lines of Apptainer's output."""

    def __init__(self, message: str, log: str | None = None, tail: list[str] | None = None) -> None:
        super().__init__(message)
        self.log = log
        self.tail = tail or []


def _cache_race_line(e: BuildFailed) -> str | None:
    """The FATAL line of a build that failed fetching its base from a layer cache another build was writing."""
    return next((t for t in reversed(e.tail) if t.startswith("FATAL") and "conveyor failed to get" in t
                 and any(sig in t for sig in _CACHE_RACE_ERRORS)), None)


def _rootless_hint() -> str:
    if os.geteuid() == 0:
        try:
            lines = Path("/etc/subuid").read_text().splitlines()
        except FileNotFoundError:
            lines = []
        if not any(line.startswith("root:") for line in lines):
            return " (hint: as root, --fakeroot needs a 'root:' line in /etc/subuid and /etc/subgid)"
    return ""


def _bind(path: Path, dest: str, where: str, fix: str = "move it") -> list[str]:
    """``--bind PATH:DEST`` for ``apptainer build``; a path whose ':' or ',' would end the bind spec is an error."""
    if any(c in str(path) for c in ":,"):
        raise ImageBuildError(f"{where}: {path} cannot be bound (a ':' or ',' in its path ends Apptainer's --bind); "
                              f"{fix}")
    return ["--bind", f"{path}:{dest}"]


class Builder:
    """Builds plans with Apptainer; ``on_event`` receives progress lines."""

    def __init__(self, cache: Cache, *, apptainer: str, timeout_s: float, on_event: Event) -> None:
        self.cache = cache
        self.apptainer = apptainer
        self.timeout_s = timeout_s
        self.on_event = on_event
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._procs_lock = threading.Lock()
        self._aborted = threading.Event()
        self._building: set[str] = set()  # images past their lock, with a build (and temp file) under way

    # -- many images ------------------------------------------------------------------------

    def run(self, plans: list[Plan], jobs: int) -> list[Result]:
        """Make every plan ready, ``jobs`` builds at a time, bases before the images on them.

        Workers are daemon threads: one blocked on another process's lock must
        not keep an interrupted prorl alive. On interruption the running builds
        are stopped and their workers joined (they remove their temp files).
        """
        results: dict[str, Result] = {}
        by_name = {p.spec.name: p for p in plans}
        pending = list(plans)
        threads: dict[str, threading.Thread] = {}
        finished: queue.Queue[tuple[str, Result | None, BaseException | None]] = queue.Queue()

        def worker(plan: Plan) -> None:
            try:
                finished.put((plan.spec.name, self.make_ready(plan), None))
            except BaseException as e:  # handed to the main thread, which raises it
                finished.put((plan.spec.name, None, e))

        try:
            while pending or threads:
                for plan in list(pending):
                    if len(threads) >= jobs:
                        break
                    deps = [d for d in plan.spec.dependencies if d in by_name]
                    if any(d not in results for d in deps):
                        continue  # a base is not ready yet
                    pending.remove(plan)
                    failed = [d for d in deps if results[d].action in ("failed", "skipped")]
                    if failed:
                        results[plan.spec.name] = Result(plan.spec.name, plan.key, plan.mode, "skipped",
                                                         [f"base image {failed[0]} failed"], str(plan.path))
                        continue
                    t = threading.Thread(target=worker, args=(plan,), name=f"prorl-build-{plan.spec.name}", daemon=True)
                    threads[plan.spec.name] = t
                    t.start()
                if not threads:
                    continue
                name, result, error = finished.get()
                threads.pop(name).join()
                if error is not None:
                    raise error
                assert result is not None
                results[name] = result
                if len(plans) > 1:  # progress over many images (a dataset's pulls): how far along the run is
                    done = sum(r.action in ("built", "reused") for r in results.values())
                    self.on_event(name, f"{result.action}; {done}/{len(plans)} image(s) ready, "
                                        f"{len(results) - done} not")
        except BaseException:
            self.abort()
            for name in list(self._building):
                if name in threads:
                    threads[name].join(_TERM_GRACE_S + 10)
            raise
        return [results[p.spec.name] for p in plans]

    def abort(self) -> None:
        """Stop every running build (SIGTERM to its process group, then SIGKILL)."""
        self._aborted.set()
        with self._procs_lock:
            procs = list(self._procs.values())
        for proc in procs:
            stop_group(proc, _TERM_GRACE_S + 5)

    # -- one image --------------------------------------------------------------------------

    def make_ready(self, plan: Plan) -> Result:
        """Reuse or build one image under its key's lock."""
        name = plan.spec.name
        waited: list[str] = []

        def on_wait(holder: str) -> None:
            waited.append(holder)
            self.on_event(name, f"waiting for {plan.key}: being built by {holder}")

        if plan.reuse and not self.cache.can_lock(plan.key):
            # A cache this user may only read (one an admin builds for everyone): a finished image is used as it
            # is, unlocked (nothing writes a published image) and without touching the manifest.
            size = plan.path.stat().st_size
            return Result(name, plan.key, plan.mode, "reused", [*plan.reasons, "read-only cache: used as it is"],
                          str(plan.path), 0.0, 0.0, size)
        try:
            with self.cache.key_lock(plan.key, on_wait) as waited_s:
                # Another process may have finished this key while we planned or waited.
                planned_reuse, planned_reasons = plan.reuse, plan.reasons
                decide(plan, self.cache, self.cache.read_manifest())
                if not plan.reuse and not planned_reuse:
                    plan.reasons = planned_reasons  # the plan's reasons also know which bases this run rebuilt
                if waited and plan.reuse:
                    plan.reasons.insert(0, f"built meanwhile by {waited[0]}")
                if plan.reuse:
                    entry = self._adopt_or_touch(plan)
                    return Result(name, plan.key, plan.mode, "reused", plan.reasons, str(plan.path), waited_s, 0.0, entry["size_bytes"])
                return self._build(plan, waited_s)
        except BuildFailed as e:
            return Result(name, plan.key, plan.mode, "failed", plan.reasons, str(plan.path), error=str(e), log=e.log, log_tail=e.tail)
        except ImageBuildError as e:
            return Result(name, plan.key, plan.mode, "failed", plan.reasons, str(plan.path), error=str(e))
        except PermissionError as e:  # the cache's lock, manifest or image folder: name the cache and the fix
            return Result(name, plan.key, plan.mode, "failed", plan.reasons, str(plan.path),
                          error=self.cache.not_writable(e.filename or self.cache.root))

    def _entry(self, plan: Plan, build_s: float, built_at: str) -> dict[str, Any]:
        spec = plan.spec
        return {
            "name": spec.name,
            "key": plan.key,
            "mode": plan.mode,
            "path": str(plan.path.relative_to(self.cache.root)),
            "template": spec.template,
            "variables": spec.variables,
            "base": str(spec.base),
            "base_path": str(plan.base_path) if plan.base_path else None,
            "files": {f.dst: str(f.src) for f in spec.files},
            "lockfile": str(spec.lockfile) if spec.lockfile else None,
            "prorl_version": __version__,
            "built_at": built_at,
            "build_s": round(build_s, 3),
            "size_bytes": plan.path.stat().st_size,
            "definition": str(self.cache.log_path(spec.name, plan.key, "def").relative_to(self.cache.root)),
            "inputs": plan.inputs,
        }

    def _adopt_or_touch(self, plan: Plan) -> dict[str, Any]:
        """A reused image becomes the name's current image (adopting a finished image the manifest lacks)."""
        entry = self.cache.read_manifest()["builds"].get(plan.key)
        if entry is None:
            mtime = datetime.datetime.fromtimestamp(plan.path.stat().st_mtime, datetime.UTC)
            _atomic_write(self.cache.log_path(plan.spec.name, plan.key, "def"), plan.definition)
            entry = self._entry(plan, 0.0, mtime.isoformat(timespec="milliseconds"))
        self.cache.record(entry)
        return entry

    def _build(self, plan: Plan, waited_s: float) -> Result:
        self._building.add(plan.spec.name)
        try:
            return self._build_locked(plan, waited_s)
        finally:
            self._building.discard(plan.spec.name)

    def _build_locked(self, plan: Plan, waited_s: float) -> Result:
        name, key = plan.spec.name, plan.key
        for stale in self.cache.stale_tmp_images(name, key):
            # We hold the key's lock, so no live build owns these: they are leftovers of a killed one.
            self.on_event(name, f"removing leftover of an interrupted build: {stale.name}")
            stale.unlink(missing_ok=True)
        def_path = self.cache.log_path(name, key, "def")
        log_path = self.cache.log_path(name, key, "log")
        _atomic_write(def_path, plan.definition)
        tmp = self.cache.tmp_image_path(name, key)
        make_dirs(tmp.parent)
        t0 = time.monotonic()
        with self._mount_binds(plan) as binds:
            cmd = [self.apptainer, "build", "--fakeroot", *binds, *plan.build_args, str(tmp), str(def_path)]
            self.on_event(name, f"building {key}: {shlex.join(cmd)}")
            self._build_with(plan, cmd, tmp, log_path)
        build_s = time.monotonic() - t0
        built_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
        entry = self._entry(plan, build_s, built_at)
        self.cache.record(entry)
        return Result(name, key, plan.mode, "built", plan.reasons, str(plan.path), waited_s, build_s, entry["size_bytes"], log=str(log_path))

    @contextlib.contextmanager
    def _mount_binds(self, plan: Plan) -> Iterator[list[str]]:
        """The ``--bind`` arguments of what the plan's ``RUN --mount``s use, held for the build:
        - each kept cache's host folder, made, and locked (see :func:`~prorl_cli.images.cache.cache_mount_lock`) in
          one order for every build, so that none waits on another that waits on it;
        - each secret: a host file as it is, or a variable of prorl's environment written to a file only this user
          can read, removed after the build;
        - each SSH agent's socket.
        """
        name = plan.spec.name
        binds: list[str] = []
        with contextlib.ExitStack() as held:
            root = self.cache.build_cache_dir()
            for cache in sorted(plan.caches, key=lambda c: c.key):
                folder = root / cache.key
                binds += _bind(folder, f"{CACHE_MOUNTS}/{cache.key}", f"image {name}: the build cache",
                               "set images.cache_dir elsewhere or images.build_cache: false")
                make_dirs(folder)
                busy = functools.partial(self.on_event, name, f"waiting for build cache {cache.key}: another build "
                                                              "holds it (sharing=locked)")
                held.enter_context(cache_mount_lock(folder, exclusive=cache.locked, on_wait=busy))
            private = Path(held.enter_context(tempfile.TemporaryDirectory(prefix="prorl-secrets-")))
            for secret_id, source in sorted(plan.secrets.items()):
                where = f"image {name}: images.build_secrets.{secret_id}"
                if source.startswith("env:"):
                    if source[4:] not in os.environ:
                        raise ImageBuildError(f"{where}: the variable {source[4:]} is not set")
                    path = private / secret_id
                    path.touch(0o600)
                    path.write_text(os.environ[source[4:]])
                else:
                    path = Path(source).expanduser()
                    if not path.is_file():
                        raise ImageBuildError(f"{where}: {path} is not a file")
                binds += _bind(path, f"{SECRET_MOUNTS}/{secret_id}:ro", where)
            for agent_id, socket_path in sorted(plan.ssh.items()):
                where = f"image {name}: images.build_ssh.{agent_id}"
                sock = Path(os.path.expanduser(os.path.expandvars(socket_path)))
                try:
                    is_socket = stat.S_ISSOCK(sock.stat().st_mode)
                except OSError:
                    is_socket = False
                if not is_socket:
                    raise ImageBuildError(f"{where}: {sock} is not an SSH agent's socket (is the agent running, and "
                                          "$SSH_AUTH_SOCK set?)")
                binds += _bind(sock, f"{SSH_MOUNTS}/{agent_id}", where)
            yield binds

    def _build_with(self, plan: Plan, cmd: list[str], tmp: Path, log_path: Path) -> None:
        """Run ``cmd`` (tried again on Apptainer's layer cache race) and publish its image at the plan's path."""
        name = plan.spec.name
        try:
            for attempt in range(1, _CACHE_RACE_TRIES + 1):
                try:
                    self._run_apptainer(name, cmd, log_path)
                    break
                except BuildFailed as e:
                    race = _cache_race_line(e)
                    if attempt == _CACHE_RACE_TRIES or race is None:
                        raise
                    self.on_event(name, f"fetching the base failed on Apptainer's layer cache, which another build "
                                        f"was writing ({race.strip()}): trying again ({attempt + 1} of {_CACHE_RACE_TRIES})")
                    tmp.unlink(missing_ok=True)  # apptainer will not build over a file a failed try left
                    time.sleep(attempt)
            if not tmp.is_file() or tmp.stat().st_size == 0:
                raise ImageBuildError(f"image {name}: apptainer exited 0 but wrote no image at {tmp}")
            with tmp.open("rb") as f:
                os.fsync(f.fileno())  # the rename must never publish a file whose bytes are not on disk
            share_file(tmp)  # Apptainer writes with the builder's umask; the cache's other users read it
            os.replace(tmp, plan.path)
        finally:
            tmp.unlink(missing_ok=True)

    def _run_apptainer(self, name: str, cmd: list[str], log_path: Path) -> None:
        if shutil.which(cmd[0]) is None:
            raise ImageBuildError(f"image {name}: {cmd[0]!r} not found on PATH (install Apptainer, or set images.apptainer)")
        # The runner stops the whole build, orphans included, when told to or when prorl dies (even by SIGKILL).
        prefix = [sys.executable, "-m", "prorl_cli.images.runner", str(os.getpid()), str(_TERM_GRACE_S)]
        tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        step = "starting apptainer"
        # Apptainer runs %setup/%post with `sh -x`: the last "+ " line before a failure is the command that failed,
        # which a step printing more than the tail's lines (a pip install) would otherwise push out of sight.
        command: str | None = None
        settled = False
        make_dirs(log_path.parent)
        timed_out = threading.Event()
        # The log of an earlier try of this key (a failed build, a scratch rebuild) may be another user's, which
        # this user cannot open for writing even in a group-shared cache: replace it (the folder is writable).
        log_path.unlink(missing_ok=True)
        with log_path.open("w") as log:
            share_file(log_path)
            with self._procs_lock:  # abort() either sees this build or stops it from starting
                if self._aborted.is_set():
                    raise ImageBuildError(f"image {name}: build cancelled")
                proc = subprocess.Popen([*prefix, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
                self._procs[name] = proc
            def on_timeout() -> None:
                timed_out.set()
                stop_group(proc, _TERM_GRACE_S + 5)

            timer = threading.Timer(self.timeout_s, on_timeout)
            timer.daemon = True
            timer.start()
            try:
                assert proc.stdout is not None
                for raw in proc.stdout:
                    line = raw.decode(errors="replace").rstrip("\n")
                    log.write(line + "\n")
                    tail.append(line)
                    m = _STEP_RE.match(line)
                    if m:
                        step, command, settled = m.group(2).strip(), None, False
                    elif _FAILED_MOUNTED_STEP.match(line):
                        settled = True  # what follows takes a RUN's mounts away: the command before it failed
                    elif line.startswith("+ ") and not settled:
                        command = line[2:]
                rc = proc.wait()
            except BaseException:
                stop_group(proc, _TERM_GRACE_S + 5)
                raise
            finally:
                timer.cancel()
                with self._procs_lock:
                    self._procs.pop(name, None)
        if rc != 0:
            why = f"timed out after {self.timeout_s:g} s" if timed_out.is_set() else f"apptainer exited with status {rc}"
            fatal = next((t for t in reversed(tail) if t.startswith("FATAL")), None)
            msg = f"image {name}: build failed ({why}) at step: {step}"
            if command is not None:
                shown = command if len(command) <= _COMMAND_CHARS else command[:_COMMAND_CHARS] + " …"
                msg += f"\n  failed command: {shown}"
            if fatal:
                msg += f"\n  {fatal}"
            if any("fakeroot" in t or "subuid" in t for t in tail):
                msg += _rootless_hint()
            if any("no space left on device" in t for t in tail):
                msg += ("\n  hint: a file system is full (the path above): `prorl images prune` removes superseded builds"
                        " of this cache; --cache-dir (images.cache_dir) moves the cache, APPTAINER_TMPDIR Apptainer's"
                        " temporary folder")
            if step.startswith("Extracting local image") and any("failed to change uid and gids" in t for t in tail):
                msg += ("\n  hint: under --fakeroot Apptainer cannot extract a local .sif base whose files belong to"
                        " users other than root (apptainer/apptainer#3186); start this image from debootstrap: or docker:// instead")
            raise BuildFailed(msg, str(log_path), list(tail))
