"""The token-exact agent loop: one token buffer per trajectory.

:class:`TokenSession` is the buffer. Its first prompt comes from the chat
template; after each call the model's output ids are appended verbatim, and
:meth:`TokenSession.add_messages` appends only the ids of the new
observation and the next assistant header. Before every call it checks that
the prompt is a token-exact extension of the previous prompt + output and
records any violation on the trajectory (a handler may pass its own
``prompt_ids``, e.g. to truncate; that is allowed but never hidden).

:func:`run_tool_agent` is the usual loop on top: generate, parse tool calls
from the decoded output, run the tools, append their results, repeat. With an
:class:`~prorl_cli.agent.tools.InlineToolParser` (Search-R1's tags) the
results continue the model's own turn instead (:meth:`TokenSession.cut_output`,
:meth:`TokenSession.continue_turn`).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from prorl_cli import timebase
from prorl_cli.agent.chat import ChatTokens
from prorl_cli.agent.tools import (
    HermesToolParser,
    InlineToolParser,
    Tool,
    ToolCall,
    ToolFn,
    ToolParser,
    get_tool_parser,
)
from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.exceptions import AgentLoopError, ContextLengthExceeded, InferenceError, JobEnded
from prorl_cli.inference.contract import Generation
from prorl_cli.observe.timeline import TOOL, record_span
from prorl_cli.protocol import SamplingParams

log = logging.getLogger(__name__)
#: Tokenizers (``id(ChatTokens)``) already warned about a parser that cannot read their model's calls.
_WARNED: set[int] = set()

#: ``await generate(prompt_ids, sampling) -> Generation`` (``JobContext.generate`` fits).
GenerateFn = Callable[[list[int], SamplingParams], Awaitable[Generation]]
#: Takes the loop's live trajectory (``JobContext.record_trajectory`` is one).
Recorder = Callable[[Trajectory], None]
#: ``record_into``'s default: the recorder of the job running in this task (:data:`JOB_RECORDER`).
FROM_CONTEXT: Any = object()
#: The running job's recorder; the node sets it for each job's task (``None`` outside a job).
JOB_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("prorl_job_recorder", default=None)

__all__ = [
    "FROM_CONTEXT", "JOB_RECORDER", "GenerateFn", "Recorder", "TokenSession", "ToolFn", "call_tool", "run_tool_agent",
    "tool_functions",
]


class TokenSession:
    """The token buffer of one trajectory, and its record."""

    def __init__(
        self, chat: ChatTokens, generate: GenerateFn, messages: list[dict[str, Any]], *, model: str | None = None
    ) -> None:
        self.chat = chat
        self._generate = generate
        self.trajectory = Trajectory(messages=[dict(m) for m in messages], model=model)
        #: The prompt the next call will be sampled under.
        self.prompt_ids: list[int] = chat.initial_prompt(messages)
        self._awaiting_observation = False
        #: The next call continues the last assistant turn (:meth:`continue_turn`), not a new one.
        self._same_turn = False

    @property
    def calls(self) -> list[ModelCall]:
        return self.trajectory.calls

    def _check_prefix(self, prompt: list[int]) -> bool:
        """Record (never repair) a prompt that does not extend the last prompt + output."""
        if not self.calls:
            return True
        prev = self.calls[-1]
        expected = prev.prompt_ids + prev.output_ids
        if prompt[: len(expected)] == expected:
            return True
        at = next((i for i, (a, b) in enumerate(zip(prompt, expected, strict=False)) if a != b), min(len(prompt), len(expected)))
        message = (
            f"call {len(self.calls)}: prompt ({len(prompt)} ids) is not a token-exact extension of call "
            f"{len(self.calls) - 1}'s prompt + output ({len(expected)} ids); first difference at index {at}"
        )
        log.warning("%s", message)
        self.trajectory.violations.append({"call": len(self.calls), "index": at, "message": message})
        return False

    async def generate(self, sampling: SamplingParams, *, prompt_ids: list[int] | None = None) -> ModelCall:
        """Sample the next assistant turn under :attr:`prompt_ids` (or the ``prompt_ids`` given).

        A failed call is recorded in ``trajectory.error`` and re-raised.
        """
        prompt = list(prompt_ids) if prompt_ids is not None else list(self.prompt_ids)
        prefix_ok = self._check_prefix(prompt)
        try:
            gen = await self._generate(prompt, sampling)
        except InferenceError as e:
            self.trajectory.error = {"call": len(self.calls), "type": type(e).__name__, "message": str(e)}
            self.trajectory.stop_reason = "cancelled" if isinstance(e, JobEnded) else "error"
            raise
        call = ModelCall(
            prompt_ids=prompt,
            output_ids=list(gen.output_ids),
            logprobs=list(gen.logprobs),
            finish_reason=gen.finish_reason,
            backend_id=gen.backend_id,
            prefix_ok=prefix_ok,
            text=self.chat.turn_text(gen.output_ids),
            policy_version=getattr(gen, "policy_version", None),
            top_logprobs=getattr(gen, "top_logprobs", None),
            stop_string=getattr(gen, "stop_string", None),
            structured=sampling.structured,
        )
        traj = self.trajectory
        if self.calls and prefix_ok:
            new = prompt[len(traj.sequence_ids) :]
        else:  # first call, or a violation: the whole sequence restarts at this prompt
            traj.sequence_ids, traj.loss_mask, traj.logprobs = [], [], []
            new = prompt
        traj.sequence_ids += new + call.output_ids
        traj.loss_mask += [0] * len(new) + [1] * len(call.output_ids)
        traj.logprobs += [0.0] * len(new) + call.logprobs
        self.calls.append(call)
        if self._same_turn and traj.messages and traj.messages[-1].get("role") == "assistant":
            traj.messages[-1]["content"] += call.text
        else:
            traj.messages.append({"role": "assistant", "content": call.text})
        self._same_turn = False
        self.prompt_ids = prompt + call.output_ids
        self._awaiting_observation = True
        return call

    def cut_output(self, keep: int) -> None:
        """Keep only the first ``keep`` output ids of the last call, as if sampling had stopped there.

        Where an engine generated past an inline action's end (Search-R1's ``</search>``, sent as a stop
        string: an engine that cannot match them, or a close the parser does not count): the kept ids are what
        the model sampled, with their log-probs, and what the next prompt extends; the rest is dropped from
        the call, the sequence and the prompt, never re-tokenized. A cut call's ``finish_reason`` is ``stop``,
        as an engine reports a stop string.
        """
        if not self._awaiting_observation:
            raise AgentLoopError("cut_output() follows a generate() call, before its observation")
        call = self.calls[-1]
        if not 0 <= keep <= len(call.output_ids):
            raise AgentLoopError(f"cut_output({keep}): the last call has {len(call.output_ids)} output ids")
        drop = len(call.output_ids) - keep
        if drop == 0:
            return
        traj = self.trajectory
        old_text = call.text
        call.output_ids, call.logprobs = call.output_ids[:keep], call.logprobs[:keep]
        if call.top_logprobs is not None:
            call.top_logprobs = call.top_logprobs[:keep]
        call.finish_reason = "stop"
        call.text = self.chat.turn_text(call.output_ids)
        del traj.sequence_ids[-drop:], traj.loss_mask[-drop:], traj.logprobs[-drop:]
        del self.prompt_ids[-drop:]
        last = traj.messages[-1]
        if last.get("role") == "assistant" and last["content"].endswith(old_text):
            last["content"] = last["content"][: len(last["content"]) - len(old_text)] + call.text

    def continue_turn(self, text: str) -> list[int]:
        """Append ``text`` (an observation) right after the model's output, inside the same assistant turn.

        No chat-template boundary is rendered: the ids are those of ``text`` encoded alone, so the next
        prompt is the last prompt + output + these ids exactly. They are masked out of the loss as every
        observation is. Returns the ids appended.
        """
        if not self._awaiting_observation:
            what = "before the first generate()" if not self.calls else "twice after the same generate()"
            raise AgentLoopError(f"continue_turn() called {what}: it follows a generate() call")
        delta = self.chat.encode(text)
        self.prompt_ids = self.prompt_ids + delta
        if self.trajectory.messages and self.trajectory.messages[-1].get("role") == "assistant":
            self.trajectory.messages[-1]["content"] += text
        self._awaiting_observation = False
        self._same_turn = True
        return delta

    def add_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Append observations (tool results, user turns) and the next assistant header.

        Pass all messages of one turn at once. Returns the ids appended.
        """
        if not self._awaiting_observation:
            what = "before the first generate()" if not self.calls else "twice after the same generate()"
            raise AgentLoopError(f"add_messages() called {what}: it follows a generate() call; "
                                 "pass one turn's messages at once")
        delta = self.chat.continuation(self.calls[-1].output_ids, messages)
        self.prompt_ids = self.prompt_ids + delta
        self.trajectory.messages += [dict(m) for m in messages]
        self._awaiting_observation = False
        return delta


