"""The Runtime interface and what all runtimes share: launch, readiness, stop.

A runtime turns a :class:`LaunchSpec` into a command line that starts the
tool server inside an isolated environment. The sandbox process is started
in its own process group (session), reports readiness with one line on
stdout, and is stopped with SIGTERM to the group, then SIGKILL after a grace
period. Runtimes that use a PID namespace (Apptainer ``--containall``,
bubblewrap ``--unshare-pid``) take every process inside down with their
init; the group kill covers the rest. Without one (the local runtime) the
tool server is a child subreaper, so a command's double-forked daemon stays
its descendant, and stop kills the descendants it found as well.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prorl_cli.exceptions import SandboxError, SandboxTimeout
from prorl_cli.processes import descendants
from prorl_cli.sandbox.cgroups import SandboxCgroup
from prorl_cli.sandbox.options import Mount
from prorl_cli.sandbox.settings import SandboxConfig
from prorl_cli.sandbox.toolserver import READY_LINE

# Stdlib-only, so the watchdog runs it as a script too; one copy of the pidfd wait.
from prorl_cli.sandbox.watchdog import wait_gone

TOOLSERVER_PATH = Path(__file__).resolve().with_name("toolserver.py")
# Paths inside the sandbox: short, so the socket path stays far below ~108 bytes.
INSIDE_DIR = "/.prorl"
INSIDE_TOOLSERVER = f"{INSIDE_DIR}/toolserver.py"
INSIDE_RUN = f"{INSIDE_DIR}/run"
SOCKET_NAME = "ts.sock"
#: The model gateway's socket in the run directory (the node listens; the tool server's relay connects).
GATEWAY_SOCKET_NAME = "gw.sock"
# Unix socket paths longer than this fail (sun_path is 108 bytes with the NUL).
MAX_SOCKET_PATH_BYTES = 100
LOOPBACK_ENV = "PRORL_LOOPBACK_IP"
# How long stop waits for a killed sandbox's processes to disappear.
STOP_WAIT_S = 30.0
#: How long a start that did not print the ready line waits for the runtime's exit code.
NOT_READY_EXIT_WAIT_S = 5.0
#: The node's environment variables an isolating runtime's own process gets (nothing else: the
#: runtime's parent process is visible inside, bubblewrap's as /proc/1/environ, and Apptainer turns
#: APPTAINERENV_* into the sandbox's variables and APPTAINER_BIND into binds).
RUNTIME_ENV_KEEP = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
                    "XDG_RUNTIME_DIR", "APPTAINER_CACHEDIR", "APPTAINER_TMPDIR", "APPTAINER_CONFIGDIR",
                    "SINGULARITY_CACHEDIR", "SINGULARITY_TMPDIR")
#: Joins the sandbox's cgroup(s) before the runtime starts (so everything it forks is inside):
#: ``sh -c CGROUP_JOIN prorl-cgroup PROCS_FILE... -- ARGV...``.
CGROUP_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass
class LaunchSpec:
    """Everything a runtime needs to start one sandbox."""

    sandbox_id: str
    image: str
    network: bool
    session_dir: Path  # node-local, short: holds run/ (bound inside) and the writable layer
    loopback_ip: str
    config: SandboxConfig
    env: dict[str, str] = field(default_factory=dict)
    #: Host paths bound in (``Mount``); only isolating runtimes honour them.
    mounts: list[Mount] = field(default_factory=list)
    #: The sandbox's cgroup(s), where the node makes them: the runtime starts inside.
    cgroup: SandboxCgroup | None = None

    @property
    def run_dir(self) -> Path:
        """The only host directory bound into the sandbox (read-write): the socket lives here."""
        return self.session_dir / "run"

    @property
    def socket_path(self) -> Path:
        return self.run_dir / SOCKET_NAME

    @property
    def log_path(self) -> Path:
        return self.session_dir / "sandbox.log"

    @property
    def sandbox_env(self) -> dict[str, str]:
        return {LOOPBACK_ENV: self.loopback_ip, **self.env}


def proc_start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None if it is gone.

    With the pid it identifies a process for good: a recycled pid has a
    different start time.
    """
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 0 is the state), or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None  # it ended while we looked
    # Field 2 (comm) may hold spaces and parentheses: split after its last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def _members(field: int, value: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(entry)
            if fields is not None and int(fields[field]) == value:
                members.append(int(entry))
    return members


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid`` (zombies included)."""
    return _members(2, pgid)


def session_members(sid: int) -> list[int]:
    """Pids in session ``sid``.

    A sandbox is started as a session leader, so everything its runtime
    forks stays in its session even when it makes process groups of its own
    (Apptainer's squashfuse and fuse-overlayfs helpers do). The kernel does
    not reuse a pid while it names a live session, so while one member is
    left, the session is still the sandbox's.
    """
    return _members(3, sid)


def kill_session(sid: int) -> list[int]:
    """SIGKILL every member of session ``sid``; return the pids signalled."""
    members = session_members(sid)
    for pid in members:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return members


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, as the host sees them."""
    return [pid, *descendants(pid)]


def remove_tree(path: Path, log: logging.Logger) -> None:
    """Remove a session directory, including overlay work dirs the kernel left mode 000."""
    if not path.exists():
        return

    # The kernel leaves overlay work directories mode 000: open them up first
    # (os.walk descends only after yielding, so the chmod comes in time).
    for root, dirs, _files in os.walk(path):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, d), stat.S_IRWXU)
    try:
        shutil.rmtree(path)
    except OSError as e:
        # Files created inside under another uid belong to a subordinate id:
        # remove them from a user namespace that maps those ids.
        if shutil.which("unshare") and os.geteuid() != 0:
            subprocess.run(
                ["unshare", "--user", "--map-root-user", "--map-auto", "rm", "-rf", str(path)],
                check=False, capture_output=True,
            )
        if path.exists():
            log.warning("could not remove sandbox directory %s: %s", path, e)


