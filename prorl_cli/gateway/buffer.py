"""The job's token buffer(s) behind the text API: token-exact continuation or a recorded new segment.

A harness resends the whole conversation at every call. When a request's
messages are the messages of an earlier request, plus the reply exactly as
the gateway returned it, plus new messages, the new prompt is that request's
prompt + the sampled output ids verbatim + only the new messages rendered
through the chat template (``TokenSession``'s rule, through the same
:meth:`ChatTokens.continuation`).

A job holds one buffer (*segment*) per conversation: a main agent and its
sub-agents, handoffs or parallel branches each extend their own, whatever
order their calls come in. A request extends the segment of the same agent
and tools whose messages are the longest prefix of its own. One that extends
none starts a new segment from the template's rendering of the whole
request: a new conversation when no segment of that agent opens the same way
(the same system messages and first task message: :func:`opening`), else an
edit of a conversation's history (truncated, rewritten or asked again),
whose reason (which message differed) is recorded in
``trajectory.violations``, whether the conversation it edits has a call in
flight or not. Nothing is ever re-tokenized silently.

A plain completion (``/v1/completions``: a text prompt, no messages) follows
the same rule in ids: it extends the segment of the same agent whose last
prompt + output ids are the longest prefix of its own (a text conversation,
or a chat turn the harness rendered itself); one that extends none is a new
conversation, unless it opens as a segment of its agent did (starts with
that segment's first prompt) and then differs: an edit, recorded as above.

The record is a :class:`~prorl_cli.agent.Trajectory` in ``run_tool_agent``'s
format, each call tagged with its segment, so ``prorl_cli.training.samples``
builds samples from it as from any other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.agent.chat import ChatTokens
from prorl_cli.agent.loop import GenerateFn
from prorl_cli.agent.tools import ToolCall, ToolParser
from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.gateway.messages import ChatRequest, tool_call_message
from prorl_cli.inference.contract import Generation, first_stop
from prorl_cli.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams, derive_seed

log = logging.getLogger(__name__)

#: Requests of one job answered at once by default (the harness setting ``max_concurrent_requests``).
DEFAULT_MAX_CONCURRENT = 8
#: Generations discarded at most per request for not honouring its ``tool_choice`` (harness ``tool_choice_retries``).
DEFAULT_TOOL_CHOICE_RETRIES = 2
#: ``chat_for(tools) -> ChatTokens``: the tokenizer's template with these tool schemas.
ChatFactory = Callable[[list[dict[str, Any]] | None], ChatTokens]


@dataclass
class Segment:
    """One token buffer: a conversation the gateway can extend token-exactly."""

    index: int
    chat: ChatTokens
    tools_key: str
    #: The agent whose conversation this is (None: unnamed).
    agent: str | None = None
    #: Canonical messages so far, ending with the reply as returned (what the next request must start with).
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: The messages of the request in flight, until its reply is recorded (``messages`` then).
    asked: list[dict[str, Any]] = field(default_factory=list)
    #: Per recorded call, ``(its index in the trajectory, how many messages its request had)``: a segment only
    #: grows, so that request was ``messages[:n]`` (how a repeated request is told from an edit, for its reason).
    asks: list[tuple[int, int]] = field(default_factory=list)
    #: The prompt ids of its first call (set when it begins): how a conversation opens, in ids, for text prompts
    #: (a text prompt that starts with it but extends no segment edits this conversation; one that does not is
    #: a conversation of its own).
    first_prompt: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    sequence_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: Set while a call of this conversation is in flight; set to done (and cleared) when it is recorded.
    in_flight: asyncio.Event | None = None


@dataclass
class Reply:
    """One answered request: the call as recorded, and what the API layer returns."""

    call: ModelCall
    content: str
    tool_calls: list[ToolCall]
    #: ``stop``, ``length`` or ``tool_calls`` (the API layers translate).
    finish_reason: str
    #: The stop string that ended the turn, if one did.
    stop_string: str | None
    segment: int
    continued: bool
    #: Per output token, ``(token id, logprob)`` alternatives when the request asked for them and the engine
    #: returned them (``Generation.top_logprobs``); None otherwise.
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.call.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.call.output_ids)


@dataclass
class _Turn:
    """One generation of a chat turn: what the engine returned, cut at the request's stop string, and its text."""

    gen: Generation
    out: list[int]
    logprobs: list[float]
    finish: str
    stop_string: str | None
    text: str
    #: The constraint it was sampled under (``SamplingParams.structured``), or None.
    structured: dict[str, Any] | None