async def call_tool(tools: Mapping[str, ToolFn], call: ToolCall) -> str:
    """Run one parsed tool call; errors become the observation text (the model sees them).

    Each call is an event on the running job's timeline (its tool, duration and whether it worked).
    """
    started = timebase.now()
    text = await _call_tool(tools, call)
    record_span(TOOL, started, {"tool": call.name or "?", "ok": not text.startswith("error: ")})
    return text


async def _call_tool(tools: Mapping[str, ToolFn], call: ToolCall) -> str:
    if call.error:
        return f"error: {call.error}"
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r}; available: {sorted(tools)}"
    try:
        result = fn(**call.arguments)
        if inspect.isawaitable(result):
            result = await result
    except Exception as e:  # a tool's failure is the model's observation, not the job's
        return f"error: {type(e).__name__}: {e}"
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError) as e:  # a result JSON cannot encode is the tool's failure, like any other
        return f"error: tool {call.name!r} returned a {type(result).__name__} that is not JSON-serializable: {e}"


async def run_tool_agent(
    generate: GenerateFn,
    chat: ChatTokens,
    messages: list[dict[str, Any]],
    tools: Mapping[str, ToolFn] | Sequence[Tool],
    *,
    sampling: SamplingParams,
    max_turns: int = 8,
    parser: ToolParser | None = None,
    model: str | None = None,
    record_into: Recorder | dict[str, Any] | None = FROM_CONTEXT,
) -> Trajectory:
    """Generate, run tool calls, append their results; stop on a turn without tool calls.

    A failing generate call ends the loop with ``stop_reason == "error"`` (or
    ``"cancelled"`` when the broker ended the job: :class:`JobEnded`) and
    ``trajectory.error`` set; the trajectory so far is returned, not lost.

    ``record_into``: where the trajectory goes, so a RUN that times out, fails
    or is cancelled still returns its tokens, with ``stop_reason`` ``timeout``
    (set by the node), ``error`` or ``cancelled``. A callable (a
    :data:`Recorder`, e.g. ``ctx.record_trajectory``) gets the live
    trajectory before the first call; a dict gets a copy under
    ``"trajectory"`` (``"stop_reason"`` and ``"turns"`` beside it) after every
    model call. By default: the job running in this task (:data:`JOB_RECORDER`),
    whatever ``generate`` is (a wrapper of ``ctx.generate`` records the same);
    ``None`` keeps nothing.
    """
    if record_into is FROM_CONTEXT:
        record_into = JOB_RECORDER.get()
    tools = tool_functions(tools)
    parser = parser or get_tool_parser("hermes")
    _warn_if_template_lacks_calls(chat, parser, tools)
    if not sampling.stop_token_ids and chat.stop_token_ids:
        sampling = sampling.with_set(stop_token_ids=list(chat.stop_token_ids))
    if isinstance(parser, InlineToolParser) and not set(parser.stop) <= set(sampling.stop):
        # The engine stops at the action's closing tag; the cut after each call stays, for one that overshoots.
        sampling = sampling.with_set(stop=list(dict.fromkeys([*sampling.stop, *parser.stop])))
    session = TokenSession(chat, generate, messages, model=model)
    traj = session.trajectory
    snapshot_into: dict[str, Any] | None = None
    if isinstance(record_into, dict):
        snapshot_into = record_into
    elif record_into is not None:
        record_into(traj)  # live: the recorder sees every call as it is made
    try:
        return await _tool_turns(session, tools, sampling, max_turns, parser, snapshot_into)
    except asyncio.CancelledError:
        traj.stop_reason = "cancelled"  # a stage timeout arrives as a cancel too; the node relabels it
        raise
    except Exception as e:
        # A call stopped because the broker ended the job is the job's cancel arriving first, not a failure.
        traj.stop_reason = "cancelled" if isinstance(e, JobEnded) else "error"
        traj.error = traj.error or {"call": len(traj.calls), "type": type(e).__name__, "message": str(e)}
        raise
    finally:
        if snapshot_into is not None:
            _record(snapshot_into, traj)


