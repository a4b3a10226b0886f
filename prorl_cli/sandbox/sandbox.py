"""A running sandbox as handlers see it: typed async tool calls and stop."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prorl_cli.exceptions import SandboxError, ToolError
from prorl_cli.observe.timeline import TOOL, record_span
from prorl_cli.sandbox.client import REPLY_MARGIN_S, ToolClient
from prorl_cli.sandbox.runtime import GATEWAY_SOCKET_NAME, INSIDE_RUN, SandboxProcess


@dataclass
class BashResult:
    """What a bash call printed (stdout and stderr together, as on a terminal) and how it ended."""

    output: str
    exit_code: int | None  # None: killed, or the shell had to be restarted
    timed_out: bool
    truncated: bool  # output was cut to max_output_bytes (the text says where)
    output_bytes: int  # bytes printed in all
    shell_restarted: bool  # the shell ended or hung and was replaced: cwd and env are reset
    #: It printed more than ``sandbox.output_limit_mb`` and was interrupted there (as at a timeout).
    output_limited: bool = False


@dataclass
class PythonResult:
    """Captured output of a python cell, the repr of its last expression, and its error."""

    stdout: str
    stderr: str
    result: str | None
    error: str | None  # "Type: message" when the cell raised
    timed_out: bool
    restarted: bool  # the namespace was lost (the cell ignored the interrupt)


@dataclass
class EditResult:
    """The editor's answer: a view with line numbers, or what was changed."""

    output: str


#: How long a call that lost its tool server waits for the sandbox to exit, to tell a death from a hiccup. Only a
#: call whose tool server is already gone waits, and Apptainer's teardown takes seconds on a loaded machine: a
#: shorter wait reported a sandbox killed from inside (``kill -9 -1``) as a bare lost connection.
DEATH_WAIT_S = 10.0

EditCommand = Literal["view", "create", "str_replace", "insert", "undo"]