def meets_constraint(structured: dict[str, Any], text: str) -> bool:
    """Whether ``text`` is what ``structured`` (``SamplingParams.structured``) allows, so an answer sampled free
    needs no constrained sample: JSON that the schema validates (``json``), a JSON object (``json_object``), a full
    match of the regex (Python's dialect), one of the choices. A grammar is never checked here: False."""
    kind, spec = next(iter(structured.items()))
    if kind == "choice":
        return text in spec
    if kind == "regex":
        try:
            return re.fullmatch(spec, text) is not None
        except re.error:
            return False
    if kind not in ("json", "json_object"):
        return False
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # a turn of ten thousand "[" is not an answer either
        return False
    if kind == "json_object":
        return isinstance(value, dict)
    import jsonschema  # the gateway extra's; only requests with a schema and tools get here
    import referencing.exceptions

    if not isinstance(spec.get("$schema", ""), str):
        return False  # validator_for reads it as a URI
    validator = jsonschema.validators.validator_for(spec)
    try:
        validator.check_schema(spec)
        return bool(validator(spec).is_valid(value))
    except (jsonschema.SchemaError, referencing.exceptions.Unresolvable, RecursionError):
        return False  # a schema the validator cannot read, resolve or descend: the engine decides, constrained


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


#: The ``tools_key`` of a segment a text prompt began: no chat request's (a JSON list), so chat never matches it.
TEXT_TOOLS_KEY = "text"


#: Roles that set a conversation up before its first task message.
_SETUP_ROLES = frozenset({"system", "developer"})


