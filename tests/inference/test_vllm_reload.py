"""vLLM loads new weights in place, correctly: through a real broker, node and bridge, and a real vLLM.

One vLLM (the CPU build, tiny model, tied embeddings) serves the module,
started with the flags and environment that ``prorl serve inference``
gives it. After ``update_weights`` the same greedy prompt answers what the
transformers engine fresh on the new checkpoint answers, and after a reload
back it answers again what this vLLM answered when it started fresh on the
old one. A call in flight at the moment of the update finishes on the old
weights and carries the old version: the engine holds its reply until the
test lets it go, so the call is provably inside the bridge when the update
arrives.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.inference.contract import Generation
from prorl_cli.inference.openai_engine import OpenAIEngine
from prorl_cli.protocol import SamplingParams
from tests.fakes.bridges import ThreadBridge
from tests.fakes.canned_http import CannedHTTPServer
from tests.harness import Deployment, need_module
from tests.inference.conftest import HANDLERS, VLLM_TEST_ARGS, serving_vllm

MAX_MODEL_LEN = 256
GREEDY: dict[str, Any] = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


class HeldEngine(OpenAIEngine):
    """The real vLLM client, except that while ``hold`` is set a finished call waits for ``release``."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(url, model=model, backend_id="b1", reload_in_place=True)
        self.max_model_len = MAX_MODEL_LEN  # what describe() would read (it would bind this test's loop)
        self.hold = False
        self.release = threading.Event()
        self.reloads: list[str] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        gen = await super().generate(prompt_ids, sampling)
        if self.hold:
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 120)
        return gen

    async def reload(self, checkpoint: str, policy_version: int) -> None:
        await super().reload(checkpoint, policy_version)
        self.reloads.append(checkpoint)


def transformers_greedy(model: Path) -> list[int]:
    """What the transformers engine, fresh on ``model``, answers to the ``calls`` handler's first prompt."""
    from prorl_cli.inference.transformers_engine import TransformersEngine

    async def run() -> list[int]:
        engine = TransformersEngine(model)
        try:
            return (await engine.generate([1, 2, 3], SamplingParams(**GREEDY))).output_ids
        finally:
            await engine.close()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def reloadable_vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A vLLM child built exactly as ``prorl serve inference --engine vllm`` builds it (default settings)."""
    need_module("vllm", "vllm")
    from prorl_cli.config import ProrlConfig
    from prorl_cli.inference.serve import BridgeOptions, build_engine
    from prorl_cli.inference.vllm_reload import WORKER_EXTENSION
    from prorl_cli.inference.vllm_server import VLLMChildEngine

    config = ProrlConfig(home=str(tmp_path_factory.mktemp("vllm-reload-home")))
    # Eager, as every test vLLM: the packed copy the reload must rebuild is the same with or without compilation.
    opts = BridgeOptions(engine="vllm", model=str(tiny_model), max_model_len=MAX_MODEL_LEN, vllm_args=list(VLLM_TEST_ARGS))
    engine = build_engine(opts, config, "b1")
    assert isinstance(engine, VLLMChildEngine) and engine.reload_in_place  # on by default
    server = engine.server
    assert server.env.get("VLLM_SERVER_DEV_MODE") == "1" and WORKER_EXTENSION in server.command()
    with serving_vllm(server):
        yield server


@pytest.fixture(scope="module")
def new_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random tiny model (same shapes, other weights): what a training step would save."""
    from prorl_cli.inference.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ckpt") / "v1", seed=1)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_reload_serves_the_new_checkpoint_and_a_call_in_flight_keeps_the_old(
    reloadable_vllm: Any, tiny_model: Path, new_checkpoint: Path, tmp_path: Path
) -> None:
    d = Deployment(tmp_path / "home", config={"inference": {"generate_timeout_s": 300.0}})
    bridge: ThreadBridge | None = None
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        engine = HeldEngine(reloadable_vllm.url, reloadable_vllm.model)
        bridge = ThreadBridge(d, "b1", engine)

        def one_call() -> Any:
            (res,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling=GREEDY), timeout_s=300)
            assert res.ok and "error" not in res.output, res
            return res

        fresh_v0 = one_call().output["outputs"][0]  # this vLLM, started fresh on the old checkpoint
        assert fresh_v0 == transformers_greedy(tiny_model)
        expected_v1 = transformers_greedy(new_checkpoint)
        assert expected_v1 != fresh_v0, "the two checkpoints must answer differently for this test to mean anything"

        # A call inside the bridge when the update comes: the update waits for it.
        engine.hold = True
        (before,) = d.client.submit("calls", [{"calls": 1}], sampling=GREEDY)
        d.wait_for(lambda st: st.backends[0].inflight == 1, 120, "the call in flight", "n1")
        updated: list[Any] = []

        def update() -> None:
            with d.new_client() as c:
                updated.append(c.update_weights(str(new_checkpoint), policy_version=1, timeout_s=300))

        t = threading.Thread(target=update)
        t.start()
        t.join(1.0)
        assert not updated and engine.reloads == [], "the weights changed under a call in flight"
        engine.hold = False
        engine.release.set()
        t.join(300)
        assert updated and updated[0].updated == ["b1"] and engine.reloads == [str(new_checkpoint)]
        (res,) = d.client.wait([before], timeout_s=120)
        assert res.output["outputs"] == [fresh_v0] and res.output["versions"] == [0]  # old weights, old version

        after = one_call()
        assert after.output["outputs"] == [expected_v1] and after.output["versions"] == [1]

        # And back: the reloaded vLLM answers exactly as it did fresh on that checkpoint.
        assert d.client.update_weights(str(tiny_model), policy_version=2, timeout_s=300).updated == ["b1"]
        back = one_call()
        assert back.output["outputs"] == [fresh_v0] and back.output["versions"] == [2]
    finally:
        d.close()
        if bridge is not None:
            bridge.close()


