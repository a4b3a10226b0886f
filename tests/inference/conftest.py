"""Fixtures of the inference tests: the tiny model, one real vLLM per session, deployments.

vLLM starts once per session (about a minute on a CPU) from the tiny model
and is shared; tests that need it are marked ``vllm`` and skip, naming the
reason, when vllm is not installed (a failure under PRORL_REQUIRE_ALL=1).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Deployment

HANDLERS = Path(__file__).resolve().parent / "handlers"
MAX_MODEL_LEN = 1024


def _need(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'prorl[{extra}]'; scripts/install.sh does it)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 + BPE tokenizer made offline for this session."""
    _need("torch", "cpu")
    from prorl_cli.inference.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def chat(tiny_model: Path) -> Any:
    from prorl_cli.agent import ChatTokens

    return ChatTokens.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real vLLM OpenAI server on the CPU, serving the tiny model, for the whole session."""
    _need("vllm", "vllm")
    from prorl_cli.inference.vllm_server import VLLMServer

    server = VLLMServer(
        tiny_model,
        max_model_len=MAX_MODEL_LEN,
        log_path=tmp_path_factory.mktemp("vllm") / "vllm.log",
    )
    server.start()
    try:
        asyncio.run(server.wait_ready(600))
        yield server
    finally:
        server.stop()


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
    d.wait_for(lambda st: any(b["backend_id"] == backend_id and b["alive"] for b in st.backends), timeout_s,
               f"backend {backend_id} to register", backend_id)
    return proc


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group of a child this test started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
