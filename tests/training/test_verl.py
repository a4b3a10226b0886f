"""veRL and NeMo-RL: prorl's agent loop driven by veRL's own classes, and the batch layouts built from prorl's exports.

veRL 0.9.1 is installed without its dependency pins (scripts/install.sh, see
docs/training.md): its ``AgentLoopWorker`` runs prorl's registered loop on a
real deployment, and ``DataProto.from_dict`` takes ``verl_batch`` of a real
export. NeMo-RL has no installable package (PyPI's ``nemo-rl`` is an empty
placeholder): its ``BatchedDataDict`` tensors are checked against the keys
and layout its loss reads.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import prorl_cli.integrations.verl as verl
from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.exceptions import ConfigError, DatasetError
from prorl_cli.inference.contract import Generation
from prorl_cli.integrations.verl import (
    AGENT_LOOP_CONFIG,
    NoTrajectory,
    call_max_tokens,
    fit_lengths,
    instance_of,
    job_output,
    loop_output,
    nemo_rl_batch,
    plain,
    prorl_sampling,
    run_job,
    verl_batch,
)
from prorl_cli.protocol import JobResult, SamplingParams
from prorl_cli.training.samples import samples_from_results
from tests.fakes.engines import CountingEngine
from tests.harness import need_module


def _result(job_id: str, calls: list[ModelCall], reward: float = 1.0, group: str = "g") -> JobResult:
    return JobResult(job_id=job_id, task="t", state="done", reward=reward, group_id=group,
                     output={"trajectory": Trajectory(calls=calls).to_dict()})


TWO_TURNS = [
    ModelCall([1, 2, 3], [10, 11], [-0.1, -0.2], "stop", policy_version=4),
    ModelCall([1, 2, 3, 10, 11, 20, 21], [12], [-0.3], "stop", policy_version=4),
]


def test_every_module_of_verls_import_graph_is_installed() -> None:
    """veRL goes in with --no-deps (scripts/install.sh): each module its agent loop, its protocol and
    prorl's adapter import must be installed by name, or a fresh venv fails where a developer's did not."""
    need_module("verl", "verl")
    import subprocess
    import sys

    # A child interpreter: the import graph from nothing, not whatever this session imported already.
    modules = ["verl.protocol", "verl.experimental.agent_loop.agent_loop", "prorl_cli.integrations.verl"]
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    run = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


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


def test_a_sample_is_cut_to_verls_widths() -> None:
    """veRL pads to rollout.prompt_length / response_length: a longer sample keeps its prompt's end and response's start."""
    out = loop_output(_result("j1", TWO_TURNS))
    assert not fit_lengths(out, 3, 5) and out.response_ids == [10, 11, 20, 21, 12]
    assert fit_lengths(out, 2, 3)
    assert out.prompt_ids == [2, 3] and out.response_ids == [10, 11, 20] and out.response_mask == [1, 1, 0]
    assert out.response_logprobs == pytest.approx([-0.1, -0.2, 0.0]) and out.extra_fields["policy_versions"] == [4, 4, -1]


def test_a_verl_row_becomes_a_plain_instance() -> None:
    """veRL's per-row values are numpy elements; the instance sent to prorl (msgpack) holds plain ones."""
    np = pytest.importorskip("numpy")
    import msgpack

    row = {"q": np.str_("2+2"), "n": np.int64(3), "ids": np.array([1, 2]), "meta": {"w": np.float32(0.5)}}
    assert plain(row) == {"q": "2+2", "n": 3, "ids": [1, 2], "meta": {"w": 0.5}}
    msgpack.packb(plain(row))


FAILED = JobResult(job_id="j9", task="multiturn", state="failed", critical_error="run",
                   error={"stage": "run", "type": "ValueError", "message": "invalid literal for int(): 'many'"})