def _warn_if_template_lacks_calls(chat: ChatTokens, parser: ToolParser, tools: Mapping[str, ToolFn]) -> None:
    """Say so, once per tokenizer, when the Hermes parser reads a model whose template never writes its calls.

    A Llama 3.x, Mistral or DeepSeek model calls tools in another format: the parser finds no call, and every
    rollout would end silently after its first turn, as if the model had answered.
    """
    template = str(getattr(chat.tokenizer, "chat_template", "") or "")
    if not tools or not isinstance(parser, HermesToolParser) or "<tool_call>" in template or id(chat) in _WARNED:
        return
    _WARNED.add(id(chat))
    log.warning("the chat template of %s never writes <tool_call>: the hermes tool parser will likely find no "
                "tool calls in this model's turns; register a parser for its format (register_tool_parser) "
                "and pass it as parser=", getattr(chat.tokenizer, "name_or_path", "the tokenizer"))


def tool_functions(tools: Mapping[str, ToolFn] | Sequence[Tool]) -> dict[str, ToolFn]:
    """Tool functions by name, from a mapping or from :class:`Tool` declarations (without context)."""
    if isinstance(tools, Mapping):
        return dict(tools)
    out: dict[str, ToolFn] = {}
    for tool in tools:
        if tool.fn is None or tool.context:
            raise ValueError(f"tool {tool.name!r} needs a job context or an implementation: run it through ctx.agent()")
        out[tool.name] = tool.fn
    return out


