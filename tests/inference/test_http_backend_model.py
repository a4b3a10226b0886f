"""The model named by ``backends add --model`` is the one a node's redirected calls name (real broker and node)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness import Deployment

#: What the fake server lists at ``/v1/models``: a base model first, then a LoRA adapter (as vLLM lists them).
MODELS = ["base-model", "my-lora"]


class TwoModelServer:
    """An OpenAI-compatible server (the boundary) that lists :data:`MODELS` and records each completion's model."""

    def __init__(self) -> None:
        self.models_named: list[str | None] = []
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self._ready.wait(10), "the fake server did not start"

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

    def _answer(self, method: bytes, path: bytes, body: Any) -> tuple[int, Any]:
        if method == b"GET" and path == b"/v1/models":
            return 200, {"object": "list", "data": [{"id": m, "object": "model", "max_model_len": 1024} for m in MODELS]}
        if method == b"POST" and path == b"/v1/completions":
            self.models_named.append(body.get("model"))
            choice = {"index": 0, "token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -0.25]},
                      "finish_reason": "length"}
            return 200, {"choices": [choice]}
        return 404, {"error": {"message": f"no {path.decode()}"}}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path = head.split(b" ")[:2]
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = json.loads(await reader.readexactly(length)) if length else None
            status, answer = self._answer(method, path, body)
            data = json.dumps(answer).encode()
            writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n" % (status, len(data)) + data)
            await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def two_models() -> Iterator[TwoModelServer]:
    server = TwoModelServer()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("model", ["my-lora", None], ids=["named", "unnamed"])
def test_redirected_calls_name_the_model_given_to_backends_add(
    deployment: Deployment, two_models: TwoModelServer, model: str | None
) -> None:
    status = deployment.client.add_backend(two_models.url, model)
    assert status.kind == "http"
    ids = deployment.client.submit("onecall", [{"prompt_ids": [1, 2, 3]}] * 2, sampling={"max_tokens": 2},
                                   timeout_s=60)
    for res in deployment.client.wait(ids, timeout_s=90):
        assert res.ok, (res.state, res.error)
        assert res.output["output_ids"] == [7, 8] and res.output["backend_id"] == status.backend_id, res.output
    # Named: the adapter, not the base model the server lists first; not named: the first listed, as before.
    assert two_models.models_named == [model or MODELS[0]] * 2


def test_adding_a_backend_again_with_another_model_switches_the_calls_to_it(
    deployment: Deployment, two_models: TwoModelServer
) -> None:
    deployment.client.add_backend(two_models.url, None)
    again = deployment.client.add_backend(two_models.url, "my-lora")
    assert again.model == "my-lora"
    ids = deployment.client.submit("onecall", [{"prompt_ids": [1, 2, 3]}], sampling={"max_tokens": 2}, timeout_s=60)
    (res,) = deployment.client.wait(ids, timeout_s=90)
    assert res.ok, (res.state, res.error)
    assert two_models.models_named == ["my-lora"]