def opening(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How a conversation opens: its leading system (or developer) messages and the message after them, the task.

    Two requests that open alike belong to one conversation; sub-agents that share a system prompt but get
    their own tasks open differently, so each is a conversation of its own.
    """
    k = 0
    while k < len(messages) and messages[k].get("role") in _SETUP_ROLES:
        k += 1
    return messages[: k + 1]


def _first_difference(new: list[dict[str, Any]], old: list[dict[str, Any]]) -> str:
    for i, (a, b) in enumerate(zip(new, old, strict=False)):
        if a != b:
            fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            return (f"message {i} ({a.get('role')}) differs from the conversation so far "
                    f"(field(s) {', '.join(fields)})")
    if len(new) < len(old):
        return (f"the request's {len(new)} message(s) are the first of the {len(old)} of the conversation so far: "
                "the later ones were dropped")
    # Only for a conversation whose call is in flight (its reply not yet returned): the request asks again.
    return (f"the request repeats the conversation's request still being answered ({len(old)} message(s)): "
            "a retry, or another sample of the same turn")


class TokenBuffer:
    """The token buffers of one job and its trajectory (see the module docstring).

    Conversations are answered concurrently (sub-agents a harness runs in
    parallel each have a call in flight), one call at a time per
    conversation: a request that matches a conversation whose call is still
    in flight waits for it, then is matched again (a retry or a fork of that
    conversation cannot extend a reply it has not seen). Calls are recorded
    in the order they end. Matching, segment creation and recording run
    between awaits, so no two requests interleave inside them.
    """

    def __init__(
        self,
        chat_for: ChatFactory,
        generate: GenerateFn,
        parser: ToolParser,
        *,
        sampling: SamplingParams,
        model: str | None = None,
        on_record: Callable[[Trajectory], None] | None = None,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        tool_choice_retries: int = DEFAULT_TOOL_CHOICE_RETRIES,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        if tool_choice_retries < 0:
            raise ValueError(f"tool_choice_retries must be at least 0, got {tool_choice_retries}")
        #: Generations discarded at most per request whose turn does not honour its ``tool_choice``.
        self.tool_choice_retries = tool_choice_retries
        self._chat_for = chat_for
        self._generate = generate
        self.parser = parser
        self.sampling = sampling
        self.trajectory = Trajectory(model=model)
        self.segments: list[Segment] = []
        self._on_record = on_record
        #: Plain completions (``complete_text``) are answered one at a time, in the order they came; chat requests
        #: do not wait for them (a text call that extends a chat conversation waits for its call in flight).
        self._text_lock = asyncio.Lock()
        #: Requests of this job answered at once; more wait their turn (a runaway harness cannot flood the engines).
        self._slots = asyncio.Semaphore(max_concurrent)
        self._split_warned = False

    # ------------------------------------------------------------ prompts
    def _match(self, messages: list[dict[str, Any]], key: str, agent: str | None) -> Segment | None:
        """The segment of this agent and tools whose messages are the longest prefix of the request's, if any."""
        best: Segment | None = None
        for seg in self.segments:
            n = len(seg.messages)
            if (seg.agent == agent and seg.tools_key == key and n and len(messages) >= n
                    and (best is None or n > len(best.messages)) and messages[:n] == seg.messages):
                best = seg
        return best

    def _reason(self, messages: list[dict[str, Any]], key: str, agent: str | None) -> str | None:
        """Why a request that extends no segment is an edit of a conversation; None for a new conversation.

        An edit keeps a conversation's :func:`opening` (its system messages and task) and changes what
        follows, or changes its tools; a request that opens as no segment of its agent does is another
        conversation (a sub-agent, a handoff, a parallel branch), not a violation. A segment whose first
        call is still in flight counts by the request it is answering, so the verdict does not depend on
        whether the harness sent its requests one after another or at once.
        """
        start = opening(messages)
        same_start = [seg for seg in self.segments
                      if seg.agent == agent and (seg.messages or seg.asked) and opening(seg.messages or seg.asked) == start]
        if not same_start:
            return None
        # A request that asks exactly what an earlier call asked is said to be one (a harness retrying, or
        # sampling a turn again for best-of-k), not a truncation of the conversation that call's reply began.
        repeated = self._asked_before(messages, key, agent)
        if repeated is not None:
            return f"the same messages as call {repeated} ({len(messages)} message(s)): a retry, or another sample of it"
        last = same_start[-1]
        if last.tools_key != key:
            return "the request's tools differ from the conversation so far"
        return _first_difference(messages, last.messages or last.asked)

    def _asked_before(self, messages: list[dict[str, Any]], key: str, agent: str | None) -> int | None:
        """The first recorded call of this agent and tools whose request had exactly ``messages``, if any."""
        n = len(messages)
        first: int | None = None
        for seg in self.segments:
            if seg.agent != agent or seg.tools_key != key:
                continue
            for call, asked in seg.asks:  # one call at most per length: each call of a segment asks more
                if asked == n and (first is None or call < first) and seg.messages[:n] == messages:
                    first = call
                    break
        return first

    async def _claim(self, req: ChatRequest) -> tuple[list[int], Segment, bool, str | None]:
        """(prompt ids, segment, whether it continues that segment, why a new segment began); the segment is
        marked in flight (a new one is added to ``segments`` at once, so concurrent ones get their own index)."""
        key = tools_key(req.tools)
        while True:
            seg = self._match(req.messages, key, req.agent)
            if seg is None or seg.in_flight is None:
                break
            await seg.in_flight.wait()
        if seg is not None:
            new = req.messages[len(seg.messages):]
            delta = seg.chat.continuation(seg.output_ids, new)
            prompt, continued, reason = seg.prompt_ids + seg.output_ids + delta, True, None
        else:
            chat = self._chat_for(req.tools)
            reason = self._reason(req.messages, key, req.agent)
            self._warn_split(req.messages, key, req.agent)
            seg = self._new_segment(chat, key, req.agent)
            prompt, continued = chat.initial_prompt(req.messages), False
            seg.asked, seg.first_prompt = req.messages, prompt
        seg.in_flight = asyncio.Event()
        return prompt, seg, continued, reason

    def _match_ids(self, prompt: list[int], agent: str | None) -> Segment | None:
        """The segment of this agent whose last prompt + output ids are the longest prefix of ``prompt``, if any
        (a segment with no recorded call has none)."""
        best: Segment | None = None
        best_n = 0
        for seg in self.segments:
            held = seg.prompt_ids + seg.output_ids
            if seg.agent == agent and len(held) > best_n and prompt[: len(held)] == held:
                best, best_n = seg, len(held)
        return best

    def _text_reason(self, prompt: list[int], agent: str | None) -> str | None:
        """Why a text prompt that extends no segment is an edit of a conversation; None for a new conversation.

        As :meth:`_reason` for chat, with a conversation's first prompt for its opening: a prompt that starts
        with it keeps how that conversation opened and changes what followed (truncated, rewritten, asked again);
        one that starts with no segment's first prompt is another conversation, not a violation. A segment whose
        first call is in flight counts (its first prompt is set when it begins).
        """
        opened = [seg for seg in self.segments
                  if seg.agent == agent and seg.first_prompt and prompt[: len(seg.first_prompt)] == seg.first_prompt]
        if not opened:
            return None
        return (f"a text prompt that opens as conversation {opened[-1].index} does (its first prompt) and does not "
                "extend its last call")

    async def _claim_text(self, prompt: list[int], chat: ChatTokens, agent: str | None) -> tuple[Segment, bool, str | None]:
        """:meth:`_claim` for a text prompt: (segment, whether it continues it, why a new segment began)."""
        while True:
            seg = self._match_ids(prompt, agent)
            if seg is None or seg.in_flight is None:
                break
            await seg.in_flight.wait()  # a chat call of that conversation: extend what it records, not its start
        continued, reason = seg is not None, None
        if seg is None:
            reason = self._text_reason(prompt, agent)  # judged before it is added: it does not edit itself
            seg = self._new_segment(chat, TEXT_TOOLS_KEY, agent)
            seg.first_prompt = prompt
        seg.in_flight = asyncio.Event()
        return seg, continued, reason

    def _warn_split(self, messages: list[dict[str, Any]], key: str, agent: str | None) -> None:
        """Log once per job when a request would have extended another agent's conversation exactly: an agent
        name that changes per request (a tracing wrapper's ``user``) splits one conversation into many."""
        if self._split_warned:
            return
        for seg in self.segments:
            n = len(seg.messages)
            if seg.agent != agent and seg.tools_key == key and n and messages[:n] == seg.messages:
                self._split_warned = True
                log.warning("gateway: a request of agent %r extends agent %r's conversation exactly, and starts a "
                            "conversation of its own: agents are named by the URL, X-Prorl-Agent, OpenAI 'user' or "
                            "Anthropic 'metadata.user_id'; a name that changes per request splits one conversation",
                            agent, seg.agent)
                return

    def _new_segment(self, chat: ChatTokens, key: str, agent: str | None) -> Segment:
        seg = Segment(index=len(self.segments), chat=chat, tools_key=key, agent=agent)
        self.segments.append(seg)  # no messages yet: matched by nothing until its first call is recorded
        return seg

    @staticmethod
    def _release(seg: Segment) -> None:
        if seg.in_flight is not None:
            seg.in_flight.set()
            seg.in_flight = None

    def _sampling(self, req: ChatRequest, chat: ChatTokens, *, constrain: bool = True) -> SamplingParams:
        """The job's sampling with what the request set: the fields neither set stay unset (the engine's defaults,
        and the broker's KV admission counts no ``max_tokens`` nobody asked for); the request's constraint only
        with ``constrain``."""
        chosen: dict[str, Any] = {name: getattr(req, name) for name in ("max_tokens", "temperature", "top_p",
                                                                         "top_k", "seed") if getattr(req, name) is not None}
        stop_ids = list(self.sampling.stop_token_ids) or list(chat.stop_token_ids)
        if req.stop_token_ids:  # vLLM's extension: more ids that end the turn, beside the template's
            stop_ids = list(dict.fromkeys([*stop_ids, *req.stop_token_ids]))
        if stop_ids != self.sampling.stop_token_ids:
            chosen["stop_token_ids"] = stop_ids
        if req.top_logprobs:
            chosen["top_logprobs"] = req.top_logprobs
        if req.structured is not None and constrain:
            chosen["structured"] = req.structured
        stop = list(dict.fromkeys([*self.sampling.stop, *req.stop]))
        if stop != self.sampling.stop and len(stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in stop):
            # The engine stops there, instead of generating past it; the turn is still cut at the first stop string
            # (_cut_at_stop), which also serves stop strings beyond the contract's limits (Anthropic sets none).
            chosen["stop"] = stop
        return self.sampling.with_set(**chosen)

    @staticmethod
    def _retry_sampling(sampling: SamplingParams, attempt: int) -> SamplingParams:
        """The sampling of a retry: a fixed seed moves on (the same seed would sample the same turn again)."""
        if sampling.seed is None or attempt == 0:
            return sampling
        return sampling.with_set(seed=derive_seed(sampling.seed, attempt))

    @staticmethod
    def _honours(req: ChatRequest, calls: list[ToolCall]) -> bool:
        """Whether a turn's tool calls satisfy the request's ``tool_choice`` and ``parallel_tool_calls``."""
        if not req.parallel_tool_calls and len(calls) > 1:
            return False
        if req.tool_name is not None:
            return any(c.name == req.tool_name for c in calls)
        return bool(calls) or not req.require_tool

    @staticmethod
    def _wanted(req: ChatRequest) -> str:
        """What a turn must be to honour the request (for the log)."""
        wanted = f"a call to {req.tool_name!r}" if req.tool_name is not None else \
            "a tool call" if req.require_tool else ""
        one = "" if req.parallel_tool_calls else "at most one tool call"
        return " and ".join(w for w in (wanted, one) if w)

    # ------------------------------------------------------------- calls
    async def complete(self, req: ChatRequest) -> Reply:
        """Answer one chat request: prompt, ``generate``, record, parse tool calls."""
        async with self._slots:
            return await self._complete(req)

    async def _complete(self, req: ChatRequest) -> Reply:
        prompt, seg, continued, reason = await self._claim(req)
        try:
            # Beside tools the model may call, a constraint holds for an answer only (as OpenAI applies a format):
            # the turn is sampled free, and one that answers outside the constraint is sampled again under it.
            answer_format = req.structured if req.parse_tools and req.tools else None
            sampling = self._sampling(req, seg.chat, constrain=answer_format is None)
            # A turn that does not honour tool_choice is sampled again from the same prompt; only the turn
            # returned is recorded (the trajectory stays what the agent saw), with the discarded ones counted.
            constrained = req.require_tool or not req.parallel_tool_calls
            retries = self.tool_choice_retries if constrained and req.parse_tools else 0
            for attempt in range(retries + 1):
                turn = await self._turn(prompt, self._retry_sampling(sampling, attempt), req, seg.chat)
                content, calls = self._parse(turn.text, req.parse_tools)
                if self._honours(req, calls):
                    break
            unmet = not self._honours(req, calls)
            if unmet:
                log.warning("gateway: no turn of %d honoured tool_choice (%s); answering the last one",
                            attempt + 1, self._wanted(req))
            format_retried = answer_format is not None and not calls and not req.require_tool and \
                not meets_constraint(answer_format, content)
            if format_retried:
                # Under the constraint the turn is an answer: its text is not read for tool calls (a JSON answer
                # can look like one to some parsers).
                turn = await self._turn(prompt, sampling.with_set(structured=answer_format), req, seg.chat)
                content = turn.text
            call = self._record(prompt, turn.out, turn.logprobs, turn.finish, turn.gen, seg, continued, reason,
                                turn.stop_string, turn.structured)
            call.tool_choice_retries, call.tool_choice_unmet = attempt, unmet
            call.format_retried = format_retried
            seg.asks.append((len(self.trajectory.calls) - 1, len(req.messages)))
            seg.messages = [*req.messages, self._assistant_message(content, calls)]
            seg.asked = []
            self.trajectory.messages = [dict(m) for m in seg.messages]
            if self._on_record is not None:
                self._on_record(self.trajectory)
        except BaseException:
            if not continued and not seg.messages:
                seg.asked = []  # its first call failed: no conversation began (later ones keep their index)
                if self.segments[-1] is seg:
                    self.segments.pop()
            raise
        finally:
            self._release(seg)
        finish_reason = "tool_calls" if calls else ("length" if turn.finish == "length" else "stop")
        top = turn.gen.top_logprobs
        return Reply(call, content, calls, finish_reason, turn.stop_string, seg.index, continued,
                     top_logprobs=top[: len(turn.out)] if top is not None and req.top_logprobs else None)

    async def _turn(self, prompt: list[int], sampling: SamplingParams, req: ChatRequest, chat: ChatTokens) -> _Turn:
        """One generation of a chat turn, cut at the request's first stop string, and its text."""
        gen = await self._generate(prompt, sampling)
        out, lps = list(gen.output_ids), list(gen.logprobs)
        finish, stop_string = gen.finish_reason, None
        if req.stop:
            out, lps, stop_string = _cut_at_stop(chat, out, lps, req.stop)
            if stop_string is not None:
                finish = "stop"
        # Special tokens kept: some tokenizers mark <tool_call> special, and the parser must see it.
        text = chat.turn_text(_text_ids(out, req))
        if stop_string is not None:
            text = _before_stop(text, stop_string, req.include_stop)
        return _Turn(gen, out, lps, finish, stop_string, text, sampling.structured)

    async def complete_text(self, prompt_text: str, req: ChatRequest) -> Reply:
        """Answer a plain completion (``/v1/completions``): the prompt text encoded as is (see the module docstring
        for the conversation it extends or opens)."""
        async with self._slots, self._text_lock:
            chat = self._chat_for(None)
            prompt = chat.encode(prompt_text)
            seg, continued, reason = await self._claim_text(prompt, chat, req.agent)
            recorded = False
            try:
                sampling = self._sampling(req, chat)
                gen = await self._generate(prompt, sampling)
                out, lps, stop_string = list(gen.output_ids), list(gen.logprobs), None
                if req.stop:
                    out, lps, stop_string = _cut_at_stop(chat, out, lps, req.stop)
                call = self._record(prompt, out, lps, "stop" if stop_string else gen.finish_reason, gen, seg,
                                    continued, reason, stop_string, req.structured)
                recorded = True
                # Extended by text, a chat conversation holds ids its messages do not: no chat request extends it.
                seg.messages, seg.asked = [], []
                if self._on_record is not None:
                    self._on_record(self.trajectory)
            except BaseException:
                if not continued and not recorded and self.segments[-1] is seg:
                    self.segments.pop()  # its first call failed: no conversation began
                raise
            finally:
                self._release(seg)
            text = chat.turn_text(_text_ids(out, req))  # the end-of-sequence token is not text, as vLLM answers
            if stop_string is not None:
                text = _before_stop(text, stop_string, req.include_stop)
            top = gen.top_logprobs
            return Reply(call, text, [], "length" if call.finish_reason == "length" else "stop", stop_string,
                         seg.index, continued,
                         top_logprobs=top[: len(out)] if top is not None and req.top_logprobs else None)

    def _record(
        self, prompt: list[int], out: list[int], lps: list[float], finish: str, gen: Generation, seg: Segment,
        continued: bool, reason: str | None, stop_string: str | None, structured: dict[str, Any] | None,
    ) -> ModelCall:
        traj = self.trajectory
        # Continuity is per conversation: a call extends its segment's last call, or opens a conversation.
        if continued:
            held = seg.prompt_ids + seg.output_ids
            prefix_ok = prompt[: len(held)] == held
        else:
            prefix_ok = reason is None
        call = ModelCall(
            prompt_ids=prompt, output_ids=out, logprobs=lps, finish_reason=finish,
            backend_id=gen.backend_id, prefix_ok=prefix_ok,
            text=seg.chat.turn_text(out),
            policy_version=gen.policy_version, segment=seg.index, agent=seg.agent,
            # Cut as the output was (at a stop string): one row per output id kept.
            top_logprobs=gen.top_logprobs[: len(out)] if gen.top_logprobs is not None else None,
            stop_string=stop_string, structured=structured,
        )
        if not continued:
            if reason is not None:
                message = f"call {len(traj.calls)}: new segment {seg.index}: {reason}"
                log.info("gateway: %s", message)
                traj.violations.append({"call": len(traj.calls), "segment": seg.index, "reason": reason,
                                        "message": message})
            seg.sequence_ids, seg.loss_mask, seg.logprobs = [], [], []
        new = prompt[len(seg.sequence_ids):]
        seg.sequence_ids = seg.sequence_ids + new + out
        seg.loss_mask = seg.loss_mask + [0] * len(new) + [1] * len(out)
        seg.logprobs = seg.logprobs + [0.0] * len(new) + lps
        seg.prompt_ids, seg.output_ids = prompt, out
        traj.calls.append(call)
        traj.sequence_ids, traj.loss_mask, traj.logprobs = seg.sequence_ids, seg.loss_mask, seg.logprobs
        return call

    def _parse(self, text: str, parse_tools: bool) -> tuple[str, list[ToolCall]]:
        """Content and tool calls of a turn; a call the parser cannot read leaves the whole text as content."""
        if not parse_tools:
            return text, []
        try:
            calls = self.parser.parse(text)
        except Exception as e:  # a plug-in parser's failure must not fail the request
            log.warning("gateway: tool parser %s failed: %s", type(self.parser).__name__, e)
            return text, []
        if not calls or any(c.error for c in calls):
            return text, []
        pattern = getattr(self.parser, "pattern", None)
        content = pattern.sub("", text).strip() if pattern is not None else ""
        return content, calls

    @staticmethod
    def _assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [tool_call_message(c.name, c.arguments) for c in calls]
        return msg

    def prompt_tokens(self, req: ChatRequest) -> int:
        """How many tokens the template renders ``req``'s messages and tools to (Anthropic ``count_tokens``);
        nothing is sampled or recorded."""
        return len(self._chat_for(req.tools).initial_prompt(req.messages))

    # ------------------------------------------------------------ reports
    @property
    def continuity(self) -> float:
        """Fraction of calls after the first that extended their conversation token-exactly or opened a new
        one (1.0 with <= 1 call): below 1 only when a harness edited a conversation's history."""
        calls = self.trajectory.calls
        if len(calls) <= 1:
            return 1.0
        return sum(1 for c in calls[1:] if c.prefix_ok) / (len(calls) - 1)

    @property
    def conversations(self) -> int:
        """Segments with a recorded call: a conversation whose first call never came back (cancelled, failed,
        the job ended) left no tokens and is not counted (``segments`` may keep its index as a gap)."""
        return len({c.segment for c in self.trajectory.calls})

    def continuity_by_conversation(self) -> dict[int, float]:
        """Per segment: the fraction of its calls after its first that extended it token-exactly."""
        by: dict[int, list[bool]] = {}
        for c in self.trajectory.calls:
            by.setdefault(c.segment, []).append(c.prefix_ok)
        return {seg: (sum(oks[1:]) / (len(oks) - 1) if len(oks) > 1 else 1.0) for seg, oks in by.items()}


def _text_ids(out: list[int], req: ChatRequest) -> list[int]:
    """The output ids whose text is returned: a last id of the request's ``stop_token_ids`` is not text (as vLLM
    answers, unless ``include_stop_str_in_output``); it stays in the recorded output ids."""
    if out and not req.include_stop and out[-1] in req.stop_token_ids:
        return out[:-1]
    return out


def _before_stop(text: str, stop: str, include: bool) -> str:
    """A turn's text up to the stop string that ended it: without it, or with it (vLLM's
    ``include_stop_str_in_output``)."""
    at = text.index(stop)
    return text[: at + len(stop)] if include else text[:at]


def _cut_at_stop(chat: ChatTokens, out: list[int], lps: list[float], stops: list[str]) -> tuple[list[int], list[float], str | None]:
    """Cut a turn after the token that completes the first stop string (the tokens the model did sample)."""
    keep = chat.shortest_prefix(out, lambda text: any(s in text for s in stops))
    if keep is None:
        return out, lps, None
    # Of the strings that token completes, the one the engines name (first_stop: ending first, then first listed).
    return out[:keep], lps[:keep], first_stop(chat.decode(out[:keep]), stops)