def test_a_failed_job_is_a_masked_row_with_its_error(caplog: pytest.LogCaptureFixture) -> None:
    """One failed job must not end veRL's batch (its gather raises the first exception): the job gets a row
    that cannot train (mask 0, reward 0), as TRL's failed row, and its error is logged once and kept."""
    with caplog.at_level(logging.WARNING, logger="prorl_cli.integrations.verl"):
        out = job_output(FAILED, filler_id=2)
    assert out.prompt_ids == [2] and out.response_ids == [2] and out.response_mask == [0]
    assert out.response_logprobs == [0.0] and out.reward_score == 0.0 and out.num_turns == 0
    error = "run: ValueError: invalid literal for int(): 'many'"
    assert out.extra_fields == {"prorl_job_id": "j9", "prorl_state": "failed", "policy_versions": [-1],
                                "prorl_samples": 0, "prorl_error": f"job failed: {error}"}
    (record,) = caplog.records
    assert "j9" in record.getMessage() and error in record.getMessage()
    # Failed with calls kept: still no verdict on them (a lost backend, a timeout), so not trained either.
    kept = JobResult(**{**_result("j8", TWO_TURNS).__dict__, "state": "timed_out", "reward": None})
    assert job_output(kept, filler_id=2).response_mask == [0]
    # A done job keeps its trajectory, with the same extra fields as a failed row's.
    done = job_output(_result("j1", TWO_TURNS), filler_id=2)
    assert done.response_mask == [1, 1, 0, 0, 1] and done.extra_fields.keys() == out.extra_fields.keys()
    # The conversion alone still refuses, now naming the job's error.
    with pytest.raises(NoTrajectory, match=r"j9 \(failed\).*run: ValueError: invalid literal"):
        loop_output(FAILED)


def test_verl_sampling_in_prorls_terms(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """veRL's ``top_k: 0`` is off (prorl's -1; prorl refuses 0); a param prorl lacks is named once if it matters."""
    monkeypatch.setattr(verl, "_WARNED_DROPPED", set())
    # What veRL 0.9's worker sends (repetition_penalty pinned to 1.0): nothing to warn about.
    sent = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "logprobs": True}
    with caplog.at_level(logging.WARNING, logger="prorl_cli.integrations.verl"):
        assert prorl_sampling(sent) == {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
        SamplingParams(**prorl_sampling(sent))
        assert not caplog.records
        for _ in range(3):
            assert prorl_sampling({**sent, "repetition_penalty": 1.1, "top_k": 20})["top_k"] == 20
    (record,) = caplog.records
    assert "repetition_penalty=1.1" in record.getMessage()
    assert prorl_sampling({"max_new_tokens": 7}) == {"max_tokens": 7}
    # vLLM's stop: one string, or None for none; prorl's is a list, checked where the record is built.
    assert SamplingParams(**prorl_sampling({"stop": "</answer>"})).stop == ["</answer>"]
    assert SamplingParams(**prorl_sampling({"stop": None})).stop == []


def test_each_calls_max_tokens() -> None:
    """response_length bounds the whole multi-turn response: each call's limit comes from the row, else the
    trainer config, else veRL's sampling, else response_length, and is never above response_length."""
    assert call_max_tokens(64) == 64
    assert call_max_tokens(64, sampling={"max_new_tokens": 40}) == 40
    assert call_max_tokens(64, None, 16, {"max_tokens": 40}) == 16
    np = pytest.importorskip("numpy")
    assert call_max_tokens(64, np.int64(5), 16) == 5
    assert call_max_tokens(64, 500) == 64
    with pytest.raises(ConfigError, match="prorl_max_tokens must be a positive integer, got 0"):
        call_max_tokens(64, 0)
    with pytest.raises(ConfigError, match="custom.prorl_max_tokens"):
        call_max_tokens(64, None, "many")


GSM8K_PROMPT = [{"role": "user", "content": 'What is 2+3? Let\'s think step by step and output the final answer after "####".'}]
#: A row of verl's GSM8K preprocessing as veRL's dataset hands it to the agent loop.
GSM8K_ROW = {"data_source": "openai/gsm8k", "prompt": GSM8K_PROMPT, "raw_prompt": GSM8K_PROMPT, "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 7, "split": "train"}, "index": 7}


def test_verl_rows_of_the_domain_tasks_become_their_instances() -> None:
    """A verl-style row (chat ``prompt``, ``reward_model.ground_truth``) goes through prorl's dataset loader, as
    ``prorl submit`` loads it, instead of reaching the handler as veRL's fields."""
    import json

    np = pytest.importorskip("numpy")
    assert instance_of("math_agent", GSM8K_ROW) == {"question": "What is 2+3?", "answer": "5", "id": 7}
    assert instance_of("math", {**GSM8K_ROW, "prorl_instance": None}) == {"problem": "What is 2+3?", "answer": "5", "id": 7}
    eurus = {"prompt": np.array([{"role": "user", "content": "Print n+1."}], dtype=object), "extra_info": {"index": 3},
             "reward_model": {"style": "rule", "ground_truth": json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})}}
    assert instance_of("code", eurus) == {"question": "Print n+1.", "tests": [{"input": "1\n", "output": "2\n"}], "id": 3}
    # A row's own instance wins; other tasks' rows and rows of other shapes are sent as they are.
    assert instance_of("math_agent", {**GSM8K_ROW, "prorl_instance": {"question": "q"}}) == {"question": "q"}
    assert instance_of("multiturn", GSM8K_ROW) == GSM8K_ROW
    assert instance_of("math", {"problem": "p", "answer": np.int64(3)}) == {"problem": "p", "answer": 3}
    with pytest.raises(DatasetError, match="veRL row 7: .*'answer'"):
        instance_of("math", {**GSM8K_ROW, "reward_model": {"ground_truth": None}})


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
    """``prorl`` lands in veRL's real registry under a path hydra can import (as veRL's worker instantiates it)."""
    need_module("verl", "verl")
    from hydra.utils import get_class
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from prorl_cli.integrations.verl import register_agent_loop

    cls = register_agent_loop()
    assert get_class(_agent_loop_registry["prorl"]["_target_"]) is cls


