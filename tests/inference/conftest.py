"""Fixtures of the inference tests: the tiny model, one real vLLM per session, deployments.

vLLM starts once per session (about a minute on a CPU) from the tiny model
and is shared; tests that need it are marked ``vllm`` and skip, naming the
reason, when vllm is not installed (a failure under PRORL_REQUIRE_ALL=1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.harness import Deployment, need_module

if TYPE_CHECKING:
    from prorl_cli.inference.vllm_server import VLLMServer

HANDLERS = Path(__file__).resolve().parent / "handlers"
MAX_MODEL_LEN = 1024
#: Every vLLM the tests start runs eagerly: vLLM's torch.compile warm-up of the tiny model took most of a
#: server's start (over a minute on the 2-core CI machine, and more with a cold compile cache) and no test
#: is about compiled execution.
VLLM_TEST_ARGS = ["--enforce-eager"]


@contextlib.contextmanager
def serving_vllm(server: VLLMServer, ready_timeout_s: float = 600.0) -> Iterator[VLLMServer]:
    """Run ``server`` for the ``with`` block: start it (eagerly, with :data:`VLLM_TEST_ARGS`), wait until it
    answers, yield it, and stop its process group however the block ends.

    Every test vLLM starts here, so every one runs eagerly, whichever way it was built.
    """
    server.extra_args += [a for a in VLLM_TEST_ARGS if a not in server.extra_args]
    server.start()
    try:
        asyncio.run(server.wait_ready(ready_timeout_s))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def chat(tiny_model: Path) -> Any:
    from prorl_cli.agent import ChatTokens

    return ChatTokens.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real vLLM OpenAI server on the CPU, serving the tiny model, for the whole session."""
    need_module("vllm", "vllm")
    from prorl_cli.inference.vllm_server import VLLMServer

    server = VLLMServer(
        tiny_model,
        max_model_len=MAX_MODEL_LEN,
        # Its log then records each request and each abort: the witness that a cancelled job's call stopped.
        extra_args=["--enable-log-requests"],
        # At INFO whoever imported what first: importing trl (the TRL tests do, in this process) sets
        # VLLM_LOGGING_LEVEL=ERROR in os.environ, which would silence those lines.
        env={"VLLM_LOGGING_LEVEL": "INFO"},
        log_path=tmp_path_factory.mktemp("vllm") / "vllm.log",
    )
    with serving_vllm(server):
        yield server


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    """A broker and one node serving the test handlers; closed (everything stopped) afterwards."""
    d = Deployment(tmp_path / "home", config={"node": {"n_init": 4, "n_run": 48, "n_eval": 4, "stop_grace_s": 3.0},
                                              "inference": {"generate_timeout_s": 120.0}})
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        yield d
    finally:
        d.close()


def start_bridge(d: Deployment, backend_id: str, *args: str, timeout_s: float = 120.0) -> subprocess.Popen[bytes]:
    """``prorl serve inference --backend-id ID ARGS`` as a child; returns once it has registered."""
    proc = d.spawn(backend_id, "serve", "inference", "--backend-id", backend_id, *args)
    d.wait_for(lambda st: any(b.backend_id == backend_id and b.alive for b in st.backends), timeout_s,
               f"backend {backend_id} to register", backend_id)
    return proc


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group of a child this test started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return


class LocalHttpServer:
    """A tiny HTTP/1.1 server on 127.0.0.1 (an ephemeral port), served from an event loop of its own thread: a
    stand-in at the HTTP boundary. Subclasses answer each request in :meth:`respond`."""

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self._ready.wait(10), f"{type(self).__name__} did not start"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            self._ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    async def respond(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        """The status and JSON body answering one request (``body``: its JSON, or None)."""
        raise NotImplementedError

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import json

        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path = head.split(b" ")[:2]
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = json.loads(await reader.readexactly(length)) if length else None
            status, data = await self.respond(method.decode(), path.decode(), body)
            writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n" % (status, len(data)) + data)
            await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class RecordingProxy(LocalHttpServer):
    """An HTTP proxy in front of vLLM that records every completion it relays, verbatim.

    Lets a test compare a trajectory with exactly what vLLM answered at the
    time (re-asking vLLM later could differ: batching and prefix caching).
    """

    def __init__(self, target_root: str) -> None:
        self.target_root = target_root.rstrip("/")
        self.records: list[tuple[dict[str, Any], dict[str, Any]]] = []
        super().__init__()

    async def respond(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        from prorl_cli.inference import http

        resp = await http.request(method, self.target_root + path, body)
        if body is not None and resp.status == 200:
            self.records.append((body, resp.json()))
        return resp.status, resp.body

    def answer_for(self, prompt_ids: list[int]) -> dict[str, Any]:
        """vLLM's answer to the (unique) completion request with these prompt ids."""
        found = [resp for req, resp in list(self.records) if req.get("prompt") == prompt_ids]
        assert len(found) == 1, f"{len(found)} recorded completions for this prompt"
        return found[0]


@pytest.fixture
def recording_proxy(vllm_server: Any) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(f"http://{vllm_server.host}:{vllm_server.port}")
    try:
        yield proxy
    finally:
        proxy.close()
