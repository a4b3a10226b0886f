"""veRL with prorl as its rollout engine: an agent loop, and prorl's exports in veRL's and NeMo-RL's batch layouts.

**The agent loop.** veRL (0.9) runs each sample through an agent loop
registered by name (``@register("name")`` on a subclass of
``verl.experimental.agent_loop.agent_loop.AgentLoopBase``) whose
``async run(sampling_params, **dataset_fields)`` returns an
``AgentLoopOutput``: ``prompt_ids``, ``response_ids`` (model and tool
tokens), ``response_mask`` (1 on model tokens), ``response_logprobs``,
``reward_score``, ``num_turns``, ``metrics``, ``extra_fields``.
:func:`register_agent_loop` registers ``prorl`` (the class lives in
:mod:`prorl_cli.integrations.verl_loop`, which imports veRL): its ``run`` submits the sample as one prorl job
(:func:`instance_of`: the dataset row's ``prorl_instance`` field, else a
verl-style row mapped by prorl's dataset loader, else the row itself; task
from its ``prorl_task`` field or ``$PRORL_TASK``; deployment
``$PRORL_DEPLOYMENT``) and returns the token-exact trajectory, so prorl's
routing, cancellation and sandboxes apply; veRL's own server manager is not
used. A job that fails becomes a masked row with reward 0
(:func:`failed_output`), as in the TRL integration, not an exception that
would end veRL's whole batch. In a trainer's config:
``actor_rollout_ref.rollout.agent.default_agent_loop: prorl`` and
``agent_loop_config_path`` set to :data:`AGENT_LOOP_CONFIG` (veRL's workers
are other processes, whose registry only that file fills).

**Batches from exports.** :func:`verl_batch` and :func:`nemo_rl_batch` turn
rows of a prorl export (``write_samples_parquet``) into the tensors that
``verl.DataProto.from_dict`` and NeMo-RL's ``BatchedDataDict`` take.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli.domains.datasets import FORMATS, LOADERS
from prorl_cli.exceptions import ConfigError, ProrlError
from prorl_cli.protocol import JobResult, SamplingParams
from prorl_cli.training.samples import NO_VERSION, build_samples

log = logging.getLogger(__name__)

#: The name the agent loop is registered under in veRL.
AGENT_NAME = "prorl"

#: Each model call's ``max_tokens``: a dataset field of this name (per row), else this key of veRL's
#: ``actor_rollout_ref.rollout.custom`` map (veRL's extension point; ``+actor_rollout_ref.rollout.custom.prorl_max_tokens=N``).
MAX_TOKENS_KEY = "prorl_max_tokens"

#: veRL's ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` file naming prorl's loop
#: (veRL's workers are other processes: this file is what registers the loop there).
AGENT_LOOP_CONFIG = Path(__file__).with_name("verl_agent_loops.yaml")


class NoTrajectory(ProrlError, ValueError):
    """A job result without a token-level trajectory (the job failed before any model call, or its handler keeps none)."""


class RowMismatch(ProrlError, ValueError):
    """An export row whose per-token columns do not line up with its ``input_ids`` (or lacks a column a batch needs)."""


def _check_rows(rows: Sequence[dict[str, Any]], scalars: Sequence[str], per_token: Sequence[str], batch: str) -> None:
    """Raise :class:`RowMismatch` unless every row has ``per_token`` columns as long as its ``input_ids``.

    The batches pad each column on its own, so a column of another length would not fail: it would
    shift every later value off its token.
    """
    for i, r in enumerate(rows):
        missing = [k for k in ("input_ids", *scalars, *per_token) if k not in r]
        if missing:
            raise RowMismatch(f"{batch}: row {i} lacks column(s) {missing}")
        n = len(r["input_ids"])
        if "input_lengths" in r and r["input_lengths"] != n:
            raise RowMismatch(f"{batch}: row {i} has input_lengths {r['input_lengths']} for {n} input_ids")
        if "prompt_length" in r and not 0 <= r["prompt_length"] <= n:
            raise RowMismatch(f"{batch}: row {i} has prompt_length {r['prompt_length']} for {n} input_ids")
        for k in per_token:
            if len(r[k]) != n:
                raise RowMismatch(f"{batch}: row {i} has {len(r[k])} {k} for {n} input_ids")


@dataclass
class LoopOutput:
    """The fields of veRL's ``AgentLoopOutput`` that a prorl trajectory fills (``metrics`` aside)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    reward_score: float | None
    num_turns: int
    extra_fields: dict[str, Any] = field(default_factory=dict)