class SandboxProcess:
    """The running sandbox: its process group and how to stop it."""

    def __init__(
        self, proc: asyncio.subprocess.Process, spec: LaunchSpec, log: logging.Logger, *, term_leader: bool = True
    ) -> None:
        self.proc = proc
        self.spec = spec
        self.pid = proc.pid
        self.pgid = proc.pid  # started as a session leader
        self.start_ticks = proc_start_ticks(proc.pid)
        self.term_leader = term_leader
        self._log = log

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the group, SIGKILL it after ``grace_s``, then remove the session directory.

        Returns when every process of the sandbox is gone: with a PID
        namespace, its init exits only after all processes inside have.
        """
        descendants_now = {pid: proc_start_ticks(pid) for pid in process_tree(self.pid)}
        tree = set(descendants_now) | set(session_members(self.pid))
        tree |= set(await terminate_group(self.proc, self.pgid, grace_s, term_leader=self.term_leader))
        # Descendants that left the session (a daemon's setsid), orphaned now that the sandbox is gone: the
        # same processes (pid and start time) still running get SIGKILL too.
        for pid, ticks in descendants_now.items():
            if ticks is not None and proc_start_ticks(pid) == ticks:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        cgroup = self.spec.cgroup
        if cgroup is not None:
            # Whatever is in the sandbox's cgroup is the sandbox's, whichever session it made for itself.
            tree |= set(await asyncio.to_thread(cgroup.kill))
        left = await asyncio.to_thread(wait_gone, sorted(tree), STOP_WAIT_S)
        if left:
            self._log.warning("sandbox %s: processes %s still running %.0f s after SIGKILL",
                              self.spec.sandbox_id, left, STOP_WAIT_S)
        if cgroup is not None:
            for path in await asyncio.to_thread(cgroup.remove):
                self._log.warning("sandbox %s: could not remove its cgroup %s", self.spec.sandbox_id, path)
        remove_tree(self.spec.session_dir, self._log)


def probe_command(name: str, argv: list[str], timeout_s: float = 20.0) -> None:
    """Run a short command that shows whether a runtime works here; raise :class:`SandboxError` if not."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxError(f"{name} runtime: {' '.join(argv)} failed: {e}") from e
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace").strip()[-300:]
        raise SandboxError(f"{name} runtime does not work for this user ({' '.join(argv)}: exit {done.returncode}: {tail})")


