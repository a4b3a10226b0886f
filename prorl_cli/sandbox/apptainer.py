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

import logging
import os
import shutil
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


class ApptainerRuntime(Runtime):
    """Sandboxes as ``apptainer exec`` processes running the tool server."""

    name = "apptainer"

    def __init__(self, config: SandboxConfig, log: logging.Logger) -> None:
        super().__init__(config, log)
        self.binary = shutil.which("apptainer") or shutil.which("singularity")

    def check(self) -> None:
        if self.binary is None:
            raise SandboxError("apptainer runtime: neither apptainer nor singularity is on PATH")

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

    def command(self, spec: LaunchSpec) -> list[str]:
        assert self.binary is not None
        cfg = self.config
        argv = [self.binary, "exec", "--containall", "--no-home", "--no-mount", "cwd"]
        if Path(spec.image).is_file() and not fuse_usable():
            # /dev/fuse is closed to this user: unpack the SIF to a temporary sandbox.
            argv.append("--unsquash")
        if cfg.fakeroot:
            argv.append("--fakeroot")
        elif os.geteuid() == 0:
            # Root without fakeroot: a user namespace still, never real root inside.
            argv.append("--userns")
        if not spec.network:
            argv += ["--net", "--network", "none"]
        if cfg.writable == "overlay":
            overlay = spec.session_dir / "overlay"
            overlay.mkdir(parents=True, exist_ok=True)
            argv += ["--overlay", str(overlay)]
        elif cfg.writable == "tmpfs":
            # Sized by apptainer.conf's "sessiondir max size" (a site setting).
            argv.append("--writable-tmpfs")
        argv += ["--bind", f"{spec.run_dir}:{INSIDE_RUN}"]
        argv += ["--bind", f"{TOOLSERVER_PATH}:{INSIDE_TOOLSERVER}:ro"]
        for key, value in spec.sandbox_env.items():
            argv += ["--env", f"{key}={value}"]
        argv += list(cfg.extra_args)
        argv += [spec.image, cfg.python, INSIDE_TOOLSERVER]
        # A fresh sysfs shows the sandbox's own network namespace (only lo);
        # mounting it needs root in the sandbox's user namespace.
        remount_sys = cfg.fakeroot and not spec.network
        argv += self.toolserver_argv(f"{INSIDE_RUN}/{SOCKET_NAME}", remount_sys=remount_sys)
        return argv
