"""bubblewrap: rootless sandboxes with millisecond start, for hosts without Apptainer.

The image is a root filesystem directory (an unpacked image) or ``"host"``:
the host's /usr, read-only, with the usual /bin, /lib links. The image is
bound read-only; the writable layer is a tmpfs root of ``writable_size_mb``
holding /tmp, /root, /home (and with ``host``, /var/tmp) as plain directories,
so they share one budget; /dev/shm is a second tmpfs of that size and /dev
itself is read-only (bubblewrap 0.8.0, Debian 12's, has no ``--overlay``;
newer releases do, and an overlay over the whole image is a possible extension).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from prorl_cli.exceptions import SandboxError
from prorl_cli.sandbox.runtime import (
    INSIDE_DIR,
    INSIDE_RUN,
    INSIDE_TOOLSERVER,
    SOCKET_NAME,
    TOOLSERVER_PATH,
    LaunchSpec,
    Runtime,
    probe_command,
)
from prorl_cli.sandbox.settings import SandboxConfig

_WRITABLE_DIRS = ("/tmp", "/root", "/home", "/var/tmp")


class BwrapRuntime(Runtime):
    """Sandboxes as ``bwrap`` processes running the tool server."""

    name = "bwrap"
    # bwrap's outer process dies at once on SIGTERM, and the pid-namespace
    # init below it is left for the host's init to reap (a zombie where that
    # init does not). Stop signals the processes inside instead: the tool
    # server exits, then bwrap's init, then bwrap, each reaping the one below.
    term_leader = False

    def __init__(self, config: SandboxConfig, log: logging.Logger) -> None:
        super().__init__(config, log)
        self.binary = shutil.which("bwrap")

    def check(self) -> None:
        if self.binary is None:
            raise SandboxError("bwrap runtime: bwrap (bubblewrap) is not on PATH")

    def resolve_image(self, image: str | None) -> str:
        """The image, which bubblewrap needs as a folder (a root filesystem), not an Apptainer ``.sif`` file."""
        chosen = super().resolve_image(image)
        if chosen != "host" and not Path(chosen).is_dir():
            raise SandboxError(f"bwrap runtime: image {chosen!r} is a file; bubblewrap runs a folder image (a root "
                               "filesystem): use sandbox.runtime: apptainer for .sif images, or unpack one with "
                               f"`apptainer build --sandbox DIR {chosen}`")
        return chosen

    def probe(self) -> None:
        """Unprivileged user namespaces may be off (sysctl, AppArmor): try a no-op sandbox."""
        assert self.binary is not None
        noop = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"
        probe_command(self.name, [self.binary, "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev",
                                  "--proc", "/proc", noop])

    def command(self, spec: LaunchSpec) -> list[str]:
        assert self.binary is not None
        cfg = self.config
        argv = [self.binary, "--die-with-parent", "--unshare-all", "--uid", "0", "--gid", "0"]
        if spec.network:
            argv.append("--share-net")
        size = ["--size", str(cfg.writable_size_mb * 1024 * 1024)]
        # bwrap's own root tmpfs has no size: a sized tmpfs over it is the writable layer, and the
        # scratch directories are directories of it (one budget, writable_size_mb, for all of them).
        argv += [*size, "--tmpfs", "/"]
        read_only_root = cfg.writable == "none"
        scratch: list[str] = []
        if spec.image == "host":
            # The writable layer, with /usr read-only.
            argv += ["--ro-bind", "/usr", "/usr"]
            for link in ("bin", "lib", "lib64", "sbin"):
                if Path(f"/{link}").is_symlink():
                    argv += ["--symlink", f"usr/{link}", f"/{link}"]
            scratch = list(_WRITABLE_DIRS)
        else:
            # Bind each top-level entry of the image read-only onto the root
            # (so /.prorl can still be created); the usual scratch directories are the root's own.
            writable = set(_WRITABLE_DIRS) if not read_only_root else {"/tmp"}
            for entry in sorted(Path(spec.image).iterdir()):
                target = f"/{entry.name}"
                if entry.is_symlink():
                    argv += ["--symlink", os.readlink(entry), target]
                elif target in writable and entry.is_dir():
                    scratch.append(target)
                elif target not in ("/dev", "/proc"):
                    argv += ["--ro-bind", str(entry), target]
        for d in scratch:
            if read_only_root:
                argv += [*size, "--tmpfs", d]  # the root is made read-only below: a tmpfs of its own
            else:
                argv += ["--dir", d]
            if d.endswith("tmp"):
                argv += ["--chmod", "1777", d]
        # bwrap's /dev is a tmpfs without a size: read-only, with a sized tmpfs for /dev/shm.
        argv += ["--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--chmod", "1777", "/dev/shm", "--remount-ro", "/dev"]
        # Run by root, the sandbox's uid 0 is the host's: its sysctls read-only (bwrap covers only /proc/irq, /proc/bus).
        argv += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys",
                 "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger"]
        argv += ["--dir", INSIDE_DIR]
        argv += ["--bind", str(spec.run_dir), INSIDE_RUN]
        argv += ["--ro-bind", str(TOOLSERVER_PATH), INSIDE_TOOLSERVER]
        for mount in spec.mounts:
            argv += ["--bind" if mount.writable else "--ro-bind", mount.source, mount.target]
        if read_only_root:
            argv += ["--remount-ro", "/"]
        argv += ["--clearenv", "--setenv", "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        argv += ["--setenv", "HOME", "/root", "--chdir", "/root" if spec.image == "host" else "/"]
        for key, value in spec.sandbox_env.items():
            argv += ["--setenv", key, value]
        argv += list(cfg.extra_args)
        argv += [cfg.python, INSIDE_TOOLSERVER]
        argv += self.toolserver_argv(f"{INSIDE_RUN}/{SOCKET_NAME}", spec=spec)
        return argv
