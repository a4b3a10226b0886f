"""The token-exact agent loop with a scripted model (fixed ids through the real generate contract)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent import (
    HermesToolParser,
    TokenSession,
    Trajectory,
    read_jsonl,
    run_tool_agent,
    write_jsonl,
    write_parquet,
)
from prorl_cli.agent.chat import ChatTemplateError, ChatTokens
from prorl_cli.exceptions import InferenceError
from prorl_cli.handlers.math_agent import calculator, final_number
from prorl_cli.inference import Generation
from prorl_cli.protocol import SamplingParams


class ScriptedModel:
    """Returns the token ids of scripted assistant texts, one per call, and records prompts."""

    def __init__(self, chat: ChatTokens, texts: list[str], fail_at: int | None = None,
                 fail_with: InferenceError | None = None) -> None:
        self.chat = chat
        self.outputs = [chat.encode(t) for t in texts]
        self.prompts: list[list[int]] = []
        self.fail_at = fail_at
        self.fail_with = fail_with or InferenceError("backend_error: backend b1 unregistered")

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        i = len(self.prompts) - 1
        if i == self.fail_at:
            raise self.fail_with
        ids = self.outputs[i]
        return Generation(ids, [-0.5 - 0.01 * k for k in range(len(ids))], "stop", "scripted")


TOOL_TURN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call><|im_end|>'
ANSWER_TURN = "The answer is 391.<|im_end|>"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_tool_agent_appends_only_new_ids_and_masks_model_tokens(chat: ChatTokens) -> None:
    model = ScriptedModel(chat, [TOOL_TURN, TOOL_TURN, ANSWER_TURN])
    messages = [{"role": "user", "content": "What is 17 * 23?"}]
    traj = run(run_tool_agent(model, chat, messages, {"calculator": calculator}, sampling=SamplingParams(max_tokens=64)))
    assert traj.stop_reason == "stop" and traj.error is None and traj.token_exact
    assert len(traj.calls) == 3
    assert traj.calls[0].prompt_ids == chat.initial_prompt(messages)
    for prev, call in zip(traj.calls, traj.calls[1:], strict=False):
        base = prev.prompt_ids + prev.output_ids
        assert call.prompt_ids[: len(base)] == base
        delta = call.prompt_ids[len(base):]
        # Only the turn's close, the observation and the next header are new, tokenized alone.
        assert delta == chat.encode("\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # The whole sequence is the last prompt + output; the mask marks exactly the model's tokens.
    last = traj.calls[-1]
    assert traj.sequence_ids == last.prompt_ids + last.output_ids
    model_positions = [i for i, m in enumerate(traj.loss_mask) if m == 1]
    assert [traj.sequence_ids[i] for i in model_positions] == [t for c in traj.calls for t in c.output_ids]
    assert [traj.logprobs[i] for i in model_positions] == [lp for c in traj.calls for lp in c.logprobs]
    assert all(traj.logprobs[i] == 0.0 for i, m in enumerate(traj.loss_mask) if m == 0)
    assert traj.messages[-2] == {"role": "tool", "name": "calculator", "content": "391"}
    assert final_number(traj.calls[-1].text) == "391"
    # The stop id (end of turn) was added to sampling for the model.
    assert chat.stop_token_ids == [chat.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_token_path_equals_template_when_model_writes_canonical_tokens(chat: ChatTokens) -> None:
    """If the model's ids are what the tokenizer would produce, the token path equals a full re-render."""
    session = TokenSession(chat, ScriptedModel(chat, ["hello there<|im_end|>", "bye<|im_end|>"]), [{"role": "user", "content": "hi"}])
    run(session.generate(SamplingParams()))
    session.add_messages([{"role": "user", "content": "and again, having fun?"}])
    full = chat.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
         {"role": "user", "content": "and again, having fun?"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert session.prompt_ids == chat.encode(full)


def test_length_cut_turn_is_closed_by_the_template_suffix(chat: ChatTokens) -> None:
    session = TokenSession(chat, ScriptedModel(chat, ["cut off mid"]), [{"role": "user", "content": "hi"}])
    call = run(session.generate(SamplingParams()))
    delta = session.add_messages([{"role": "tool", "content": "x"}])
    assert chat.decode(delta).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")
    assert session.prompt_ids[: len(call.prompt_ids) + len(call.output_ids)] == call.prompt_ids + call.output_ids


def test_violation_is_recorded_not_fixed(chat: ChatTokens) -> None:
    model = ScriptedModel(chat, ["one<|im_end|>", "two<|im_end|>"])
    session = TokenSession(chat, model, [{"role": "user", "content": "hi"}])
    run(session.generate(SamplingParams()))
    session.add_messages([{"role": "user", "content": "more"}])
    # A handler that re-tokenizes its own prompt text breaks continuity: it must show.
    retokenized = chat.encode(chat.decode(session.prompt_ids).replace("one", "on e"))
    run(session.generate(SamplingParams(), prompt_ids=retokenized))
    traj = session.trajectory
    assert not traj.token_exact
    assert traj.calls[1].prefix_ok is False and traj.calls[1].prompt_ids == retokenized
    assert model.prompts[1] == retokenized  # sent as given, never repaired
    (v,) = traj.violations
    assert v["call"] == 1 and "not a token-exact extension" in v["message"]
    assert traj.sequence_ids == retokenized + traj.calls[1].output_ids


def test_a_failed_call_fails_the_loop_and_keeps_what_it_made(chat: ChatTokens) -> None:
    """A backend gone mid-rollout is no policy's doing: the loop raises (the job fails, a sampler drops the
    group) instead of returning a rollout a handler would score as if the model had stopped."""
    model = ScriptedModel(chat, [TOOL_TURN, TOOL_TURN], fail_at=1)
    kept: dict[str, Any] = {}
    with pytest.raises(InferenceError, match="backend b1 unregistered"):
        run(run_tool_agent(model, chat, [{"role": "user", "content": "q"}], {"calculator": calculator},
                           sampling=SamplingParams(), record_into=kept))
    traj = kept["trajectory"]
    assert traj["stop_reason"] == "error" and kept["turns"] == 1
    assert traj["error"] == {"call": 1, "type": "InferenceError", "message": "backend_error: backend b1 unregistered"}


def test_a_conversation_that_fills_the_context_ends_the_rollout(chat: ChatTokens) -> None:
    from prorl_cli.exceptions import ContextLengthExceeded

    model = ScriptedModel(chat, [TOOL_TURN, TOOL_TURN], fail_at=1,
                          fail_with=ContextLengthExceeded("prompt of 70 tokens leaves no room to generate: the "
                                                          "model's maximum context length is 64 tokens"))
    traj = run(run_tool_agent(model, chat, [{"role": "user", "content": "q"}], {"calculator": calculator},
                              sampling=SamplingParams()))
    assert traj.stop_reason == "error" and traj.error is not None and traj.error["type"] == "ContextLengthExceeded"
    assert len(traj.calls) == 1


def test_max_turns_and_tool_errors_become_observations(chat: ChatTokens) -> None:
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call><|im_end|>'
    junk = "<tool_call>{not json}</tool_call><|im_end|>"
    model = ScriptedModel(chat, [bad, junk, TOOL_TURN])
    traj = run(run_tool_agent(model, chat, [{"role": "user", "content": "q"}], {"calculator": calculator},
                              sampling=SamplingParams(), max_turns=3))
    assert traj.stop_reason == "max_turns" and len(traj.calls) == 3
    assert traj.messages[2]["content"].startswith("error: ValueError: unsupported expression element Call")
    assert traj.messages[4]["content"].startswith("error: tool call is not valid JSON")


def test_hermes_parser() -> None:
    p = HermesToolParser()
    calls = p.parse('x<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>'
                    '<tool_call>{"name": "b", "arguments": [1]}</tool_call><tool_call>[]</tool_call>')
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [("a", {"k": 1}, True), ("b", {}, False), ("", {}, False)]
    assert p.parse("no calls here") == []


def test_calculator_refuses_a_power_too_large_to_compute() -> None:
    assert calculator("(9**99)**10") == str((9**99) ** 10)  # about 950 digits: fine
    with pytest.raises(ValueError, match="result too large"):
        calculator("(9**99)**99")
    # Each exponent is small, yet 9**96059601 would hold the node's event loop for minutes.
    with pytest.raises(ValueError, match="result too large"):
        calculator("(((9**99)**99)**99)**99")


def test_add_messages_needs_a_generate_first(chat: ChatTokens) -> None:
    session = TokenSession(chat, ScriptedModel(chat, []), [{"role": "user", "content": "hi"}])
    with pytest.raises(RuntimeError, match="follows a generate"):
        session.add_messages([{"role": "user", "content": "x"}])


def test_template_without_content_is_refused(chat: ChatTokens) -> None:
    class NoContent:
        chat_template = "x"

        def apply_chat_template(self, messages: Any, **kw: Any) -> str:
            return "".join(m["role"] for m in messages)

    with pytest.raises(ChatTemplateError, match="drops assistant content"):
        ChatTokens(NoContent())


def test_jsonl_and_parquet_round_trip(chat: ChatTokens, tmp_path: Path) -> None:
    traj = run(run_tool_agent(ScriptedModel(chat, [TOOL_TURN, ANSWER_TURN]), chat, [{"role": "user", "content": "q"}],
                              {"calculator": calculator}, sampling=SamplingParams()))
    rows = [{"job_id": "j1", "reward": 1.0, "trajectory": traj}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    (back,) = read_jsonl(path)
    assert isinstance(back["trajectory"], Trajectory) and back["trajectory"] == traj
    assert json.loads(path.read_text())["trajectory"]["format"] == "prorl.trajectory/1"
    if importlib.util.find_spec("pyarrow") is None:
        pytest.skip("pyarrow is not installed (pip install 'prorl[parquet]')")
    import pyarrow.parquet as pq

    table = pq.read_table(write_parquet(tmp_path / "t.parquet", rows)).to_pylist()
    assert table[0]["sequence_ids"] == traj.sequence_ids and table[0]["loss_mask"] == traj.loss_mask
    assert table[0]["token_exact"] is True and table[0]["n_calls"] == 2
    assert Trajectory.from_dict(json.loads(table[0]["trajectory"])) == traj


def test_math_agent_handler_uses_the_calculator_and_scores(chat: ChatTokens, tiny_model: Path, tmp_path: Path) -> None:
    import logging

    from prorl_cli.config import ProrlConfig
    from prorl_cli.handlers.math_agent import MathAgentHandler
    from prorl_cli.node.handler import JobContext, Services
    from prorl_cli.protocol import JobSpec

    model = ScriptedModel(chat, [TOOL_TURN, ANSWER_TURN])

    class ScriptedServices(Services):
        async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Any:
            return await model(prompt_ids, sampling)

    def context(answer: str) -> JobContext:
        return JobContext(
            spec=JobSpec(job_id="j", task="math_agent"),
            instance={"question": "What is 17 * 23?", "answer": answer, "tokenizer": str(tiny_model)},
            node_id="n", run_dir=tmp_path, config=ProrlConfig(), services=ScriptedServices(),
            log=logging.getLogger("test"), handler=handler,
        )

    handler = MathAgentHandler()
    ctx = context("391")
    for stage in (handler.init, handler.run, handler.eval):
        run(stage(ctx))
    traj = Trajectory.from_dict(ctx.output["trajectory"])
    assert ctx.reward == 1.0 and ctx.output["predicted"] == "391" and traj.token_exact
    assert traj.messages[3] == {"role": "tool", "name": "calculator", "content": "391"}
    # The tool schema is in the system turn of the first prompt, rendered by the template.
    assert '"name": "calculator"' in chat.decode(traj.calls[0].prompt_ids)
    model.prompts.clear()
    wrong = context("392")
    for stage in (handler.init, handler.run, handler.eval):
        run(stage(wrong))
    assert wrong.reward == 0.0


def test_top_logprobs_asked_for_reach_the_trajectory(chat: ChatTokens) -> None:
    class WithAlternatives(ScriptedModel):
        async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
            gen = await super().__call__(prompt_ids, sampling)
            gen.top_logprobs = [[(t, -0.1), (t + 1, -2.5)] for t in gen.output_ids]
            return gen

    model = WithAlternatives(chat, [ANSWER_TURN])
    traj = run(run_tool_agent(model, chat, [{"role": "user", "content": "q"}], {"calculator": calculator},
                              sampling=SamplingParams(top_logprobs=2)))
    (call,) = traj.calls
    assert call.top_logprobs == [[(t, -0.1), (t + 1, -2.5)] for t in call.output_ids]
    # Through the record a trainer reads (JSON): the pairs as lists.
    back = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert back.calls[0].top_logprobs == [[[t, -0.1], [t + 1, -2.5]] for t in call.output_ids]
