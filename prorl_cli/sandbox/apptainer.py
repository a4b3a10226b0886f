"""Apptainer: the default runtime on clusters (rootless; SIF files or sandbox directories).

The command line is built here rather than through spython: spython's
``Client.execute`` runs a command to completion and hides the process,
while a sandbox must be a long-lived child in its own process group whose
stdout says when the tool server is ready.

Defaults: ``--containall`` (own PID/IPC namespaces, clean environment, no
home/cwd/tmp from the host) plus ``--no-home``, ``--net --network none``
unless the task asks for network, ``--fakeroot`` when configured, a
per-sandbox writable layer, and only two binds: the sandbox's own run
directory (its socket) and the tool server file (read-only).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from prorl_cli.exceptions import SandboxError
from prorl_cli.sandbox.runtime import (
    INSIDE_RUN,
    INSIDE_TOOLSERVER,
    SOCKET_NAME,
    TOOLSERVER_PATH,
    LaunchSpec,
    Runtime,
    probe_command,
)
from prorl_cli.sandbox.settings import SandboxConfig


def cfg_image_missing(image: str) -> bool:
    """A configured default image that is not there (``auto`` then prefers a runtime that can start)."""
    return bool(image) and image != "host" and not Path(image).exists()


def fuse_usable() -> bool:
    """Whether this user may mount SIF files with squashfuse (else they are unpacked)."""
    return os.access("/dev/fuse", os.R_OK | os.W_OK)


#: Marker file written last into an unpacked copy: its presence means the copy is whole.
UNPACKED_MARK = ".prorl-unpacked"


def unpacked_root(config: SandboxConfig) -> Path:
    """Node-local directory of unpacked SIF copies (beside the sandboxes' session directories)."""
    base = Path(config.local_dir) if config.local_dir else Path(tempfile.gettempdir()) / f"prorl-{os.getuid()}"
    return base / "unpacked"


class UnpackedImages:
    """One unpacked copy of each SIF per node, for users who cannot mount SIFs with FUSE.

    ``apptainer exec --unsquash`` unpacks the whole image at every start (minutes
    for multi-GB images). Instead the first start of an image unpacks it once
    (``apptainer build --sandbox``) into ``<local_dir>/unpacked/<name>-<key>``,
    under a file lock so concurrent starts, and other node processes of this
    user, wait for that one copy; the key covers the SIF's path, size and
    modification time, so a rebuilt image gets a new copy. Sandboxes run the copy
    without ``--writable`` (read-only to them) and each gets its own writable
    layer (``sandbox.writable``), exactly as with a SIF.
    """

    def __init__(self, root: Path, binary: str, log: logging.Logger, python: str = "python3") -> None:
        self.root = root
        self.binary = binary
        self.log = log
        self.python = python
        self._locks: dict[Path, asyncio.Lock] = {}

    def path_for(self, image: str) -> Path:
        st = os.stat(image)
        real = os.path.realpath(image)
        key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
        return self.root / f"{Path(real).stem}-{key}"

    async def get(self, image: str) -> Path:
        """The unpacked copy of ``image``, made now if this node has none."""
        target = self.path_for(image)
        if (target / UNPACKED_MARK).exists():
            return target
        # One waiter per image in this process; the file lock covers other processes.
        lock = self._locks.setdefault(target, asyncio.Lock())
        async with lock:
            if not (target / UNPACKED_MARK).exists():
                await asyncio.to_thread(self._unpack_locked, image, target)
        return target

    def _unpack_locked(self, image: str, target: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(f"{target}.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            if (target / UNPACKED_MARK).exists():
                return  # another process made it while we waited
            partial = Path(f"{target}.partial-{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(target, ignore_errors=True)  # a copy left half-made by a killed process
            self.log.info("unpacking %s into %s (once per node)", image, target)
            proc = subprocess.run(
                [self.binary, "build", "--force", "--sandbox", str(partial), image],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            if proc.returncode != 0:
                shutil.rmtree(partial, ignore_errors=True)
                raise SandboxError(f"apptainer runtime: unpacking {image} failed: {proc.stdout[-1500:]}")
            self._warm_bytecode(partial)
            (partial / UNPACKED_MARK).write_text(f"{image}\n")
            os.rename(partial, target)  # whole or not at all, for readers that skip the lock


    def _warm_bytecode(self, copy: Path) -> None:
        """Compile, into the copy, the standard-library modules the tool server imports.

        Images built from distribution packages often ship no ``.pyc`` files
        (the packages' post-install step makes them), so every tool server
        start compiled argparse, re, enum, subprocess, ... from source: about
        half of a start's CPU. Importing them once, here, while the copy is
        still private and writable, leaves the bytecode beside the sources;
        sandboxes then read it (the copy is read-only to them). Best effort:
        an image without the interpreter keeps working, as slowly as before.
        """
        argv = [self.binary, "exec", "--writable", "--containall", "--no-home", "--no-mount", "cwd",
                "--net", "--network", "none", str(copy), self.python, "-I", "-S", "-", "--help"]
        try:
            with open(TOOLSERVER_PATH, "rb") as source:
                # The source on stdin: a --writable container cannot create a bind's mount point.
                proc = subprocess.run(argv, stdin=source, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.log.info("precompiling the tool server's modules in %s failed (%s); starts compile them", copy, e)
            return
        if proc.returncode != 0:
            self.log.info("precompiling the tool server's modules in %s failed (exit %d: %s); starts compile them",
                          copy, proc.returncode, proc.stderr.decode(errors="replace")[-300:].strip())


class ApptainerRuntime(Runtime):
    """Sandboxes as ``apptainer exec`` processes running the tool server."""

    name = "apptainer"

    def __init__(self, config: SandboxConfig, log: logging.Logger) -> None:
        super().__init__(config, log)
        self.binary = shutil.which("apptainer") or shutil.which("singularity")
        self.unpacked = UnpackedImages(unpacked_root(config), self.binary or "apptainer", log, config.python)
        self._run_image: dict[str, str] = {}  # SIF -> what sandboxes run (its unpacked copy)

    def check(self) -> None:
        if self.binary is None:
            raise SandboxError("apptainer runtime: neither apptainer nor singularity is on PATH")
        if os.geteuid() == 0 and not self.config.fakeroot:
            self.log.warning("apptainer runtime as root with sandbox.fakeroot off: sandboxes run as the host's uid 0 "
                             "(no capabilities) and can write the host's sysctls (/proc/sys) and the host files "
                             "Apptainer binds in (/etc/localtime); keep fakeroot on")

    def probe(self) -> None:
        """The binary runs, and this user may create user namespaces (rootless Apptainer needs them)."""
        assert self.binary is not None
        probe_command(self.name, [self.binary, "version"])
        try:
            max_ns = int(Path("/proc/sys/user/max_user_namespaces").read_text())
        except (OSError, ValueError):
            return  # not Linux-as-usual; let the first start tell
        if max_ns == 0:
            raise SandboxError("apptainer runtime: user namespaces are disabled (user.max_user_namespaces = 0)")
        if cfg_image_missing(self.config.image):
            raise SandboxError(f"apptainer runtime: sandbox.image {self.config.image!r} does not exist")

    async def prepare(self, spec: LaunchSpec) -> None:
        if Path(spec.image).is_file() and not fuse_usable() and self.config.unpack_cache:
            # /dev/fuse is closed to this user: run the node's one unpacked copy, not --unsquash per start.
            self._run_image[spec.image] = str(await self.unpacked.get(spec.image))

    def command(self, spec: LaunchSpec) -> list[str]:
        assert self.binary is not None
        cfg = self.config
        argv = [self.binary, "exec", "--containall", "--no-home", "--no-mount", "cwd"]
        image = self._run_image.get(spec.image, spec.image)
        if Path(image).is_file() and not fuse_usable():
            # /dev/fuse is closed to this user and the unpack cache is off: unpack at every start.
            argv.append("--unsquash")
        if cfg.fakeroot:
            argv.append("--fakeroot")
        elif os.geteuid() == 0:
            # Root without fakeroot: a user namespace still, never real root inside; without the
            # host's /sys (its uid 0 could write there, cgroups included).
            argv += ["--userns", "--no-mount", "sys"]
        if not spec.network:
            argv += ["--net", "--network", "none"]
        if cfg.writable == "overlay":
            overlay = spec.session_dir / "overlay"
            overlay.mkdir(parents=True, exist_ok=True)
            argv += ["--overlay", str(overlay)]
        elif cfg.writable == "tmpfs":
            # Sized by apptainer.conf's "sessiondir max size" (a site setting).
            argv.append("--writable-tmpfs")
        # /tmp, /var/tmp and /dev/shm in the session folder (under sandbox.disk_mb), not Apptainer's
        # unbounded tmpfs; with fakeroot the tool server mounts one bounded tmpfs over them.
        scratch = spec.session_dir / "scratch"
        (scratch / "shm").mkdir(parents=True, exist_ok=True)
        os.chmod(scratch / "shm", 0o1777)
        argv += ["--workdir", str(scratch), "--bind", f"{scratch / 'shm'}:/dev/shm"]
        argv += ["--bind", f"{spec.run_dir}:{INSIDE_RUN}"]
        argv += ["--bind", f"{TOOLSERVER_PATH}:{INSIDE_TOOLSERVER}:ro"]
        for mount in spec.mounts:
            argv += ["--bind", f"{mount.source}:{mount.target}:{'rw' if mount.writable else 'ro'}"]
        for key, value in spec.sandbox_env.items():
            argv += ["--env", f"{key}={value}"]
        argv += list(cfg.extra_args)
        # -I -S: the tool server needs only the standard library; skipping site-packages and the
        # user's environment trims its start-up, which 32 concurrent starts pay 32 times (its python
        # tool's worker is a separate interpreter with the image's full site).
        argv += [image, cfg.python, "-I", "-S", INSIDE_TOOLSERVER]
        # A fresh sysfs shows the sandbox's own network namespace (only lo);
        # mounting it needs root in the sandbox's user namespace.
        remount_sys = cfg.fakeroot and not spec.network
        argv += self.toolserver_argv(f"{INSIDE_RUN}/{SOCKET_NAME}", remount_sys=remount_sys, spec=spec)
        if cfg.fakeroot:
            argv += ["--scratch-mb", str(cfg.writable_size_mb), "--protect-host"]
        return argv
