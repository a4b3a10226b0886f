"""The model named by ``backends add --model`` is the one a node's redirected calls name (real broker and node)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness import Deployment
from tests.inference.conftest import LocalHttpServer

#: What the fake server lists at ``/v1/models``: a base model first, then a LoRA adapter (as vLLM lists them).
MODELS = ["base-model", "my-lora"]


class TwoModelServer(LocalHttpServer):
    """An OpenAI-compatible server (the boundary) that lists :data:`MODELS` and records each completion's model."""

    def __init__(self) -> None:
        self.models_named: list[str | None] = []
        super().__init__()

    async def respond(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        if method == "GET" and path == "/v1/models":
            answer: Any = {"object": "list", "data": [{"id": m, "object": "model", "max_model_len": 1024}
                                                      for m in MODELS]}
            return 200, json.dumps(answer).encode()
        if method == "POST" and path == "/v1/completions":
            self.models_named.append(body.get("model"))
            choice = {"index": 0, "token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.5, -0.25]},
                      "finish_reason": "length"}
            return 200, json.dumps({"choices": [choice]}).encode()
        return 404, json.dumps({"error": {"message": f"no {path}"}}).encode()


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
