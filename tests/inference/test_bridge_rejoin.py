"""A bridge that comes back on old weights loads the deployment's current ones before it serves.

A real broker, node and two real bridge processes (the transformers engine on
the tiny model). After ``update_weights`` to v1, one bridge is stopped (as a
preempted Slurm task is) and started again on its start checkpoint, v0. A call
already waiting at the broker (the other bridge is cleared) must not reach it
before it has loaded v1: its greedy answer equals the other bridge's v1
answer for the same prompt, never the v0 answer, and the status shows the
version each bridge serves. A bridge that cannot load the current weights
(an in-process bridge whose load fails) is told to shut down.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import InferenceError
from prorl_cli.inference.tiny_model import make_tiny_model
from tests.fakes.bridges import ThreadBridge
from tests.fakes.engines import CountingEngine
from tests.harness import Deployment, need_module
from tests.inference.conftest import HANDLERS, start_bridge

GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


class CannotLoad(CountingEngine):
    """An engine whose weights load fails once the test lets it (a checkpoint gone from the filesystem)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    async def reload(self, checkpoint: str, policy_version: int) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.go.wait, 30)
        raise InferenceError(f"{checkpoint}: not a model directory (no config.json)")


def _one_call(d: Deployment) -> Any:
    (res,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling=GREEDY), timeout_s=120)
    assert res.ok and "error" not in res.output, res
    return res


def test_a_bridge_back_on_v0_loads_v1_before_it_serves(tiny_model: Path, tmp_path: Path) -> None:
    need_module("torch", "cpu")
    v1 = make_tiny_model(tmp_path / "v1", seed=1)  # same shapes, other weights: a training step's checkpoint
    engine = ("--engine", "transformers", "--model", str(tiny_model))
    d = Deployment(tmp_path / "home", config={"inference": {"generate_timeout_s": 120.0}})
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        start_bridge(d, "b1", *engine)
        start_bridge(d, "b2", *engine)
        v0_answer = _one_call(d).output["outputs"][0]
        assert {b.backend_id: b.policy_version for b in d.client.list_backends()} == {"b1": None, "b2": None}

        done = d.client.update_weights(str(v1), policy_version=1, timeout_s=120)
        assert sorted(done.updated) == ["b1", "b2"]
        on_v1 = _one_call(d)
        v1_answer = on_v1.output["outputs"][0]
        assert on_v1.output["versions"] == [1] and v1_answer != v0_answer, "the checkpoints must answer differently"
        assert {b.backend_id: b.policy_version for b in d.client.list_backends()} == {"b1": 1, "b2": 1}

        # b1 takes no new job; b2 goes (SIGTERM: it says goodbye, as a preempted task does).
        d.client.clear_backends("b1")
        d.kill("b2", signal.SIGTERM)
        d.wait_for(lambda st: not any(b.backend_id == "b2" and b.alive for b in st.backends), 30, "b2 to leave")
        (waiting,) = d.client.submit("calls", [{"calls": 1}], sampling=GREEDY)
        d.wait_for(lambda st: st.held_generates == 1, 60, "the call to wait for a backend", "n1")

        start_bridge(d, "b2", *engine)  # back on its start weights, v0
        (res,) = d.client.wait([waiting], timeout_s=120)
        assert res.ok and res.output["backends"] == ["b2"], res
        # Served on v1 (the weights, not only the stamp): the load came before the call.
        assert res.output["outputs"] == [v1_answer] and res.output["versions"] == [1]
        b2 = {b.backend_id: b for b in d.client.list_backends()}["b2"]
        assert b2.policy_version == 1 and not b2.loading
        assert "joined on its start weights: it loads" in d.log("broker")

        # A bridge that cannot load the current weights is told to shut down, and the broker says why.
        engine_b3 = CannotLoad()
        b3 = ThreadBridge(d, "b3", engine_b3)  # registered, and loading (its load waits for the test)
        assert {b.backend_id: b.loading for b in d.client.list_backends()}["b3"]
        engine_b3.go.set()
        b3.thread.join(30)
        assert not b3.thread.is_alive(), "b3 was not told to shut down"
        assert not any(b.backend_id == "b3" and b.alive for b in d.client.list_backends())
        assert "backend b3 could not load the current weights" in d.log("broker")
    finally:
        d.close()