async def terminate_group(
    proc: asyncio.subprocess.Process, pgid: int, grace_s: float, *, term_leader: bool = True
) -> list[int]:
    """Stop a process group (and session) we started: SIGTERM, wait up to ``grace_s``, SIGKILL.

    With ``term_leader=False`` the SIGTERM goes to the group's other members
    only: the leader is expected to exit (and reap them) once they have.
    Returns the session members that were still there for the final SIGKILL.
    """
    if term_leader:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    else:
        for pid in group_members(pgid):
            if pid != proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
    # A timeout means it ignored SIGTERM: SIGKILL below.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace_s):
            await proc.wait()
    # Kill the group and the session even when the leader exited: stragglers
    # (helpers in groups of their own) may remain in them.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    stragglers = kill_session(pgid)
    await proc.wait()
    return stragglers


class Runtime(abc.ABC):
    """Starts sandboxes of one kind. Subclasses build the command line."""

    name = ""
    #: False only for :class:`~prorl_cli.sandbox.local.LocalRuntime`.
    isolated = True
    #: Whether stop sends SIGTERM to the group leader too (see :func:`terminate_group`).
    term_leader = True

    def __init__(self, config: SandboxConfig, log: logging.Logger) -> None:
        self.config = config
        self.log = log

    @abc.abstractmethod
    def check(self) -> None:
        """Raise :class:`SandboxError` naming what is missing if this runtime cannot run here."""

    def probe(self) -> None:
        """Raise :class:`SandboxError` unless this runtime actually works for this user (``auto`` asks).

        Default: :meth:`check`; runtimes that can fail past their binary (namespaces) try it.
        """
        self.check()

    @abc.abstractmethod
    def command(self, spec: LaunchSpec) -> list[str]:
        """The argv that starts the tool server inside a new sandbox."""

    async def prepare(self, spec: LaunchSpec) -> None:  # noqa: B027 (optional hook)
        """Make what :meth:`command` needs before the start (Apptainer: the node's unpacked image)."""

    def resolve_image(self, image: str | None) -> str:
        """The image to use: the given one or the configured default, checked to exist."""
        chosen = image or self.config.image
        if not chosen:
            raise SandboxError(
                f"{self.name} runtime: no image given and sandbox.image is empty in the configuration"
            )
        if chosen != "host" and not Path(chosen).exists():
            raise SandboxError(f"{self.name} runtime: image {chosen!r} does not exist")
        return chosen

    def toolserver_argv(self, socket_path: str, *, remount_sys: bool = False, spec: LaunchSpec | None = None) -> list[str]:
        """Arguments after the interpreter: the tool server, its socket and the limits (the sandbox's own, from ``spec``)."""
        limits = spec.config if spec is not None else self.config
        argv = [
            "--socket", socket_path,
            "--mem-gb", str(limits.mem_gb),
            # RLIMIT_NPROC counts a user's processes in its user namespace: a sandbox's own ones under Apptainer
            # and bubblewrap, every process of the node's user on the host without isolation, where it would
            # make the sandboxes' forks fail for processes that are not theirs. Not applied there.
            "--max-procs", str(limits.max_procs if self.isolated else 0),
            "--max-file-mb", str(limits.disk_mb),
        ]
        if remount_sys:
            argv.append("--remount-sys")
        return argv

    async def start(
        self, spec: LaunchSpec, on_spawn: Callable[[SandboxProcess], None] | None = None
    ) -> SandboxProcess:
        """Launch the sandbox and wait until its tool server accepts connections.

        ``on_spawn`` runs as soon as the process exists (before readiness), so
        the node can record it before anything can go wrong.
        """
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        if len(str(spec.socket_path).encode()) > MAX_SOCKET_PATH_BYTES:
            raise SandboxError(
                f"socket path {spec.socket_path} is longer than {MAX_SOCKET_PATH_BYTES} bytes; "
                "set sandbox.local_dir to a shorter directory"
            )
        await self.prepare(spec)
        argv = self.command(spec)
        self.log.debug("sandbox %s: %s", spec.sandbox_id, " ".join(argv))
        if spec.cgroup is not None:
            argv = ["/bin/sh", "-c", CGROUP_JOIN, "prorl-cgroup", *map(str, spec.cgroup.procs_files), "--", *argv]
        with open(spec.log_path, "ab") as log_file:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log_file,
                    start_new_session=True,  # its own process group: stop kills the group
                    env=self.host_env(spec),
                )
            except OSError as e:
                raise SandboxError(f"{self.name} runtime: cannot run {argv[0]}: {e}") from e
        handle = SandboxProcess(proc, spec, self.log, term_leader=self.term_leader)
        try:
            if on_spawn is not None:
                on_spawn(handle)
            await self._wait_ready(proc, spec)
        except BaseException:
            await terminate_group(proc, handle.pgid, 0.5, term_leader=self.term_leader)
            raise
        return handle

    def host_env(self, spec: LaunchSpec) -> dict[str, str]:
        """Environment of the runtime process on the host (the sandbox's own is set by flags).

        Only :data:`RUNTIME_ENV_KEEP` of the node's: its secrets (API tokens, ``PRORL_*``) stay out of
        reach of the sandbox, which can read its runtime's initial environment (``/proc/1/environ``).
        """
        return {k: v for k, v in os.environ.items() if k in RUNTIME_ENV_KEEP}

    async def _wait_ready(self, proc: asyncio.subprocess.Process, spec: LaunchSpec) -> None:
        assert proc.stdout is not None
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.config.start_timeout_s):
                line = await proc.stdout.readline()
        except TimeoutError as e:
            raise SandboxTimeout(
                f"{self.name} sandbox {spec.sandbox_id} not ready after {self.config.start_timeout_s:.0f} s; "
                f"log tail:\n{self._log_tail(spec)}"
            ) from e
        if not line.startswith(READY_LINE.encode()):
            # It printed something else (or closed stdout): its exit code, if it exits; one that runs on is
            # stopped by the caller. Never an unbounded wait, which would hold a start slot for good.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(NOT_READY_EXIT_WAIT_S):
                    await proc.wait()
            if line and proc.returncode is None:
                raise SandboxError(
                    f"{self.name} sandbox {spec.sandbox_id} printed {line[:200]!r} instead of its ready line "
                    f"(image {spec.image}); log tail:\n{self._log_tail(spec)}"
                )
            tail = self._log_tail(spec)
            hint = ""
            if self.config.python in tail and ("not found" in tail or "No such file" in tail):
                hint = (f"the image has no {self.config.python!r} (the tool server needs python3 >= 3.8 "
                        "in the image; set sandbox.python if it is elsewhere); ")
            raise SandboxError(
                f"{self.name} sandbox {spec.sandbox_id} failed to start (exit code {proc.returncode}, "
                f"image {spec.image}): {hint}log tail:\n{tail}"
            )
        self.log.debug("sandbox %s ready in %.3f s", spec.sandbox_id, time.monotonic() - started)

    @staticmethod
    def _log_tail(spec: LaunchSpec, n_bytes: int = 2000) -> str:
        try:
            data = spec.log_path.read_bytes()
        except FileNotFoundError:
            return "(no log)"
        return data[-n_bytes:].decode("utf-8", "replace").strip() or "(empty log)"