def _record(into: dict[str, Any], traj: Trajectory) -> None:
    into["trajectory"] = traj.to_dict()
    into["stop_reason"] = traj.stop_reason
    into["turns"] = len(traj.calls)


async def _tool_turns(
    session: TokenSession, tools: Mapping[str, ToolFn], sampling: SamplingParams, max_turns: int,
    parser: ToolParser, record_into: dict[str, Any] | None,
) -> Trajectory:
    traj = session.trajectory
    for turn in range(max_turns):
        try:
            call = await session.generate(sampling)
        except ContextLengthExceeded:
            # The conversation filled the model's context: the rollout ends here, as one cut off does, and is
            # scored as it stands. Any other failed call (a backend gone or failing) is not the policy's doing:
            # it ends the RUN as a failure, so a trainer never takes it for a rollout that earned its reward.
            return traj
        if isinstance(parser, InlineToolParser):
            session.cut_output(_action_ids(session.chat, call.output_ids, parser))
        if record_into is not None:
            _record(record_into, traj)
        tool_calls = parser.parse(call.text)
        if not tool_calls:
            traj.stop_reason = "stop" if call.finish_reason == "stop" else call.finish_reason
            return traj
        if turn == max_turns - 1:
            break
        results = [await call_tool(tools, tc) for tc in tool_calls]
        if isinstance(parser, InlineToolParser):
            session.continue_turn(parser.observation(tool_calls, results))
            continue
        observations: list[dict[str, Any]] = [
            {"role": "tool", "name": tc.name, "content": r} for tc, r in zip(tool_calls, results, strict=True)
        ]
        if _template_reads_call_ids(session.chat):
            _link_calls(traj.messages[-1], tool_calls, observations, turn)
        session.add_messages(observations)
    traj.stop_reason = "max_turns"
    return traj


def _action_ids(chat: ChatTokens, output_ids: list[int], parser: InlineToolParser) -> int:
    """How many output ids an inline format keeps: up to the id that completes the turn's first action.

    That id may carry text past the closing tag (``>\\n``); it is kept whole, as a stop string keeps it. A
    turn with no action keeps all but its end-of-turn id: the format's note follows inside the same turn.
    """
    keep = chat.shortest_prefix(output_ids, lambda text: parser.action_end(text) is not None)
    if keep is None:
        return len(output_ids) - 1 if output_ids and output_ids[-1] in chat.stop_token_ids else len(output_ids)
    return keep


def _template_reads_call_ids(chat: ChatTokens) -> bool:
    """Whether the chat template reads ``tool_call_id`` (Mistral's raise without one); ChatML's never do.

    A template that never names the key renders the same text with or without it, so only these get ids,
    and the messages of every other model stay as they were.
    """
    return "tool_call_id" in str(getattr(chat.tokenizer, "chat_template", "") or "")


def _tool_call_id(turn: int, index: int) -> str:
    """The id of call ``index`` of model call ``turn``: 9 alphanumerics, as Mistral's templates demand.

    Derived from the position alone, so rendering the trajectory's messages again gives the same text as the
    observation the loop appended: 5 digits of turn, 4 of index, distinct for any real rollout.
    """
    return f"{turn:05d}{index:04d}"


def _link_calls(
    assistant: dict[str, Any], tool_calls: list[ToolCall], observations: list[dict[str, Any]], turn: int
) -> None:
    """Give each call of this turn an id, on the assistant message's ``tool_calls`` and on its result."""
    ids = [_tool_call_id(turn, i) for i in range(len(tool_calls))]
    assistant["tool_calls"] = [
        {"id": call_id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
        for call_id, tc in zip(ids, tool_calls, strict=True)
    ]
    for call_id, obs in zip(ids, observations, strict=True):
        obs["tool_call_id"] = call_id
