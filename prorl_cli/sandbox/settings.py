"""The ``sandbox`` section of prorl.yaml (owned by the sandbox subsystem)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from prorl_cli.exceptions import ConfigError


@dataclass
class SandboxConfig:
    """How node servers start sandboxes for handlers.

    ``runtime``: ``auto`` (the default: Apptainer when it works for this
    user, else bubblewrap, else ``local`` with its warning; the node logs
    which it picked), ``apptainer``, ``bwrap`` (bubblewrap, for hosts without
    Apptainer) or ``local`` (no isolation at all; for development only, and
    every start says so in the log).
    """

    runtime: Literal["auto", "apptainer", "bwrap", "local"] = "auto"
    # Default image when a handler names none: a .sif file or a sandbox
    # directory (apptainer), a root filesystem directory or "host" (bwrap:
    # the host's /usr, read-only). Unused by the local runtime.
    image: str = ""
    # Apptainer --fakeroot: root inside, mapped to the user's subordinate ids.
    # Also lets the sandbox mount a fresh /sys that shows only its own network.
    fakeroot: bool = True
    # Give sandboxes the host's network by default (a task can still ask).
    network: bool = False
    # The writable layer over the image: "overlay" (a directory per sandbox
    # under local_dir, removed on stop), "tmpfs" (in memory, writable_size_mb),
    # or "none" (read-only image; only /tmp is writable).
    writable: Literal["overlay", "tmpfs", "none"] = "overlay"
    # Size of each sandbox's in-memory scratch (tmpfs): bubblewrap's root (with /tmp,
    # /root, /home) and /dev/shm; Apptainer's /tmp, /var/tmp and /dev/shm (fakeroot).
    writable_size_mb: int = 1024
    # Per-sandbox limits; 0 means no limit (docs/sandbox.md, "Limits").
    # Address space of each process (RLIMIT_AS); the whole sandbox's with a memory cgroup, else as measured.
    mem_gb: float = 4.0
    max_procs: int = 512  # processes and threads (RLIMIT_NPROC per user namespace; a pids cgroup where available)
    wall_s: float = 0.0  # a sandbox older than this is stopped
    # Disk under local_dir (overlay, run directory, log): a sandbox over it is stopped (checked every
    # disk_check_s); no single file may be larger (RLIMIT_FSIZE).
    disk_mb: int = 10240
    disk_check_s: float = 5.0
    # Where no memory cgroup bounds a sandbox (rootless without delegation), the node sums its processes'
    # private memory every memory_check_s and stops a sandbox over mem_gb (docs/sandbox.md, "Limits").
    memory_check_s: float = 1.0
    # A bash command that prints more than this is interrupted (what comes back is max_output_bytes).
    output_limit_mb: float = 256.0
    # Per-sandbox pids and memory cgroups where this node may make them (root, or a delegated cgroup v2).
    cgroups: bool = True
    # Sandboxes starting at once per node (mass starts on shared filesystems stall).
    max_concurrent_starts: int = 8
    start_timeout_s: float = 120.0
    stop_grace_s: float = 5.0  # SIGTERM, then SIGKILL after this long
    # Node-local directory for sockets and writable layers (short path: Unix
    # socket paths break past ~108 bytes). Empty: $TMPDIR or /tmp, plus /prorl-<uid>.
    local_dir: str = ""
    # Tool defaults.
    tool_timeout_s: float = 120.0
    max_output_bytes: int = 64 * 1024
    # Extra arguments for the runtime's command line (site specifics).
    extra_args: list[str] = field(default_factory=list)
    # Apptainer without FUSE: unpack each SIF once per node and share that read-only
    # copy (false: --unsquash at every start, the whole image each time).
    unpack_cache: bool = True
    # python3 inside the image that runs the tool server.
    python: str = "python3"

    def validate(self, where: str = "sandbox") -> None:
        """Reject values that cannot work; the message names the key (called by the config loader)."""
        positive = {
            "writable_size_mb": self.writable_size_mb, "max_concurrent_starts": self.max_concurrent_starts,
            "start_timeout_s": self.start_timeout_s, "tool_timeout_s": self.tool_timeout_s,
            "max_output_bytes": self.max_output_bytes, "disk_check_s": self.disk_check_s,
            "output_limit_mb": self.output_limit_mb, "memory_check_s": self.memory_check_s,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{where}.{key}: must be positive, got {value}")
        for key, value in {"mem_gb": self.mem_gb, "max_procs": self.max_procs, "wall_s": self.wall_s,
                           "disk_mb": self.disk_mb, "stop_grace_s": self.stop_grace_s}.items():
            if value < 0:
                raise ConfigError(f"{where}.{key}: must be 0 (no limit) or positive, got {value}")
        if 0 < self.max_procs < 16:
            raise ConfigError(f"{where}.max_procs: {self.max_procs} is too few for a shell and the tool server "
                              "(use 16 or more, or 0 for no limit)")
        if not self.python:
            raise ConfigError(f"{where}.python: must name the interpreter inside the image")