def test_tied_modules_are_found_by_shared_parameters() -> None:
    """The refresh after a reload reaches exactly the modules that share a weight (a tied output head)."""
    need_module("torch", "cpu")
    import torch

    from prorl_cli.inference.vllm_reload import tied_modules

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    assert [name for name, _ in tied_modules(Model())] == ["embed", "head"]
    untied = Model()
    untied.head.weight = torch.nn.Parameter(untied.embed.weight.detach().clone())
    assert tied_modules(untied) == []


def test_vllm_gets_the_reload_extension_unless_reload_is_off_or_the_user_gave_one() -> None:
    from prorl_cli.inference.serve import vllm_args
    from prorl_cli.inference.vllm_reload import WORKER_EXTENSION

    assert vllm_args(["--dtype", "bfloat16"], [], reload_in_place=True) == [
        "--dtype", "bfloat16", "--worker-extension-cls", WORKER_EXTENSION]
    assert vllm_args([], ["--worker-extension-cls=my.Ext"], reload_in_place=True) == ["--worker-extension-cls=my.Ext"]
    assert vllm_args(["--dtype", "bfloat16"], [], reload_in_place=False) == ["--dtype", "bfloat16"]


@pytest.mark.parametrize(("status", "body"), [
    (404, b'{"detail": "Not Found"}'),  # no VLLM_SERVER_DEV_MODE
    (500, b'{"error": {"message": "Method \'prorl_reload_weights\' is not implemented."}}'),  # no extension
])
def test_a_vllm_without_the_reload_settings_is_named_with_the_fix(status: int, body: bytes) -> None:
    """An attached vLLM started without dev mode or without prorl's extension: the error says what to start it with."""
    from prorl_cli.exceptions import InferenceError
    from prorl_cli.inference.vllm_reload import WORKER_EXTENSION

    async def reload() -> None:
        server = await asyncio.start_server(CannedHTTPServer(status, body).handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = OpenAIEngine(f"http://127.0.0.1:{port}", model="m", reload_in_place=True)
        try:
            await engine.reload("/ckpt/v1", 1)
        finally:
            await engine.close()
            server.close()

    with pytest.raises(InferenceError, match=f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION}"):
        asyncio.run(reload())


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_that_lacks_weights_is_refused_before_vllm_reads_it(
        reloadable_vllm: Any, tiny_model: Path, tmp_path: Path) -> None:
    """vLLM's reload answers 200 for a torn save and serves what it left in the weights it lacked (NaN here):
    the checkpoint is compared with the served one first, and the served weights stay as they were."""
    import shutil

    from safetensors.torch import load_file, save_file

    from prorl_cli.exceptions import InferenceError

    torn = tmp_path / "torn"
    shutil.copytree(tiny_model, torn)
    weights = load_file(str(torn / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(torn / "model.safetensors"), metadata={"format": "pt"})

    async def go() -> tuple[list[int], str, list[int]]:
        engine = OpenAIEngine(reloadable_vllm.url, reload_in_place=True)
        try:
            await engine.start()  # reads the served checkpoint from /models
            before = (await engine.generate([1, 2, 3], SamplingParams(**GREEDY))).output_ids
            with pytest.raises(InferenceError) as refused:
                await engine.reload(str(torn), 1)
            after = (await engine.generate([1, 2, 3], SamplingParams(**GREEDY))).output_ids
            return before, str(refused.value), after
        finally:
            await engine.close()

    before, error, after = asyncio.run(go())
    assert "missing model.layers.1.mlp.up_proj.weight" in error and "unchanged" in error, error
    assert after == before


def test_reload_problems_name_missing_tensors_and_other_shapes_from_the_headers(tmp_path: Path) -> None:
    need_module("torch", "cpu")
    import torch
    from safetensors.torch import save_file

    from prorl_cli.exceptions import InferenceError
    from prorl_cli.inference.checkpoint import reload_problems, tensor_shapes

    served, incoming, other, broken = (tmp_path / n for n in ("served", "incoming", "other", "broken"))
    for d in (served, incoming, other, broken):
        d.mkdir()
    save_file({"a": torch.zeros(2, 2), "b": torch.zeros(3)}, str(served / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.zeros(4)}, str(served / "model-00002-of-00002.safetensors"))
    save_file({"a": torch.zeros(2, 3), "c": torch.zeros(4), "extra": torch.zeros(1)}, str(incoming / "model.safetensors"))
    shapes = tensor_shapes(served)
    assert shapes == {"a": (2, 2), "b": (3,), "c": (4,)}
    assert reload_problems(shapes, tensor_shapes(incoming)) == ["missing b", "a: shape (2, 3), served (2, 2)"]
    assert reload_problems(shapes, shapes) == []
    (other / "pytorch_model.bin").write_bytes(b"not compared")
    assert tensor_shapes(other) is None and reload_problems(shapes, None) == []  # another format: not compared
    (broken / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(InferenceError, match="not a readable safetensors file"):
        tensor_shapes(broken)
