"""SandboxManager: one per node server; starts, tracks, stops and reaps sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import SandboxError
from prorl_cli.sandbox.apptainer import ApptainerRuntime, cfg_image_missing
from prorl_cli.sandbox.bwrap import BwrapRuntime
from prorl_cli.sandbox.cgroups import PREFIX as CGROUP_PREFIX
from prorl_cli.sandbox.cgroups import CgroupParents, SandboxCgroup, find_parents
from prorl_cli.sandbox.client import ToolClient
from prorl_cli.sandbox.local import LocalRuntime
from prorl_cli.sandbox.loopback import LoopbackAllocator
from prorl_cli.sandbox.memory import tree_memory
from prorl_cli.sandbox.options import Mount, SandboxLimits
from prorl_cli.sandbox.records import RecordStore, SandboxRecord, boot_id
from prorl_cli.sandbox.runtime import (
    LaunchSpec,
    Runtime,
    SandboxProcess,
    proc_start_ticks,
    remove_tree,
)
from prorl_cli.sandbox.sandbox import Sandbox
from prorl_cli.sandbox.settings import SandboxConfig

WATCHDOG_PATH = Path(__file__).resolve().with_name("watchdog.py")
RUNTIMES: dict[str, type[Runtime]] = {
    "apptainer": ApptainerRuntime,
    "bwrap": BwrapRuntime,
    "local": LocalRuntime,
}
_START_OPTIONS = {"env", "mounts", "limits"}
#: SIGTERM-to-SIGKILL grace for a sandbox that started but never served a tool call (nothing in it to save).
NOT_SERVING_STOP_GRACE_S = 0.5


#: What ``sandbox.runtime: auto`` tries, in order; ``local`` (no isolation) is the last resort.
AUTO_ORDER = ("apptainer", "bwrap")


def make_runtime(config: SandboxConfig, log: logging.Logger) -> Runtime:
    """The runtime ``config.runtime`` names (``auto``: the first that works here), checked to be usable.

    ``auto`` falls back to the unisolated ``local`` runtime only off Slurm; inside a Slurm job
    (``SLURM_JOB_ID`` set) it raises :class:`SandboxError` instead, naming what is missing.
    """
    config.validate()
    if config.runtime == "auto":
        return _auto_runtime(config, log)
    try:
        cls = RUNTIMES[config.runtime]
    except KeyError as e:
        raise SandboxError(
            f"sandbox.runtime: unknown runtime {config.runtime!r}; known: {['auto', *sorted(RUNTIMES)]}"
        ) from e
    runtime = cls(config, log)
    runtime.check()
    if runtime.isolated and cfg_image_missing(config.image):
        # Said at the node's start: each job that names no image of its own would fail its INIT on it.
        log.warning("sandbox.image %r does not exist: every job that names no image of its own will fail in INIT",
                    config.image)
    return runtime


def _auto_runtime(config: SandboxConfig, log: logging.Logger) -> Runtime:
    reasons = []
    for name in AUTO_ORDER:
        runtime = RUNTIMES[name](config, log)
        try:
            runtime.check()
            runtime.probe()
        except SandboxError as e:
            reasons.append(str(e))
            continue
        if reasons:  # a runtime earlier in the order did not work: why (a typo in sandbox.image, say) is worth a look
            log.warning("sandbox.runtime auto: using %s (%s)", name, "; ".join(reasons))
        else:
            log.info("sandbox.runtime auto: using %s", name)
        return runtime
    if os.environ.get("SLURM_JOB_ID"):
        # A cluster's jobs share nodes with other users' work: running agent code unisolated there is
        # a decision for the operator to write down, never a silent fallback.
        raise SandboxError(
            "sandbox.runtime auto: no isolating runtime works on this Slurm node (" + "; ".join(reasons)
            + "); install or enable apptainer or bwrap (bubblewrap) here, or set sandbox.runtime: local "
            "to run without isolation on purpose"
        )
    log.warning("sandbox.runtime auto: no isolating runtime works here (%s); falling back to the LOCAL runtime, "
                "which does NOT isolate anything", "; ".join(reasons))
    return LocalRuntime(config, log)


def default_local_dir(config: SandboxConfig) -> Path:
    """Node-local directory for sockets and writable layers (short, per user)."""
    if config.local_dir:
        return Path(os.path.expandvars(os.path.expanduser(config.local_dir)))
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"prorl-{os.getuid()}"


#: How long one disk measurement of the live sandboxes may take before it is abandoned.
DISK_MEASURE_TIMEOUT_S = 120.0


async def disk_usage(paths: list[Path]) -> dict[str, int]:
    """Bytes of disk each directory uses (``du``; a path that is gone is left out).

    A subprocess, not a walk in this process: it costs the node's event loop
    nothing. Not as root, ``du`` runs in a user namespace that maps this user's
    subordinate ids (as :func:`remove_tree` does), so it also counts what a
    fakeroot sandbox made under another uid and closed to others (``chmod 700``).
    """
    if not paths:
        return {}
    argv = ["du", "-s", "-B1", "-x", *map(str, paths)]
    if os.geteuid() != 0 and shutil.which("unshare") and shutil.which("newuidmap"):
        argv = ["unshare", "--user", "--map-root-user", "--map-auto", *argv]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )
    except OSError as e:
        raise SandboxError(f"cannot measure the sandboxes' disk use ({argv[0]}: {e})") from e
    try:
        async with asyncio.timeout(DISK_MEASURE_TIMEOUT_S):
            out, _ = await proc.communicate()
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return {}
    usage = {}
    for line in out.decode(errors="replace").splitlines():
        size, _, path = line.partition("\t")
        if size.isdigit():
            usage[path] = int(size)
    return usage


def _mount(value: Any) -> Mount:
    if not isinstance(value, Mount):
        raise SandboxError(f"sandbox option mounts takes Mount(source, target) objects, got {value!r}")
    return value.check()


class SandboxManager:
    """Starts sandboxes in the configured runtime for one node server.

    ``state_dir`` is the node's run directory: the record of started
    sandboxes lives in ``state_dir/sandboxes/``. A per-node watchdog process
    (:mod:`prorl_cli.sandbox.watchdog`) kills the sandboxes as soon as this
    process dies, however it dies; any node started later on the host, under
    any node id, removes what the dead one recorded (``reap_leftovers``).
    """

    def __init__(self, config: SandboxConfig, state_dir: Path, log: logging.Logger) -> None:
        self.config = config
        self.log = log
        self.runtime = make_runtime(config, log)
        self.records = RecordStore(Path(state_dir) / "sandboxes", log)
        self.local_dir = default_local_dir(config)
        self.loopback = LoopbackAllocator.for_node(str(Path(state_dir).resolve()))
        self._starts = asyncio.Semaphore(max(1, config.max_concurrent_starts))
        self._live: dict[str, Sandbox] = {}
        self._wall_timers: dict[str, asyncio.TimerHandle] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._boot_id = boot_id()
        self._owner = (os.getpid(), proc_start_ticks(os.getpid()))
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._sessions: dict[str, int] = {}  # sandbox id -> its session id, as the watchdog knows them
        self._disk_watch: asyncio.Task[None] | None = None
        self._memory_watch: asyncio.Task[None] | None = None
        self.cgroups = self._find_cgroups()

    def _find_cgroups(self) -> CgroupParents | None:
        """Where this node makes its sandboxes' cgroups (``None``: nowhere; the rlimits alone apply)."""
        if not self.runtime.isolated:
            return None
        parents, why = find_parents() if self.config.cgroups else (None, "sandbox.cgroups is off")
        if parents is not None:
            self.log.info("sandbox limits: rlimits, and a cgroup per sandbox (%s)", parents.describe())
            return parents
        if os.geteuid() == 0 and self.config.max_procs > 0:
            self.log.warning(
                "sandbox.max_procs is NOT enforced: this node runs as root, the kernel exempts uid 0 from "
                "RLIMIT_NPROC, and no pids cgroup can be made (%s); a fork bomb in a sandbox is bounded only "
                "by the host (run the node as an ordinary user, or let it make cgroups)", why)
        else:
            self.log.info("sandbox limits: rlimits only, no per-sandbox cgroups (%s); the node measures each "
                          "sandbox's memory every %g s (sandbox.memory_check_s) against sandbox.mem_gb",
                          why, self.config.memory_check_s)
        return None

    @property
    def live(self) -> list[Sandbox]:
        """Sandboxes started and not yet stopped."""
        return list(self._live.values())

    def reap_leftovers(self) -> int:
        """Kill and clean what dead nodes left: in this run dir, and of dead owners in sibling run dirs.

        Returns how many sandboxes still ran.
        """
        return self.records.reap() + self.records.reap_orphans(self.records.directory.parent.parent)

    def _tell_watchdog(self, line: str) -> None:
        """Tell the watchdog of a sandbox session (starting it on first use)."""
        if self._watchdog is None or self._watchdog.poll() is not None:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-I", str(WATCHDOG_PATH)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                start_new_session=True,  # a kill of the node's process group must leave it standing
            )
        assert self._watchdog.stdin is not None
        try:
            self._watchdog.stdin.write(line.encode())
            self._watchdog.stdin.flush()
        except BrokenPipeError as e:
            raise SandboxError("the sandbox watchdog process is gone") from e

    async def start(
        self, job_id: str, *, image: str | None = None, network: bool | None = None, **options: Any
    ) -> Sandbox:
        """Start a sandbox for ``job_id`` and return it once its tool server answers.

        ``image`` defaults to ``sandbox.image``; ``network`` to ``sandbox.network``
        (off: the sandbox has only its own loopback). ``env`` adds environment
        variables; ``mounts`` (:class:`~prorl_cli.sandbox.options.Mount`) binds
        host paths in (isolating runtimes only); ``limits``
        (:class:`~prorl_cli.sandbox.options.SandboxLimits`) replaces the node's
        per-sandbox limits. At most ``sandbox.max_concurrent_starts`` starts run at once.
        """
        unknown = set(options) - _START_OPTIONS
        if unknown:
            raise SandboxError(f"unknown sandbox option(s) {sorted(unknown)}; known: {sorted(_START_OPTIONS)}")
        env = options.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise SandboxError(f"sandbox option env must map str to str, got {env!r}")
        mounts = [_mount(m) for m in options.get("mounts") or ()]
        if mounts and self.runtime.name == "local":
            raise SandboxError("the local runtime runs on the host and cannot bind mounts; use bwrap or apptainer")
        config = self.config
        limits = options.get("limits")
        if limits is not None:
            if not isinstance(limits, SandboxLimits):
                raise SandboxError(f"sandbox option limits must be a SandboxLimits, got {limits!r}")
            changed = {k: v for k, v in dataclasses.asdict(limits.check()).items() if v is not None}
            config = dataclasses.replace(config, **changed)
        resolved_image = self.runtime.resolve_image(image)
        sandbox_id = secrets.token_hex(5)
        self._check_local_dir()
        spec = LaunchSpec(
            sandbox_id=sandbox_id,
            image=resolved_image,
            network=self.config.network if network is None else bool(network),
            session_dir=self.local_dir / sandbox_id,
            loopback_ip=self.loopback.allocate(),
            config=config,
            env=dict(env),
            mounts=mounts,
        )
        parents = self.cgroups if config.max_procs > 0 or config.mem_gb > 0 else None
        planned = [str(d / f"{CGROUP_PREFIX}{sandbox_id}") for d in parents.dirs] if parents is not None else []
        # Recorded before the runtime makes the session folder (and the cgroups): a node killed mid-start
        # leaves them to be reaped.
        self.records.write(self._new_record(sandbox_id, job_id, spec.session_dir, planned))
        started: SandboxProcess | None = None
        try:
            if parents is not None:
                spec.cgroup = self._make_cgroup(sandbox_id, config)
            async with self._starts:
                process = started = await self.runtime.start(spec, on_spawn=lambda p: self._record(p, job_id))
            client = await ToolClient.connect_unix(str(spec.socket_path))
        except BaseException:
            if started is not None:
                # Ready, but the connect failed or was cancelled: the sandbox runs, and nothing else would stop it.
                await started.stop(NOT_SERVING_STOP_GRACE_S)  # its cgroup and session folder go too
            self._forget_session(sandbox_id)
            self.loopback.release(spec.loopback_ip)
            if spec.cgroup is not None and started is None:
                await asyncio.to_thread(spec.cgroup.kill)
                await asyncio.to_thread(spec.cgroup.remove)
            remove_tree(spec.session_dir, self.log)
            self.records.remove(sandbox_id)  # last: until the folder is gone, the record names it
            raise
        sandbox = Sandbox(
            sandbox_id, job_id, process, client,
            loopback_ip=spec.loopback_ip, runtime=self.runtime.name, image=resolved_image,
            tool_timeout_s=self.config.tool_timeout_s, max_output_bytes=self.config.max_output_bytes,
            output_limit_bytes=int(self.config.output_limit_mb * (1 << 20)),
            on_stop=self._stopped, log=self.log,
        )
        self._live[sandbox_id] = sandbox
        if config.wall_s > 0:
            self._wall_timers[sandbox_id] = asyncio.get_running_loop().call_later(
                config.wall_s, self._wall_expired, sandbox
            )
        if config.disk_mb > 0 and self.runtime.isolated and (self._disk_watch is None or self._disk_watch.done()):
            self._disk_watch = asyncio.create_task(self._watch_disk(), name="sandbox-disk-watch")
        if (spec.cgroup is None and config.mem_gb > 0 and self.runtime.isolated
                and (self._memory_watch is None or self._memory_watch.done())):
            self._memory_watch = asyncio.create_task(self._watch_memory(), name="sandbox-memory-watch")
        self.log.info(
            "sandbox %s started for job %s (%s, image %s, loopback %s, network %s)",
            sandbox_id, job_id, self.runtime.name, resolved_image, spec.loopback_ip,
            "on" if spec.network else "off",
        )
        return sandbox

    def _check_local_dir(self) -> None:
        """Create ``local_dir`` private to us; refuse one that others could tamper with.

        Sockets and writable layers live there: in a shared /tmp, a directory
        someone else made (or may write to) would let them reach our sandboxes.
        """
        self.local_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = self.local_dir.stat()
        if st.st_uid != os.getuid():
            raise SandboxError(f"sandbox.local_dir {self.local_dir} belongs to uid {st.st_uid}, not to us "
                               f"(uid {os.getuid()}); remove it or choose another directory")
        if st.st_mode & 0o022:
            raise SandboxError(f"sandbox.local_dir {self.local_dir} is writable by others "
                               f"(mode {st.st_mode & 0o777:o}); make it 0700 or choose another directory")

    def _make_cgroup(self, sandbox_id: str, config: SandboxConfig) -> SandboxCgroup:
        assert self.cgroups is not None
        try:
            return self.cgroups.create(sandbox_id, config.max_procs, int(config.mem_gb * (1 << 30)))
        except OSError as e:
            raise SandboxError(f"cannot make the cgroup of sandbox {sandbox_id} ({self.cgroups.describe()}): {e}; "
                               "set sandbox.cgroups: false to use rlimits only") from e

    def _record(self, process: SandboxProcess, job_id: str) -> None:
        self._tell_watchdog(f"add {process.pid} {'-' if process.start_ticks is None else process.start_ticks}\n")
        self._sessions[process.spec.sandbox_id] = process.pid
        cgroup = process.spec.cgroup
        record = self._new_record(process.spec.sandbox_id, job_id, process.spec.session_dir,
                                  [str(d) for d in cgroup.dirs] if cgroup is not None else [])
        record.pid, record.pgid, record.start_ticks = process.pid, process.pgid, process.start_ticks
        self.records.write(record)

    def _new_record(self, sandbox_id: str, job_id: str, session_dir: Path, cgroups: list[str]) -> SandboxRecord:
        return SandboxRecord(
            sandbox_id=sandbox_id, job_id=job_id, runtime=self.runtime.name, pid=None, pgid=None, start_ticks=None,
            boot_id=self._boot_id, session_dir=str(session_dir), owner_pid=self._owner[0],
            owner_start_ticks=self._owner[1], cgroups=cgroups,
        )

    def _wall_expired(self, sandbox: Sandbox) -> None:
        wall_s = sandbox.process.spec.config.wall_s
        self._limit_stop(sandbox, f"it ran past sandbox.wall_s (or its own limits.wall_s) of {wall_s:g} s")

    def _limit_stop(self, sandbox: Sandbox, reason: str) -> None:
        """Stop a sandbox that broke one of its limits; its calls then fail naming ``reason``."""
        if sandbox.stopped or sandbox.stop_reason is not None:
            return
        sandbox.stop_reason = reason
        self.log.warning("sandbox %s of job %s: %s: stopping it", sandbox.sandbox_id, sandbox.job_id, reason)
        task = asyncio.ensure_future(sandbox.stop())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch_disk(self) -> None:
        """Every ``disk_check_s``: stop the live sandboxes whose session folder is over their ``disk_mb``.

        The session folder holds everything a sandbox writes to the node's disk:
        the overlay (Apptainer), /tmp, /var/tmp and /dev/shm where they are not
        in memory (Apptainer without fakeroot), the run directory and the log.
        Rootless runtimes cannot get a size-capped filesystem on disk, so the
        limit is checked like Kubernetes checks ephemeral storage: by measuring.
        """
        while True:
            await asyncio.sleep(self.config.disk_check_s)
            watched = [sb for sb in self._live.values()
                       if sb.process.spec.config.disk_mb > 0 and not sb.stopped and sb.stop_reason is None]
            if not watched:
                if not self._live:
                    return  # started again with the next sandbox
                continue
            try:
                usage = await disk_usage([sb.process.spec.session_dir for sb in watched])
            except SandboxError as e:
                self.log.error("%s: sandbox.disk_mb is not enforced", e)
                return
            for sb in watched:
                used = usage.get(str(sb.process.spec.session_dir))
                limit_mb = sb.process.spec.config.disk_mb
                if used is not None and used > limit_mb * (1 << 20):
                    self._limit_stop(sb, f"it wrote {used / (1 << 20):.0f} MB to the node's disk, over its limit of "
                                         f"{limit_mb} MB (sandbox.disk_mb or limits.disk_mb)")

    async def _watch_memory(self) -> None:
        """Every ``memory_check_s``: stop the live sandboxes without a memory cgroup whose processes hold more
        than their ``mem_gb`` (:mod:`prorl_cli.sandbox.memory` says what is counted).

        The kernel bounds each process (``RLIMIT_AS``), not their sum; this bounds the sum, as measured: a
        sandbox may overshoot by what it allocates in ``memory_check_s``. The sandbox's processes are also
        the kernel's first choice when the host runs out of memory (the tool server raises their
        ``oom_score_adj``), so the node outlives a bomb faster than the check.
        """
        while True:
            await asyncio.sleep(self.config.memory_check_s)
            watched = [sb for sb in self._live.values()
                       if sb.process.spec.cgroup is None and sb.process.spec.config.mem_gb > 0
                       and not sb.stopped and sb.stop_reason is None]
            if not watched:
                if not self._live:
                    return  # started again with the next sandbox
                continue
            usage = await asyncio.to_thread(tree_memory, [sb.pid for sb in watched])
            for sb in watched:
                used = usage[sb.pid]
                limit_gb = sb.process.spec.config.mem_gb
                if used.rss_bytes > limit_gb * (1 << 30):
                    self._limit_stop(sb, f"its {used.processes} processes held {used.rss_bytes / (1 << 20):.0f} MB of "
                                         f"memory, over its limit of {limit_gb:g} GB (sandbox.mem_gb or limits.mem_gb)")

    async def _stopped(self, sandbox: Sandbox) -> None:
        timer = self._wall_timers.pop(sandbox.sandbox_id, None)
        if timer is not None:
            timer.cancel()
        try:
            await sandbox.process.stop(self.config.stop_grace_s)
        finally:
            self._live.pop(sandbox.sandbox_id, None)
            self.loopback.release(sandbox.loopback_ip)
            self.records.remove(sandbox.sandbox_id)
            self._forget_session(sandbox.sandbox_id)
        self.log.info("sandbox %s of job %s stopped", sandbox.sandbox_id, sandbox.job_id)

    def _forget_session(self, sandbox_id: str) -> None:
        sid = self._sessions.pop(sandbox_id, None)
        if sid is not None and self._watchdog is not None and self._watchdog.poll() is None:
            self._tell_watchdog(f"del {sid}\n")

    async def stop_all(self) -> None:
        """Stop every live sandbox, then the watchdog (node shutdown)."""
        for watch in (self._disk_watch, self._memory_watch):
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
        self._disk_watch = self._memory_watch = None
        await asyncio.gather(*(sb.stop() for sb in self.live))
        if self._watchdog is not None:
            watchdog, self._watchdog = self._watchdog, None
            assert watchdog.stdin is not None
            watchdog.stdin.close()  # end of file: it exits, with nothing left to kill
            await asyncio.to_thread(watchdog.wait)
        # A sibling killed outright whose replacement never got to start (the
        # deployment was taken down first) would leave its sandboxes' files for
        # good: the last node to leave the host cleans them too. On the loop, as
        # at start: the node is leaving, and a thread would let a replay's
        # simulated clock run on while it works (timebase). A failure is logged:
        # it must not stop this node from leaving cleanly (it unregisters next).
        try:
            reaped = self.records.reap_orphans(self.records.directory.parent.parent)
        except OSError as e:
            self.log.warning("could not reap what dead node processes left under %s: %s",
                             self.records.directory.parent.parent, e)
            return
        if reaped:
            self.log.warning("reaped %d sandbox(es) left by dead node processes", reaped)