class Sandbox:
    """One sandbox and its tool server. Created by :meth:`SandboxManager.start`."""

    def __init__(
        self,
        sandbox_id: str,
        job_id: str,
        process: SandboxProcess,
        client: ToolClient,
        *,
        loopback_ip: str,
        runtime: str,
        image: str,
        tool_timeout_s: float,
        max_output_bytes: int,
        on_stop: Callable[[Sandbox], Awaitable[None]],
        log: logging.Logger,
        output_limit_bytes: int = 0,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.job_id = job_id
        self.process = process
        self.loopback_ip = loopback_ip
        self.runtime = runtime
        self.image = image
        self.tool_timeout_s = tool_timeout_s
        self.max_output_bytes = max_output_bytes
        self.output_limit_bytes = output_limit_bytes
        #: Why the sandbox ended before its job let it go (a limit, or its tool server died); ``None`` while fine.
        self.stop_reason: str | None = None
        self._client = client
        self._on_stop = on_stop
        self._stopped = False
        self._stop_task: asyncio.Task[None] | None = None
        self._stopped_event = asyncio.Event()
        self._log = log

    @property
    def pid(self) -> int:
        """Pid of the sandbox's leader process (its process group id too)."""
        return self.process.pid

    @property
    def stopped(self) -> bool:
        return self._stopped

    def limit_events(self) -> dict[str, int]:
        """Its cgroup's limit events (``oom_kill``: processes the OOM killer ended, ``pids_max``: forks refused),
        where it has a cgroup; ``{}`` otherwise."""
        cgroup = self.process.spec.cgroup
        return cgroup.events() if cgroup is not None else {}

    async def _call(self, op: str, budget_s: float, **fields: Any) -> Any:
        if self._stopped or self.stop_reason is not None:
            ended = "is stopped" if self._stopped else "has ended"
            why = f": {self.stop_reason}" if self.stop_reason else ""
            raise SandboxError(f"sandbox {self.sandbox_id} (job {self.job_id}) {ended}{why}")
        started = time.monotonic()
        ok = False
        try:
            result = await self._client.call(op, budget_s + REPLY_MARGIN_S, **fields)
            ok = True
            return result
        except ToolError:
            raise  # the tool refused the call; the sandbox is fine
        except SandboxError as e:
            if self._stopped and self.stop_reason is None:
                # Stopped on purpose (the handler, the node's shutdown) while the call ran: not a death.
                raise SandboxError(f"sandbox {self.sandbox_id} (job {self.job_id}) was stopped during {op}") from e
            reason = self.stop_reason or await self._death()
            if reason is None:
                raise
            raise SandboxError(f"sandbox {self.sandbox_id} (job {self.job_id}): {op} failed: {reason}") from e
        finally:
            record_span(TOOL, started, {"tool": f"sandbox.{op}", "ok": ok})

    async def _death(self) -> str | None:
        """Why the tool server went away, if the sandbox has ended by itself (it is then marked ended)."""
        proc = self.process.proc
        if proc.returncode is None:
            # The tool server is gone: the runtime's init follows it within moments.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DEATH_WAIT_S):
                    await proc.wait()
        if proc.returncode is None:
            return None
        why = f"its tool server died and the sandbox exited (status {proc.returncode})"
        oom = self.limit_events().get("oom_kill", 0)
        if oom:
            why += (f": the out-of-memory killer ended {oom} process(es) in it at its memory limit "
                    f"({self.process.spec.config.mem_gb:g} GB, sandbox.mem_gb)")
        else:
            why += ": a process inside killed it (kill -1?) or it ran out of memory"
        self.stop_reason = why
        self._log.warning("sandbox %s of job %s: %s", self.sandbox_id, self.job_id, why)
        return why

    async def bash(
        self, command: str, timeout_s: float | None = None, max_output_bytes: int | None = None
    ) -> BashResult:
        """Run ``command`` in the sandbox's persistent shell (cwd and env carry over).

        At ``timeout_s`` the command is interrupted (Ctrl-C, then killed) and
        what it printed so far comes back with ``timed_out=True``.
        """
        t = self.tool_timeout_s if timeout_s is None else timeout_s
        reply = await self._call(
            "bash", t, command=command, timeout_s=t,
            max_output_bytes=max_output_bytes or self.max_output_bytes,
            output_limit_bytes=self.output_limit_bytes,
        )
        return BashResult(**reply)

    async def python(self, code: str, timeout_s: float | None = None) -> PythonResult:
        """Run ``code`` in the sandbox's persistent Python namespace.

        stdout, stderr, the result's repr and the error are each cut to the head
        and tail of ``max_output_bytes`` (in the worker: a cell that prints
        gigabytes holds no more than that).
        """
        t = self.tool_timeout_s if timeout_s is None else timeout_s
        reply = await self._call("python", t, code=code, timeout_s=t, max_output_bytes=self.max_output_bytes)
        return PythonResult(**reply)

    async def edit(
        self,
        command: EditCommand,
        path: str,
        *,
        file_text: str | None = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: int | None = None,
        view_range: tuple[int, int] | list[int] | None = None,
    ) -> EditResult:
        """The file editor. ``str_replace`` needs exactly one match; errors raise :class:`ToolError`."""
        fields: dict[str, Any] = {"command": command, "path": path}
        for key, value in (("file_text", file_text), ("old_str", old_str), ("new_str", new_str),
                           ("insert_line", insert_line)):
            if value is not None:
                fields[key] = value
        if view_range is not None:
            fields["view_range"] = list(view_range)
        reply = await self._call("edit", 30.0, **fields)
        return EditResult(output=reply["output"])

    async def read_file(self, path: str, *, offset: int = 0, max_bytes: int | None = None) -> bytes:
        """The bytes of a file inside the sandbox (copy out: save artifacts for EVAL); ``path`` must be absolute.

        ``offset`` / ``max_bytes``: only that part (follow a growing log without re-reading it).
        """
        fields: dict[str, Any] = {"offset": offset} if offset else {}
        if max_bytes is not None:
            fields["max_bytes"] = max_bytes
        reply = await self._call("read_file", 60.0, path=path, **fields)
        return base64.b64decode(reply["data"])

    async def write_file(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Write bytes to a file inside the sandbox (parents are created); ``path`` must be absolute."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"write_file needs bytes, got {type(data).__name__}")
        await self._call("write_file", 60.0, path=path, data=base64.b64encode(bytes(data)).decode(), mode=mode)

    def gateway_socket(self) -> tuple[Path, str]:
        """Where a node service listens for this sandbox: (host path, the same socket's path inside).

        The sandbox's run directory is the one host folder bound into it, so a
        Unix socket there is reachable from inside without any network.
        """
        host = self.process.spec.run_dir / GATEWAY_SOCKET_NAME
        return host, str(host) if self.runtime == "local" else f"{INSIDE_RUN}/{GATEWAY_SOCKET_NAME}"

    async def relay(self, target: str, *, host: str | None = None, port: int = 0) -> tuple[str, int]:
        """Listen on ``host:port`` inside the sandbox (default: its loopback IP, a free port) and pipe
        every connection to the Unix socket ``target`` (a path inside). Returns the address listened on."""
        reply = await self._call("relay", 10.0, host=host or self.loopback_ip, port=port, target=target)
        return str(reply["host"]), int(reply["port"])

    async def ping(self) -> dict[str, Any]:
        """The tool server's pid, python version, uid and loopback IP."""
        result: dict[str, Any] = await self._call("ping", 5.0)
        return result

    async def stop(self) -> None:
        """Stop the sandbox (SIGTERM, then SIGKILL) and remove its writable layer and socket.

        Idempotent: the job's cleanup and the node's shutdown may both call it.
        """
        if self._stop_task is None:
            self._stopped = True
            self._stop_task = asyncio.get_running_loop().create_task(self._stop_once(),
                                                                     name=f"sandbox-stop-{self.sandbox_id}")
            self._stop_task.add_done_callback(self._stop_done)
        # Shielded: a caller cancelled part-way (a job's stage timeout) must not leave the sandbox running,
        # unrecorded, with every later stop() returning at once. The stop goes on; later callers wait for it.
        await asyncio.shield(self._stop_task)

    def _stop_done(self, task: asyncio.Task[None]) -> None:
        # Seen even when every caller was cancelled meanwhile (nobody else would retrieve it).
        if not task.cancelled() and task.exception() is not None:
            self._log.warning("sandbox %s of job %s: stop failed: %r", self.sandbox_id, self.job_id, task.exception())

    async def _stop_once(self) -> None:
        try:
            await self._client.close()
            await self._on_stop(self)
        finally:
            self._stopped_event.set()

    async def wait_stopped(self) -> None:
        """Return once the sandbox has been stopped (by a handler, the node, or ``wall_s``)."""
        await self._stopped_event.wait()