def loop_output(result: JobResult) -> LoopOutput:
    """veRL's agent-loop output from a finished prorl job (its first token-exact sample).

    ``num_turns`` counts messages as veRL does (user, assistant and tool
    turns): the trajectory's messages when it kept them, else the first
    user turn plus one assistant turn per call and one observation between calls.
    ``extra_fields`` carries the job id, its state, the policy version of each
    sampled token and how many samples the rollout split into.
    """
    traj = _trajectory(result)
    if traj is None:
        error = job_error(result)
        raise NoTrajectory(f"job {result.job_id} ({result.state}) has no trajectory with model calls"
                           + (f"; its error: {error}" if error else ""))
    samples, report = build_samples(traj, rollout_id=result.job_id, group_id=result.group_id or result.job_id,
                                    reward=float(result.reward or 0.0), job_id=result.job_id)
    s = samples[0]
    p = s.prompt_length
    messages = traj.get("messages")
    n_calls = len(traj["calls"])
    turns = len(messages) if isinstance(messages, list) and messages else 2 * n_calls
    return LoopOutput(
        prompt_ids=list(s.input_ids[:p]),
        response_ids=list(s.input_ids[p:]),
        response_mask=list(s.response_mask[p:]),
        response_logprobs=list(s.old_log_probs[p:]),
        reward_score=result.reward,
        num_turns=turns,
        extra_fields=_extra_fields(
            result.job_id, result.state,
            [v if m else NO_VERSION for v, m in zip(s.policy_versions[p:], s.response_mask[p:], strict=True)],
            report.samples, None),
    )


def _trajectory(result: JobResult) -> dict[str, Any] | None:
    """The result's trajectory when it holds at least one model call, else ``None``."""
    output = result.output if isinstance(result.output, dict) else {}
    traj = output.get("trajectory")
    return traj if isinstance(traj, dict) and traj.get("calls") else None


def _extra_fields(job_id: str | None, state: str, versions: list[int], samples: int, error: str | None) -> dict[str, Any]:
    # The same keys on every row, failed or not: veRL stacks each key across the batch (and batches across
    # steps), so a key only some rows had would come out as None on the others.
    return {"prorl_job_id": job_id, "prorl_state": state, "policy_versions": versions, "prorl_samples": samples,
            "prorl_error": error}


def job_error(result: JobResult) -> str | None:
    """The job's error as one line, ``stage: Type: message`` (``None`` when it reported none)."""
    err = result.error
    if isinstance(err, dict) and err:
        return f"{err.get('stage', '?')}: {err.get('type', '?')}: {err.get('message', '')}"
    return result.critical_error


def failed_output(reason: str, filler_id: int, job_id: str | None = None, state: str = "failed") -> LoopOutput:
    """The row of a sample that gave no trajectory to train on: masked, reward 0, ``reason`` logged once.

    As the TRL integration's failed row: one ``filler_id`` token (the tokenizer's end-of-sequence) as
    prompt and as response, response mask 0 so no loss reaches it, reward 0 for its group's baseline.
    One token rather than none: veRL puts the reward on the last response token, and an all-padding
    row would be a zero-length sequence in the actor's forward pass.
    """
    log.warning("veRL sample %s: %s; it gets a masked one-token row with reward 0", job_id or "(not submitted)", reason)
    return LoopOutput(prompt_ids=[filler_id], response_ids=[filler_id], response_mask=[0], response_logprobs=[0.0],
                      reward_score=0.0, num_turns=0,
                      extra_fields=_extra_fields(job_id, state, [NO_VERSION], 0, reason))