def _verl_config(model: Path, agent_loops: Path, *overrides: str) -> Any:
    """veRL's full trainer config (its flattened reference file; hydra's composition is not needed) for the tiny model."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    base = OmegaConf.load(str(files("verl.trainer.config") / "_generated_ppo_trainer.yaml"))
    return OmegaConf.merge(base, OmegaConf.from_dotlist([
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.prompt_length=256",
        "actor_rollout_ref.rollout.response_length=64",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.agent.default_agent_loop=prorl",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_loops}",
        *overrides,
    ]))


def _generate_on_a_deployment(worker: Any, batch: Any, engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              inference: dict[str, Any]) -> Any:
    """``worker.generate_sequences(batch)`` against a real broker and node, with ``engine`` behind a bridge."""
    import asyncio

    import prorl_cli.integrations.verl_loop as verl_loop
    from tests.fakes.bridges import ThreadBridge
    from tests.harness import Deployment
    from tests.inference.conftest import HANDLERS

    async def generate() -> Any:
        try:
            return await worker.generate_sequences(batch)
        finally:
            await verl_loop.close_client()

    d = Deployment(tmp_path / "home", config={"inference": inference})
    bridge: Any = None
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        bridge = ThreadBridge(d, "b1", engine)
        for key, value in d.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("PRORL_DEPLOYMENT", d.name)
        return asyncio.run(generate())
    finally:
        d.close()
        if bridge is not None:
            bridge.close()


# hydra 1.4 warns on every instantiate without an execution whitelist; veRL's worker passes none.
@pytest.mark.filterwarnings("ignore:hydra.utils.instantiate:UserWarning")
def test_verls_worker_runs_the_prorl_loop_on_a_deployment(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """veRL's ``AgentLoopWorker`` (built from veRL's config, no Ray cluster) runs ``prorl`` on a real deployment.

    The worker looks the loop up in veRL's registry, instantiates it through
    hydra and calls ``run`` as in training; the batch it returns holds the
    job's trajectory token for token, and ``DataProto.from_dict`` takes
    ``verl_batch`` of the same job's export with the same ids.
    """
    need_module("verl", "verl")

    import numpy as np
    import pyarrow.parquet as pq
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry

    import prorl_cli.integrations.verl_loop as verl_loop
    from prorl_cli.training.export import write_samples_parquet
    from tests.fakes.engines import CountingEngine

    results: list[JobResult] = []

    async def spy_run_job(*args: Any, **kwargs: Any) -> Any:  # the real run_job, keeping its JobResult to compare with
        out, result = await run_job(*args, **kwargs)
        results.append(result)
        return out, result

    monkeypatch.setattr(verl_loop, "run_job", spy_run_job)
    # What registers the loop in a veRL worker's process is the shipped agent_loop_config_path file.
    monkeypatch.delitem(_agent_loop_registry, "prorl", raising=False)
    # No LLM server: prorl's loop generates through prorl's backends, never through veRL's client.
    worker = AgentLoopWorker(_verl_config(tiny_model, AGENT_LOOP_CONFIG), llm_client=None)  # type: ignore[arg-type]
    assert _agent_loop_registry["prorl"]["_target_"] == "prorl_cli.integrations.verl_loop.ProrlAgentLoop"
    batch = DataProto.from_dict(non_tensors={
        "raw_prompt": np.array([[{"role": "user", "content": "hi"}]], dtype=object),
        "prorl_task": np.array(["multiturn"], dtype=object),
        "prorl_instance": np.array([{"tokenizer": str(tiny_model), "turns": 2}], dtype=object),
    })

    out = _generate_on_a_deployment(worker, batch, CountingEngine(), tmp_path, monkeypatch, {"generate_timeout_s": 60.0})

    (result,) = results
    assert result.ok and out.non_tensor_batch["prorl_job_id"][0] == result.job_id
    # The expected tensors, built from the raw trajectory: the first prompt, then each call's sampled ids
    # (mask 1, the engine's logprobs) with the observation between calls (mask 0, logprob 0).
    first, second = Trajectory.from_dict(result.output["trajectory"]).calls
    observation = second.prompt_ids[len(first.prompt_ids) + len(first.output_ids):]
    response = first.output_ids + observation + second.output_ids
    mask = [1] * len(first.output_ids) + [0] * len(observation) + [1] * len(second.output_ids)
    logprobs = first.logprobs + [0.0] * len(observation) + second.logprobs
    p, r = len(first.prompt_ids), len(response)
    assert observation and out.batch["prompts"].shape == (1, 256) and out.batch["responses"].shape == (1, 64)
    assert out.batch["prompts"][0, -p:].tolist() == first.prompt_ids and not out.batch["attention_mask"][0, :256 - p].any()
    assert out.batch["responses"][0, :r].tolist() == response
    assert out.batch["response_mask"][0].tolist() == mask + [0] * (64 - r)
    assert out.batch["rollout_log_probs"][0, :r].tolist() == pytest.approx(logprobs)
    assert out.batch["rm_scores"][0, r - 1].item() == result.reward == 1.0 and out.batch["rm_scores"].sum().item() == 1.0
    assert out.non_tensor_batch["__num_turns__"][0] == 4

    # The same job through an export: verl_batch's tensors load into veRL's DataProto with the same ids.
    rows = pq.read_table(write_samples_parquet(tmp_path / "s.parquet", samples_from_results([result]).samples)).to_pylist()
    tensors, non_tensors = verl_batch(rows)
    exported = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    assert len(exported) == 1 and exported.batch["prompts"][0].tolist() == first.prompt_ids
    assert exported.batch["responses"][0].tolist() == response and exported.batch["response_mask"][0].tolist() == mask


class SamplingEngine(CountingEngine):
    """CountingEngine's answers, counting each call's (max_tokens, top_k): the sampling that reached the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[tuple[int, int]] = Counter()

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.seen[(sampling.max_tokens, sampling.top_k)] += 1
        return await super().generate(prompt_ids, sampling)


