"""Device selection: ``auto`` never moves a process that was given GPUs to the CPU without saying so."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from prorl_cli.exceptions import ConfigError
from prorl_cli.inference.device import allotted_gpus, resolve_device


@pytest.fixture
def cpu_torch() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: auto takes it")


def test_allotted_gpus_reads_cuda_visible_devices_as_slurm_sets_it() -> None:
    assert allotted_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == ["0", "1"]
    assert allotted_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5d6c4f1e"}) == ["GPU-5d6c4f1e"]
    for none in ({}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"},
                 {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}):
        assert allotted_gpus(none) == []


def test_auto_on_the_cpu_with_gpus_allotted_warns_saying_why(
        cpu_torch: None, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from prorl_cli.inference.transformers_engine import TransformersEngine

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    caplog.set_level(logging.INFO, logger="prorl_cli.inference")

    async def start() -> str:
        engine = TransformersEngine(tiny_model)
        try:
            await engine.start()
            return engine.device
        finally:
            await engine.close()

    assert asyncio.run(start()) == "cpu"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "running on the CPU" in message and "GPU(s) 2" in message and "CUDA_VISIBLE_DEVICES" in message
    assert "device cpu" in message
    assert any(r.getMessage() == f"loaded {tiny_model} on cpu" for r in caplog.records)


def test_no_warning_without_gpus_or_when_the_cpu_is_asked_for(
        cpu_torch: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="prorl_cli.inference")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "NoDevFiles")
    assert resolve_device("auto") == "cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert resolve_device("cpu") == "cpu"
    assert not caplog.records
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        resolve_device("cuda:0")


def test_a_cpu_build_of_vllm_given_gpus_warns_before_it_starts(
        tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """install.sh installs vLLM's CPU wheel: on a GPU node the bridge says it will not use the GPUs."""
    import shutil

    from prorl_cli.inference.vllm_server import VLLMServer, vllm_cpu_build
    from tests.harness import need_module

    need_module("vllm", "vllm")
    if vllm_cpu_build() is None:
        pytest.skip("the vLLM installed here is not a CPU build")
    caplog.set_level(logging.WARNING, logger="prorl_cli.inference")
    true = shutil.which("true")
    assert true is not None
    for env, warned in (({"CUDA_VISIBLE_DEVICES": "0,1"}, True), ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, False)):
        caplog.clear()
        # ``true`` in place of Python: the check runs as the real server would start, and nothing is served.
        server = VLLMServer(tiny_model, env=env, python=true)
        server.start()
        server.stop()
        messages = [r.getMessage() for r in caplog.records]
        assert bool(messages) is warned, messages
        if warned:
            assert "is a CPU build" in messages[0] and "GPU(s) 0,1" in messages[0]