def job_output(result: JobResult, filler_id: int) -> LoopOutput:
    """:func:`loop_output` of a job that finished ``done`` with model calls; else :func:`failed_output`.

    A job that did not finish ``done`` is not trained on even when it kept some calls, as in the TRL
    integration: its reward is no verdict on them (a backend lost mid-rollout, a timeout, an EVAL that
    raised) and may be missing, and veRL drops every row's reward when one row's is ``None``.
    """
    if not result.ok:
        return failed_output(f"job {result.state}: {job_error(result) or 'no error reported'}", filler_id,
                             result.job_id, result.state)
    if _trajectory(result) is None:  # e.g. its prompt alone filled the model's context
        return failed_output("job done without any model call in its trajectory", filler_id, result.job_id, result.state)
    return loop_output(result)


def fit_lengths(out: LoopOutput, prompt_length: int, response_length: int) -> bool:
    """Cut ``out`` to veRL's ``rollout.prompt_length`` (keeping the prompt's end) and ``response_length`` (its start).

    veRL pads every sample to those widths and cannot hold a longer one; its
    own loops cut the same way. Returns whether anything was cut.
    """
    cut = len(out.prompt_ids) > prompt_length or len(out.response_ids) > response_length
    out.prompt_ids = out.prompt_ids[-prompt_length:] if prompt_length > 0 else []
    out.response_ids = out.response_ids[:response_length]
    out.response_mask = out.response_mask[:response_length]
    out.response_logprobs = out.response_logprobs[:response_length]
    out.extra_fields["policy_versions"] = out.extra_fields["policy_versions"][:response_length]
    return cut


def plain(value: Any) -> Any:
    """``value`` with numpy (or torch) arrays and scalars turned into lists and Python numbers, recursively.

    veRL hands each dataset field to ``run`` as an element of a numpy object
    array, so fields can be numpy values; a prorl instance travels as msgpack,
    which carries only plain values.
    """
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist") and callable(value.tolist):
        return plain(value.tolist())
    return value


#: Tasks that take a domain loader's instance under other field names: ``math_agent`` reads the math
#: loader's ``problem`` as its ``question`` (and its ``answer`` as it is).
_LOADER_OF: dict[str, tuple[str, dict[str, str]]] = {"math_agent": ("math", {"problem": "question"})}


def is_verl_row(row: Mapping[str, Any]) -> bool:
    """Whether ``row`` is a verl-preprocessed dataset row: a chat ``prompt`` and ``reward_model.ground_truth``."""
    reward_model = row.get("reward_model")
    return isinstance(row.get("prompt"), list) and isinstance(reward_model, dict) and "ground_truth" in reward_model


def instance_of(task: str, row: Mapping[str, Any]) -> Any:
    """The prorl instance of one veRL dataset row (numpy values made plain, :func:`plain`).

    The row's ``prorl_instance`` when it has one; else, for a domain task (``math``, ``code``, ``search``,
    ``swe``, and ``math_agent`` through the math loader) and a verl-style row (:func:`is_verl_row`:
    verl's GSM8K, DAPO-Math-17k, Eurus-2-RL-Data), the instance ``prorl submit`` loads from the same
    row (:mod:`prorl_cli.domains.datasets`), so the job gets ``problem``/``question`` and ``answer`` or
    ``tests`` rather than veRL's fields; else the row itself. A row the loader cannot map raises its
    :class:`~prorl_cli.exceptions.DatasetError`.
    """
    given = row.get("prorl_instance")
    if given is not None:  # None: a batch where only other rows carry an instance
        return plain(given)
    fields = plain(dict(row))
    domain, renamed = (task, {}) if task in LOADERS else _LOADER_OF.get(task, (None, {}))
    if domain is None or not is_verl_row(fields):
        return fields
    index = fields.get("index", (fields.get("extra_info") or {}).get("index"))
    fmt = "verl" if "verl" in FORMATS[domain] else "auto"
    instance = LOADERS[domain](fields, f"veRL row {index if index is not None else '?'}", fmt)
    return {renamed.get(k, k): v for k, v in instance.items()}


