"""A running sandbox as handlers see it: typed async tool calls and stop."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prorl_cli.exceptions import SandboxError
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
    ) -> None:
        self.sandbox_id = sandbox_id
        self.job_id = job_id
        self.process = process
        self.loopback_ip = loopback_ip
        self.runtime = runtime
        self.image = image
        self.tool_timeout_s = tool_timeout_s
        self.max_output_bytes = max_output_bytes
        self._client = client
        self._on_stop = on_stop
        self._stopped = False
        self._stop_lock = asyncio.Lock()
        self._stopped_event = asyncio.Event()
        self._log = log

    @property
    def pid(self) -> int:
        """Pid of the sandbox's leader process (its process group id too)."""
        return self.process.pid

    @property
    def stopped(self) -> bool:
        return self._stopped

    async def _call(self, op: str, budget_s: float, **fields: Any) -> Any:
        if self._stopped:
            raise SandboxError(f"sandbox {self.sandbox_id} (job {self.job_id}) is stopped")
        started = time.monotonic()
        ok = False
        try:
            result = await self._client.call(op, budget_s + REPLY_MARGIN_S, **fields)
            ok = True
            return result
        finally:
            record_span(TOOL, started, {"tool": f"sandbox.{op}", "ok": ok})

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
        )
        return BashResult(**reply)

    async def python(self, code: str, timeout_s: float | None = None) -> PythonResult:
        """Run ``code`` in the sandbox's persistent Python namespace."""
        t = self.tool_timeout_s if timeout_s is None else timeout_s
        reply = await self._call("python", t, code=code, timeout_s=t)
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
        """The bytes of a file inside the sandbox (copy out: save artifacts for EVAL).

        ``offset`` / ``max_bytes``: only that part (follow a growing log without re-reading it).
        """
        fields: dict[str, Any] = {"offset": offset} if offset else {}
        if max_bytes is not None:
            fields["max_bytes"] = max_bytes
        reply = await self._call("read_file", 60.0, path=path, **fields)
        return base64.b64decode(reply["data"])

    async def write_file(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Write bytes to a file inside the sandbox (parents are created)."""
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
        async with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                await self._client.close()
                await self._on_stop(self)
            finally:
                self._stopped_event.set()

    async def wait_stopped(self) -> None:
        """Return once the sandbox has been stopped (by a handler, the node, or ``wall_s``)."""
        await self._stopped_event.wait()
