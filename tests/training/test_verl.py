"""veRL and NeMo-RL: prorl's agent-loop output and the batch layouts built from prorl's exports.

veRL 0.9.1 does not install here without changing the shared transformers
(its dependencies pin transformers 5.10, tokenizers and huggingface_hub
below what is installed), and NeMo-RL not at all on a CPU: these tests
check the fields against the layouts those trainers' code reads (veRL's
``AgentLoopOutput`` and ``DataProto`` tensors, NeMo-RL's ``BatchedDataDict``
keys), and the real ``register_agent_loop`` only where veRL imports.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.integrations.verl import (
    NoTrajectory,
    loop_output,
    nemo_rl_batch,
    run_job,
    verl_batch,
)
from prorl_cli.protocol import JobResult
from prorl_cli.training.samples import samples_from_results


def _result(job_id: str, calls: list[ModelCall], reward: float = 1.0, group: str = "g") -> JobResult:
    return JobResult(job_id=job_id, task="t", state="done", reward=reward, group_id=group,
                     output={"trajectory": Trajectory(calls=calls).to_dict()})


TWO_TURNS = [
    ModelCall([1, 2, 3], [10, 11], [-0.1, -0.2], "stop", policy_version=4),
    ModelCall([1, 2, 3, 10, 11, 20, 21], [12], [-0.3], "stop", policy_version=4),
]


def test_the_agent_loop_output_of_a_two_turn_trajectory() -> None:
    out = loop_output(_result("j1", TWO_TURNS, reward=0.5))
    assert out.prompt_ids == [1, 2, 3]
    assert out.response_ids == [10, 11, 20, 21, 12]
    assert out.response_mask == [1, 1, 0, 0, 1]  # the tool tokens 20, 21 are masked
    assert out.response_logprobs == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3])
    assert out.reward_score == 0.5 and out.num_turns == 4
    assert out.extra_fields["policy_versions"] == [4, 4, -1, -1, 4] and out.extra_fields["prorl_samples"] == 1
    with pytest.raises(NoTrajectory, match="j2"):
        loop_output(JobResult(job_id="j2", task="t", state="failed", output={}))


def test_verl_and_nemo_rl_batches_from_an_export(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pq = pytest.importorskip("pyarrow.parquet")
    from prorl_cli.training.export import write_samples_parquet

    short = [ModelCall([5, 6], [7], [-0.7], "stop", policy_version=1)]
    built = samples_from_results([_result("a", TWO_TURNS, 1.0), _result("b", short, 0.0)])
    rows = pq.read_table(write_samples_parquet(tmp_path / "s.parquet", built.samples)).to_pylist()
    tensors, non_tensors = verl_batch(rows)
    # Prompts left-padded to 3, responses right-padded to 5 (veRL's layout).
    assert tensors["prompts"].tolist() == [[1, 2, 3], [0, 5, 6]]
    assert tensors["responses"].tolist() == [[10, 11, 20, 21, 12], [7, 0, 0, 0, 0]]
    assert tensors["input_ids"].shape == (2, 8) and tensors["attention_mask"][1].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    assert tensors["position_ids"][1].tolist()[:4] == [0, 0, 1, 2]
    assert tensors["response_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert tensors["old_log_probs"][0].tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3])
    assert tensors["advantages"][0].tolist() == pytest.approx([0.5, 0.5, 0, 0, 0.5])  # GRPO: 1 - mean(1, 0)
    assert tensors["token_level_scores"][0].tolist() == pytest.approx([0, 0, 0, 0, 1.0])  # reward on the last sampled id
    assert list(non_tensors["uid"]) == ["g", "g"]
    nemo = nemo_rl_batch(rows)
    assert nemo["input_ids"].tolist() == [[1, 2, 3, 10, 11, 20, 21, 12], [5, 6, 7, 0, 0, 0, 0, 0]]
    assert nemo["input_lengths"].tolist() == [8, 3]
    assert nemo["token_mask"][0].tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert nemo["generation_logprobs"][1].tolist() == pytest.approx([0, 0, -0.7, 0, 0, 0, 0, 0])


def test_register_agent_loop() -> None:
    """With veRL: registered in its registry under ``prorl``. Without (here): an ImportError naming the extra."""
    from prorl_cli.integrations.verl import register_agent_loop

    if importlib.util.find_spec("verl") is None:
        with pytest.raises(ImportError, match=r"prorl\[verl\]"):
            register_agent_loop()
        return
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry  # type: ignore[import-not-found]

    cls = register_agent_loop()
    assert _agent_loop_registry["prorl"]["_target_"].endswith(cls.__qualname__)


def test_the_adapter_runs_real_jobs(tmp_path: Path, tiny_model: Path) -> None:
    """``run_job`` (the body of the agent loop's ``run``) on a real deployment with a scripted bridge."""
    from tests.harness import Deployment
    from tests.inference.conftest import HANDLERS
    from tests.inference.test_routing import ScriptedEngine, ThreadBridge

    d = Deployment(tmp_path / "home", config={"inference": {"generate_timeout_s": 60.0}})
    bridge: Any = None
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        bridge = ThreadBridge(d, "b1", ScriptedEngine())
        out, result = d.client._run(run_job(d.client._aio, "multiturn", {"tokenizer": str(tiny_model), "turns": 2},
                                            {"max_tokens": 2, "temperature": 1.0, "logprobs": 1}))
    finally:
        d.close()
        if bridge is not None:
            bridge.close()
    assert result.ok and out.reward_score == 1.0
    traj = Trajectory.from_dict(result.output["trajectory"])
    assert len(traj.calls) == 2 and out.extra_fields["prorl_samples"] == 1
    # The sampled ids are the engine's, in order; everything between them (the observation turn) is masked.
    sampled = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m]
    assert sampled == [7, 8, 7, 8] and out.response_ids[:2] == [7, 8]
    assert out.prompt_ids == traj.calls[0].prompt_ids and 0 in out.response_mask