async def run_job(client: Any, task: str, instance: Any, sampling: dict[str, Any] | None = None,
                  timeout_s: float | None = None, filler_id: int = 0) -> tuple[LoopOutput, JobResult]:
    """Run ``instance`` as one prorl job on an :class:`~prorl_cli.client.AsyncRolloutClient`; return veRL's fields.

    A job that failed gives :func:`failed_output`'s masked row (``filler_id`` its one token), not an exception.
    """
    result = await client.process(task, instance, sampling=prorl_sampling(sampling or {}), timeout_s=timeout_s)
    return job_output(result, filler_id), result


#: veRL sampling params prorl has no field for, at the value that leaves sampling as it is: dropped silently
#: there (veRL 0.9 always sends ``repetition_penalty=1.0``), named once in a warning otherwise.
_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
#: veRL params with nothing to pass on: prorl returns every sampled token's log-prob anyway.
_MOOT = {"logprobs", "max_new_tokens"}
#: The dropped params already warned about (once per process: veRL sends the same params with every sample).
_WARNED_DROPPED: set[str] = set()


def prorl_sampling(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """veRL's sampling params (vLLM names) as prorl's SamplingParams fields.

    veRL's ``top_k: 0`` means off, as prorl's ``-1`` does (prorl refuses 0); a ``stop`` string is a list of
    one, and ``stop: None`` none. A param prorl has no field
    for (``repetition_penalty``, ...) is dropped, with one warning per param when its value would have
    changed sampling; ``max_new_tokens`` (SGLang's name) is ``max_tokens`` when that is not given.
    """
    names = set(SamplingParams.__dataclass_fields__)
    out = {k: v for k, v in sampling.items() if k in names}
    if out.get("top_k") == 0:
        out["top_k"] = -1
    # vLLM takes one stop string as a string, and None for none; prorl's ``stop`` is a list.
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    elif "stop" in out and out["stop"] is None:
        del out["stop"]
    if "max_tokens" not in out and isinstance(sampling.get("max_new_tokens"), int):
        out["max_tokens"] = sampling["max_new_tokens"]
    for k, v in sampling.items():
        if k in names or k in _MOOT or k in _WARNED_DROPPED or (k in _NEUTRAL and v == _NEUTRAL[k]):
            continue
        _WARNED_DROPPED.add(k)
        log.warning("veRL sampling param %s=%r has no prorl equivalent and is not applied (warned once)", k, v)
    return out


def call_max_tokens(response_length: int, row_value: Any = None, config_value: Any = None,
                    sampling: Mapping[str, Any] | None = None) -> int:
    """Each model call's ``max_tokens``: the row's ``prorl_max_tokens``, else the trainer config's, else veRL's
    sampling ``max_tokens`` / ``max_new_tokens``, else ``response_length``; never above ``response_length``.

    ``response_length`` bounds the whole response, every turn and observation together; veRL's own
    server gives each call that much too, so without a smaller limit one long first turn fills the
    response and the later turns are cut away (:func:`fit_lengths`).
    """
    sampling = sampling or {}
    for where, value in ((f"dataset field {MAX_TOKENS_KEY}", row_value),
                         (f"actor_rollout_ref.rollout.custom.{MAX_TOKENS_KEY}", config_value),
                         ("veRL sampling max_tokens", sampling.get("max_tokens")),
                         ("veRL sampling max_new_tokens", sampling.get("max_new_tokens"))):
        value = plain(value)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"prorl agent loop: {where} must be a positive integer, got {value!r}")
        return min(value, response_length)
    return response_length