@pytest.mark.filterwarnings("ignore:hydra.utils.instantiate:UserWarning")
def test_verls_worker_keeps_a_batch_with_a_failed_job_and_a_verl_row(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """veRL's ``AgentLoopWorker`` on a real deployment, one batch of four rows and veRL's ``top_k: 0``:

    a two-turn job whose row bounds each call (``prorl_max_tokens``), a job that fails in RUN (a masked
    row with reward 0 and the job's error, not an exception ending the batch), a verl GSM8K row for
    ``math_agent`` (mapped by the math loader: the job runs, where the raw row lacked ``question``) whose
    calls get the trainer config's ``custom.prorl_max_tokens``, and a verl row without an answer (the
    loader refuses it: masked too, never submitted).
    """
    need_module("verl", "verl")

    import numpy as np
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    import prorl_cli.integrations.verl_loop as verl_loop

    sent: list[tuple[Any, JobResult]] = []

    async def spy_run_job(client: Any, task: str, instance: Any, *args: Any, **kwargs: Any) -> Any:
        out, result = await run_job(client, task, instance, *args, **kwargs)
        sent.append((instance, result))
        return out, result

    monkeypatch.setattr(verl_loop, "run_job", spy_run_job)
    worker = AgentLoopWorker(_verl_config(tiny_model, AGENT_LOOP_CONFIG, "actor_rollout_ref.rollout.top_k=0",
                                          "actor_rollout_ref.rollout.custom.prorl_max_tokens=9"),
                             llm_client=None)  # type: ignore[arg-type]

    def column(*values: Any) -> Any:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    hi = [{"role": "user", "content": "hi"}]
    batch = DataProto.from_dict(non_tensors={
        "raw_prompt": column(hi, hi, GSM8K_PROMPT, GSM8K_PROMPT),
        "prompt": column(None, None, GSM8K_PROMPT, GSM8K_PROMPT),
        "reward_model": column(None, None, GSM8K_ROW["reward_model"], {"style": "rule", "ground_truth": ""}),
        "extra_info": column({}, {}, GSM8K_ROW["extra_info"], {"index": 8}),
        "prorl_task": column("multiturn", "multiturn", "math_agent", "math_agent"),
        "prorl_max_tokens": column(5, None, None, None),
        "prorl_instance": column({"tokenizer": str(tiny_model), "turns": 2},
                                 {"tokenizer": str(tiny_model), "turns": "many"}, None, None),
    })

    engine = SamplingEngine()
    with caplog.at_level(logging.WARNING, logger="prorl_cli.integrations.verl"):
        out = _generate_on_a_deployment(worker, batch, engine, tmp_path, monkeypatch,
                                        {"generate_timeout_s": 60.0, "tokenizer": str(tiny_model)})

    (_, ok), (_, failed), (gsm8k, mapped) = sorted(sent, key=lambda s: list(out.non_tensor_batch["prorl_job_id"]).index(s[1].job_id))
    assert ok.ok and not failed.ok and failed.error is not None and failed.error["type"] == "ValueError"
    assert gsm8k == {"question": "What is 2+3?", "answer": "5", "id": 7} and mapped.ok, mapped.error
    # Row 1: masked, reward 0, the job's error beside it and logged once.
    assert len(out) == 4 and out.batch["response_mask"][1].sum().item() == 0
    assert out.batch["rm_scores"][1].sum().item() == 0.0 and out.batch["rm_scores"][0].sum().item() == 1.0
    errors = out.non_tensor_batch["prorl_error"]
    assert "run: ValueError: invalid literal" in errors[1] and errors[0] is None and errors[2] is None
    assert sum(failed.job_id in r.getMessage() and "ValueError" in r.getMessage() for r in caplog.records) == 1
    assert out.batch["response_mask"][0].sum().item() == 4 and out.batch["response_mask"][2].sum().item() == 2
    # Row 3: refused by the loader, never a job.
    assert out.non_tensor_batch["prorl_job_id"][3] is None and out.batch["response_mask"][3].sum().item() == 0
    assert "row not loadable: veRL row 8: missing field 'answer'" in errors[3]
    # Each call's max_tokens: the row's 5 (two calls), else the config's 9; veRL's top_k 0 reached the engine as -1.
    assert engine.seen == Counter({(5, -1): 2, (9, -1): 1})


def test_export_rows_that_do_not_line_up_are_refused_not_shifted(tmp_path: Path) -> None:
    """Each column is padded on its own, so a column one short would shift every later value off its token
    without any shape error: the batches name the row and column instead."""
    torch = pytest.importorskip("torch")
    from prorl_cli.integrations.verl import RowMismatch
    from prorl_cli.training.export import sample_row

    built = samples_from_results([_result("a", TWO_TURNS, 1.0), _result("b", [ModelCall([5, 6], [7], [-0.7], "stop")], 0.0)])
    rows = [sample_row(s) for s in built.samples]
    tensors, _ = verl_batch(rows)
    assert tensors["responses"].dtype == torch.long and tensors["old_log_probs"].dtype == torch.float32
    assert tensors["attention_mask"].shape == tensors["input_ids"].shape == tensors["position_ids"].shape
    short = [dict(rows[0], old_log_probs=rows[0]["old_log_probs"][:-1]), rows[1]]
    with pytest.raises(RowMismatch, match="verl_batch: row 0 has 7 old_log_probs for 8 input_ids"):
        verl_batch(short)
    with pytest.raises(RowMismatch, match="row 1 has prompt_length 9 for 3 input_ids"):
        verl_batch([rows[0], dict(rows[1], prompt_length=9)])
    with pytest.raises(RowMismatch, match="lacks column"):
        verl_batch([{k: v for k, v in rows[0].items() if k != "advantages"}])
    nemo = nemo_rl_batch(rows)
    assert nemo["input_ids"].dtype == torch.long and nemo["token_mask"].shape == nemo["input_ids"].shape
    with pytest.raises(RowMismatch, match="nemo_rl_batch: row 1 has 2 token_mask for 3 input_ids"):
        nemo_rl_batch([rows[0], dict(rows[1], token_mask=[0, 1])])
    with pytest.raises(RowMismatch, match="row 0 has input_lengths 7 for 8 input_ids"):
        nemo_rl_batch([dict(rows[0], input_lengths=7), rows[1]])