def register_agent_loop() -> type:
    """Register prorl's agent loop as ``prorl`` in the installed veRL's registry; return the class.

    The class is :class:`prorl_cli.integrations.verl_loop.ProrlAgentLoop`
    (defined at module level so that veRL's hydra-based instantiation can
    import it by name). Raises ``ImportError`` naming the extra when veRL is
    not installed.
    """
    try:
        from prorl_cli.integrations.verl_loop import ProrlAgentLoop
    except ImportError as e:
        raise ImportError(f"prorl's veRL agent loop needs veRL: pip install 'prorl[verl]' ({e})") from e
    return ProrlAgentLoop


# ----------------------------------------------------------------------------- export rows into trainer batches


def verl_batch(rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, non_tensors)`` for ``verl.DataProto.from_dict`` from rows of a prorl export.

    Prompts are left-padded and responses right-padded to the batch's longest
    (veRL's layout); ``input_ids``/``attention_mask``/``position_ids`` are
    their concatenation; the response-side tensors (``response_mask``,
    ``old_log_probs``, ``advantages``, ``token_level_scores``) cover the ids
    after each row's ``prompt_length``. ``non_tensors["uid"]`` is the GRPO group.
    A row whose columns do not line up with its ``input_ids`` raises :class:`RowMismatch`.
    """
    import numpy as np
    import torch

    if not rows:
        raise ValueError("verl_batch needs at least one row")
    _check_rows(rows, ("prompt_length", "group_id"),
                ("attention_mask", "response_mask", "old_log_probs", "advantages", "token_level_scores"), "verl_batch")
    width_p = max(r["prompt_length"] for r in rows)
    width_r = max(len(r["input_ids"]) - r["prompt_length"] for r in rows)

    def split(r: dict[str, Any], key: str) -> tuple[list[Any], list[Any]]:
        p, seq = r["prompt_length"], list(r[key])
        return [0] * (width_p - p) + seq[:p], seq[p:] + [0] * (width_r - (len(seq) - p))

    def tensor(key: str, dtype: Any, part: int) -> Any:
        return torch.tensor([split(r, key)[part] for r in rows], dtype=dtype)

    prompts, responses = tensor("input_ids", torch.long, 0), tensor("input_ids", torch.long, 1)
    attention = torch.cat([tensor("attention_mask", torch.long, 0), tensor("attention_mask", torch.long, 1)], 1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": torch.clamp(attention.cumsum(-1) - 1, min=0),
        "response_mask": tensor("response_mask", torch.long, 1),
        "old_log_probs": tensor("old_log_probs", torch.float32, 1),
        "advantages": tensor("advantages", torch.float32, 1),
        "token_level_scores": tensor("token_level_scores", torch.float32, 1),
    }
    return tensors, {"uid": np.array([r["group_id"] for r in rows], dtype=object)}


def nemo_rl_batch(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The tensors of NeMo-RL's ``BatchedDataDict`` (right-padded to the longest row) from rows of a prorl export."""
    import torch

    if not rows:
        raise ValueError("nemo_rl_batch needs at least one row")
    _check_rows(rows, ("input_lengths", "sample_mask"),
                ("advantages", "prev_logprobs", "generation_logprobs", "token_mask"), "nemo_rl_batch")
    width = max(r["input_lengths"] for r in rows)

    def pad(key: str, dtype: Any) -> Any:
        return torch.tensor([list(r[key]) + [0] * (width - len(r[key])) for r in rows], dtype=dtype)

    return {
        "input_ids": pad("input_ids", torch.long),
        "input_lengths": torch.tensor([r["input_lengths"] for r in rows]),
        "advantages": pad("advantages", torch.float32),
        "prev_logprobs": pad("prev_logprobs", torch.float32),
        "generation_logprobs": pad("generation_logprobs", torch.float32),
        "token_mask": pad("token_mask", torch.float32),
        "sample_mask": torch.tensor([r["sample_mask"] for r in rows]),
    }
