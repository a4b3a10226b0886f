"""OpenAI and Anthropic request bodies into the chat messages a chat template renders, and back.

Both APIs are turned into one canonical form, the one ``ChatTokens`` and
``run_tool_agent`` use: ``{"role": "system"|"user"|"assistant"|"tool",
"content": str}``, assistant tool calls as ``tool_calls: [{"type":
"function", "function": {"name", "arguments": {...}}}]`` and tool results as
``{"role": "tool", "name": ..., "content": ...}``. The gateway compares
requests in this form: two messages are the same when the template would
render them the same, so ids, ``null`` versus missing fields and key order
never break token continuity.

Every number a request gives is checked here, so that a value out of range
is a 400 naming the API's field, never a later failure: the sampling fields
(``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``) by the
broker's own checks of ``SamplingParams`` (``prorl_cli.protocol.schema.SAMPLING``,
the one place their ranges are written), so nothing the gateway accepts is
refused by the broker or is too large for msgpack to carry; the fields that
never leave the gateway (``n``, the penalties, the legacy ``logprobs``) in
the ranges the OpenAI API documents.

``tool_choice`` is read into :attr:`ChatRequest.require_tool` and
:attr:`ChatRequest.tool_name`, OpenAI ``parallel_tool_calls`` / Anthropic
``disable_parallel_tool_use`` into :attr:`ChatRequest.parallel_tool_calls`;
a named tool that is not among ``tools`` is a 400 naming ``tool_choice``.
The token buffer honours them (docs/harness.md).

A structured output (a JSON format, vLLM's constraint fields) becomes
:attr:`ChatRequest.structured`; beside tools the model may call it holds for
an answer only, as OpenAI applies it (the token buffer, docs/harness.md).

A field that would change the result but that the gateway cannot apply
(logit bias, the legacy function-calling API, audio,
vLLM's ``min_p`` or ``chat_template_kwargs``, ``echo``, Anthropic's own
server tools, a prefilled assistant turn) is a 400 naming it, never ignored:
the tables ``_OPENAI_UNAPPLIED`` and ``_COMPLETION_UNAPPLIED`` list them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.exceptions import ProrlError
from prorl_cli.protocol.records import check_structured
from prorl_cli.protocol.schema import RECORD_FIELDS, SAMPLING, Check, FieldError, Int, Num, Opt


class RequestError(ProrlError, ValueError):
    """A request the gateway refuses; ``status`` is the HTTP status, ``param`` the field at fault."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass
class ChatRequest:
    """One chat request in canonical form, whichever API it came through."""

    messages: list[dict[str, Any]]
    #: Tool schemas in OpenAI function format, as given to the chat template (``None``: no tools).
    tools: list[dict[str, Any]] | None
    model: str
    stream: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    #: ``False`` when the caller asked for no tool calls (OpenAI ``tool_choice: "none"``).
    parse_tools: bool = True
    #: The turn must call a tool (OpenAI ``tool_choice: "required"``, Anthropic ``{"type": "any"}``).
    require_tool: bool = False
    #: The turn must call this tool (OpenAI ``{"type": "function", "function": {"name": N}}``,
    #: Anthropic ``{"type": "tool", "name": N}``); implies ``require_tool``.
    tool_name: str | None = None
    #: ``False``: the turn may call one tool at most (OpenAI ``parallel_tool_calls: false``, Anthropic
    #: ``tool_choice.disable_parallel_tool_use: true``); the token buffer honours it as it does ``require_tool``.
    parallel_tool_calls: bool = True
    #: OpenAI ``top_logprobs`` (with ``logprobs: true``): alternatives returned per output token.
    top_logprobs: int | None = None
    #: OpenAI ``stream_options.include_usage``: end a stream with a usage chunk (whose ``choices`` is empty).
    include_usage: bool = False
    #: The agent making the call (:func:`request_agent`); None when the harness names none.
    agent: str | None = None
    #: vLLM's ``stop_token_ids``: more token ids that end the turn, besides the template's end of turn.
    stop_token_ids: list[int] = field(default_factory=list)
    #: vLLM's ``include_stop_str_in_output``: the returned text keeps the stop string that ended the turn.
    include_stop: bool = False
    #: Constrained decoding (``SamplingParams.structured``): OpenAI's ``response_format`` / ``text.format``,
    #: Anthropic's ``output_config.format``, vLLM's ``structured_outputs`` and ``guided_*``. With tools the model
    #: may call it constrains only a turn that answers (one with no tool call); a turn that must call a tool is
    #: not constrained.
    structured: dict[str, Any] | None = None


#: Between a message's text parts (and an Anthropic message's text blocks): what vLLM's chat rendering puts
#: there for templates that take a string, so a prompt reads as ``vllm serve`` renders it; and parts that are
#: separate blocks (a harness's reminder block, then the user's words) do not run into each other.
PART_SEPARATOR = "\n"


def _text(content: Any, where: str) -> str:
    """A message's content as one string: a string, null, or a list of text parts (joined by ``PART_SEPARATOR``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                if not isinstance(part.get("text"), str):
                    raise RequestError(f"{where}[{i}].text must be a string", param=where)
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}[{i}]: content parts of type {kind!r} are not supported (text only)",
                                   param=where)
        return PART_SEPARATOR.join(parts)
    raise RequestError(f"{where} must be a string, null or a list of text parts", param=where)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as the template wants them: a JSON object (kept as text if it is not JSON)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw if raw is not None else {}


def tool_call_message(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


#: The broker's check of each ``SamplingParams`` field (type and range), taken from its wire schema.
SAMPLING_CHECKS: dict[str, Check] = {
    name: spec.check if isinstance(spec, Opt) else spec for name, spec in RECORD_FIELDS[SAMPLING].items()}
#: Fields the gateway reads but never sends on, in the OpenAI API's documented ranges.
_PENALTY = Num(-2.0, 2.0)
_COMPLETION_LOGPROBS = Int(0, 5)


def _checked(body: dict[str, Any], key: str, check: Check) -> Any:
    """``body[key]`` checked by ``check`` (``None`` when absent or null); :class:`RequestError` names ``key``."""
    value = body.get(key)
    if value is None:
        return None
    try:
        return check(value, key)
    except FieldError as e:
        raise RequestError(f"{key} {e.detail}", param=key) from None


def _sampling(body: dict[str, Any], key: str, field: str | None = None) -> Any:
    """``body[key]`` checked as the broker checks the sampling field ``field`` (``key`` by default)."""
    return _checked(body, key, SAMPLING_CHECKS[field or key])


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _flag(body: dict[str, Any], key: str, where: str | None = None) -> bool:
    """A boolean field (absent or null: false); anything else is refused rather than read as truthy."""
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{where or key} must be a boolean, got {type(value).__name__}", param=where or key)
    return value


#: vLLM's extensions that would change what is sampled, the prompt, or what comes back: ``field -> (accepted,
#: why)`` as below; each API's table takes those it has.
_VLLM_UNAPPLIED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "ignore_eos": (lambda v: v is False, "a turn ends at the template's end of turn (only false)"),
    "min_tokens": (lambda v: v == 0 and not isinstance(v, bool), "the generate contract has no min_tokens (only 0)"),
    "bad_words": (lambda v: v == [], "the generate contract cannot ban words (only [])"),
    "allowed_token_ids": (lambda v: False, "the generate contract cannot restrict the vocabulary"),
    "use_beam_search": (lambda v: v is False, "the gateway samples; it does not search beams (only false)"),
    "length_penalty": (lambda v: v == 1 and not isinstance(v, bool), "there is no beam search to apply it to (only 1)"),
    "truncate_prompt_tokens": (lambda v: False, "the gateway never cuts a prompt: a prompt too long is a 400 "
                                                "(context_length_exceeded)"),
    "prompt_logprobs": (lambda v: False, "the gateway returns the log-probs of the sampled tokens only; the "
                                         "prompt's ids are in the job's trajectory"),
    "return_tokens_as_token_ids": (lambda v: v is False, "tokens come back as text; their ids are in the job's "
                                                         "trajectory (only false)"),
    "continue_final_message": (lambda v: v is False, "the gateway renders every message as a whole turn and "
                                                     "samples a new one: no prefill (only false)"),
    "add_generation_prompt": (lambda v: v is True, "the gateway always opens a new assistant turn (only true)"),
    "echo": (lambda v: v is False, "the gateway does not echo the prompt (only false)"),
}

#: Fields that would change the result but that the gateway cannot apply, per API: ``field -> (whether a value
#: may be accepted because it asks for nothing beyond what the gateway does, why other values are refused)``.
#: Such a value is a 400 naming the field, never silently ignored (a client would get a result it did not ask for).
_Unapplied = dict[str, tuple[Callable[[Any], bool], str]]
_OPENAI_UNAPPLIED: _Unapplied = {
    "logit_bias": (lambda v: v == {}, "the generate contract has no logit bias (only {})"),
    "functions": (lambda v: v == [], "send tools (the legacy function-calling API is not served)"),
    "function_call": (lambda v: False, "send tool_choice (the legacy function-calling API is not served)"),
    "modalities": (lambda v: v == ["text"], "the gateway answers text only (only ['text'])"),
    "audio": (lambda v: False, "the gateway answers text only"),
    "web_search_options": (lambda v: False, "the gateway has no web search"),
    # vLLM's extensions, sent by clients set up for a vLLM server (``extra_body``).
    "min_p": (lambda v: v == 0, "the generate contract has no min_p (only 0)"),
    "repetition_penalty": (lambda v: v == 1, "the generate contract has no repetition penalty (only 1)"),
    "chat_template_kwargs": (lambda v: v == {}, "the job's chat template is rendered as configured (only {})"),
    # vLLM's sampling and prompt extensions the generate contract does not carry (its ``stop_token_ids`` and
    # ``include_stop_str_in_output`` are applied). Their defaults pass, as clients set up for vLLM send them.
    **_VLLM_UNAPPLIED,
}
_COMPLETION_UNAPPLIED: _Unapplied = {
    "echo": (lambda v: v is False, "the gateway does not echo the prompt (only false)"),
    "suffix": (lambda v: v == "", "the gateway does not insert text (only '')"),
    "best_of": (lambda v: v == 1 and not isinstance(v, bool),
                "the gateway samples one completion per request (only 1)"),
    **{key: _OPENAI_UNAPPLIED[key] for key in ("logit_bias", "min_p", "repetition_penalty")},
    **{key: _VLLM_UNAPPLIED[key] for key in (
        "ignore_eos", "min_tokens", "bad_words", "allowed_token_ids", "use_beam_search", "length_penalty",
        "truncate_prompt_tokens", "prompt_logprobs", "return_tokens_as_token_ids")},
}


def _refuse_unapplied(body: dict[str, Any], fields: _Unapplied) -> None:
    """A 400 naming the first of ``fields`` whose value asks for something the gateway cannot do (null: absent)."""
    for key, (accepted, why) in fields.items():
        value = body.get(key)
        if value is not None and not accepted(value):
            raise RequestError(f"{key} {json.dumps(value)[:80]} is not supported: {why}", param=key)


def _allow_parallel(value: Any, where: str) -> bool:
    """OpenAI ``parallel_tool_calls`` (absent or null: true), a boolean."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise RequestError(f"{where} must be a boolean, got {type(value).__name__}", param=where)
    return value


#: Stop strings an OpenAI request may give (chat and legacy completions); more are a 400, as OpenAI answers.
#: Anthropic documents no such cap for ``stop_sequences``, so none is applied there.
OPENAI_MAX_STOP = 4


def _stop(value: Any, where: str = "stop", most: int | None = None) -> list[str]:
    """The stop strings of ``value`` (a string or a list of them; empty ones dropped); a list of more than
    ``most`` is refused with OpenAI's error (counted as sent, as the API counts it)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if most is not None and len(value) > most:
            raise RequestError(f"Invalid '{where}': array too long. Expected an array with maximum length {most}, "
                               f"but got an array with length {len(value)} instead.", param=where,
                               code="array_above_max_length")
        return [s for s in value if s]
    raise RequestError(f"{where} must be a string or a list of strings", param=where)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required (a string)", param="model")
    return model


# ------------------------------------------------------------------- OpenAI
class MessageMemo:
    """The last request's raw messages and their canonical form, for one job.

    A harness resends the whole conversation at every call; the messages it
    already sent are equal to last time's, so their canonical form is reused
    instead of being validated and parsed again (tool-call arguments are JSON
    text to decode). Reuse stops at the first message that differs: a
    message's canonical form depends on the ones before it (tool results take
    the name of their call). The canonical dicts are shared between requests
    and must not be mutated.
    """

    __slots__ = ("raw", "out")

    def __init__(self) -> None:
        self.raw: list[Any] = []
        self.out: list[dict[str, Any]] = []


def openai_messages(raw: Any, memo: MessageMemo | None = None) -> list[dict[str, Any]]:
    """OpenAI chat ``messages`` in canonical form (tool results named after their call)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list", param="messages")
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    same = 0
    if memo is not None:
        prev = memo.raw
        limit = min(len(prev), len(raw))
        while same < limit and raw[same] == prev[same]:
            m = raw[same]
            for tc in m.get("tool_calls") or () if m.get("role") == "assistant" else ():
                if isinstance(tc.get("id"), str):
                    names[tc["id"]] = tc["function"]["name"]
            same += 1
        out.extend(memo.out[:same])
    for i in range(same, len(raw)):
        out.append(_openai_message(raw[i], f"messages[{i}]", names))
    if memo is not None:
        memo.raw, memo.out = raw, out
    return out


def _content(m: dict[str, Any], where: str, *, required: bool = True) -> str:
    """An OpenAI chat message's ``content`` as text. Null or missing where the API requires it is OpenAI's 400
    naming ``messages[i].content``: rendered as empty text it would put a turn the harness never wrote into the
    prompt, and the same request to OpenAI fails."""
    content = m.get("content")
    if content is None and required:
        if "content" not in m:
            raise RequestError(f"Missing required parameter: '{where}.content'.", param=f"{where}.content",
                               code="missing_required_parameter")
        raise RequestError(f"Invalid value for '{where}.content': expected a string, got null.",
                           param=f"{where}.content")
    return _text(content, f"{where}.content")


def _openai_message(m: Any, where: str, names: dict[str, str]) -> dict[str, Any]:
    """One message in canonical form; an assistant's tool-call ids are added to ``names``."""
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object", param="messages")
    role = m.get("role")
    if role in ("system", "developer"):
        return {"role": "system", "content": _content(m, where)}
    if role == "user":
        return {"role": "user", "content": _content(m, where)}
    if role == "assistant":
        calls = m.get("tool_calls") or []
        # An assistant turn may come back with null text whatever it did (vLLM's server and many harnesses send
        # what the model gave: an empty turn is null): it is rendered as the empty text it was, not refused.
        msg: dict[str, Any] = {"role": "assistant", "content": _content(m, where, required=False)}
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be a list", param="messages")
        canon = []
        for j, tc in enumerate(calls):
            fn = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"{where}.tool_calls[{j}] needs function.name", param="messages")
            if isinstance(tc.get("id"), str):
                names[tc["id"]] = fn["name"]
            canon.append(tool_call_message(fn["name"], _arguments(fn.get("arguments"))))
        if canon:
            msg["tool_calls"] = canon
        return msg
    if role == "tool":
        call_id = m.get("tool_call_id")
        return {"role": "tool", "name": names.get(call_id, "") if isinstance(call_id, str) else "",
                "content": _content(m, where)}
    raise RequestError(f"{where}.role {role!r} is not supported (system, developer, user, assistant, tool)",
                       param="messages")


def _openai_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise RequestError("tools must be a list", param="tools")
    for i, t in enumerate(raw):
        if not (isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        if t.get("type") not in (None, "function"):
            raise RequestError(f"tools[{i}].type {t.get('type')!r} is not supported (function only)", param="tools")
        if t["function"].get("parameters") is not None and not isinstance(t["function"]["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
    return raw or None


#: vLLM's older request fields for constrained decoding (before ``structured_outputs``), by the kind each sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured(checked: dict[str, Any], param: str) -> dict[str, Any]:
    """``checked`` (one constraint, as ``SamplingParams.structured`` holds it) checked as the broker checks it;
    :class:`RequestError` names ``param``."""
    try:
        structured = _sampling({"structured": checked}, "structured")  # the wire's bounds
        check_structured(structured)  # exactly one constraint, of its shape
    except (RequestError, ValueError) as e:
        raise RequestError(f"{param}: {e}", param=param) from None
    return dict(structured)


def _json_format(fmt: Any, param: str, *, nested: bool = False) -> dict[str, Any] | None:
    """The constraint an output format asks for (chat's ``response_format``, the Responses API's ``text.format``,
    Anthropic's ``output_config.format``): ``text`` none, ``json_object`` any JSON object, ``json_schema`` its
    schema (``nested``: under ``json_schema``, as chat gives it; the others give it flat)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _structured({"json_object": True}, param)
    if kind == "json_schema":
        holder = fmt.get("json_schema") if nested else fmt
        schema = holder.get("schema") if isinstance(holder, dict) else None
        if not isinstance(schema, dict):
            where = f"{param}.json_schema.schema" if nested else f"{param}.schema"
            raise RequestError(f"{where} must be a JSON Schema object", param=param)
        return _structured({"json": schema}, param)
    raise RequestError(f"{param} {json.dumps(fmt)[:80]} is not supported (type 'text', 'json_object' or "
                       "'json_schema')", param=param)


def _vllm_structured(body: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's own constraint fields, sent by clients set up for a vLLM server: ``structured_outputs`` (one of
    json, json_object, regex, choice, grammar) or an older ``guided_*``."""
    given = [key for key in ("structured_outputs", *_GUIDED) if body.get(key) is not None]
    if len(given) > 1:
        raise RequestError(f"{' and '.join(given)} both constrain the output: give one", param=given[1])
    if not given:
        return None
    key = given[0]
    if key == "structured_outputs":
        value = body[key]
        chosen = {k: v for k, v in value.items() if v is not None and v is not False} if isinstance(value, dict) \
            else value
        return _structured(chosen, key)
    return _structured({_GUIDED[key]: body[key]}, key)


def _constraint(body: dict[str, Any], fmt: dict[str, Any] | None, param: str = "response_format") -> dict[str, Any] | None:
    """The one constraint a request asks for: its output format, or vLLM's fields (both: a 400). Beside tools the
    model may call it constrains an answer only (the token buffer samples such a turn free first)."""
    vllm = _vllm_structured(body)
    if fmt is not None and vllm is not None:
        raise RequestError(f"{param} and vLLM's constraint fields both constrain the output: give one", param=param)
    return fmt or vllm


def _openai_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields (and the checked-only numbers) common to chat and legacy completions."""
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
        raise RequestError(f"n must be an integer, got {type(n).__name__}", param="n")
    if n is not None and n != 1:
        raise RequestError(f"n={n} is not supported: the gateway samples one choice per request (n=1)", param="n")
    for key in ("presence_penalty", "frequency_penalty"):
        _checked(body, key, _PENALTY)  # accepted for compatibility, not applied (the generate contract has none)
    max_tokens = _sampling(body, "max_completion_tokens", "max_tokens")
    if max_tokens is None:
        max_tokens = _sampling(body, "max_tokens")
    # top_k, stop_token_ids and include_stop_str_in_output are vLLM's extensions (clients set up for vLLM send
    # them); the generate contract carries the first two, the gateway cuts the text for the third.
    return {"max_tokens": max_tokens, "temperature": _float(_sampling(body, "temperature")),
            "top_p": _float(_sampling(body, "top_p")), "top_k": _sampling(body, "top_k"),
            "seed": _sampling(body, "seed"), "stop_token_ids": list(_sampling(body, "stop_token_ids") or []),
            "include_stop": _flag(body, "include_stop_str_in_output")}


def _include_usage(body: dict[str, Any]) -> bool:
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    return _flag(stream_options, "include_usage", "stream_options.include_usage")


def _chosen_tool(name: str, tools: list[dict[str, Any]] | None, where: str) -> str:
    """``name`` if it is one of ``tools``; else a 400 naming ``tool_choice``."""
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        raise RequestError(f"{where} names the tool {name!r}, which is not among the request's tools {names}",
                           param="tool_choice")
    return name


def _needs_tools(tools: list[dict[str, Any]] | None, what: str) -> None:
    if not tools:
        raise RequestError(f"tool_choice {what} needs tools, and the request has none", param="tool_choice")


def _openai_tool_choice(choice: Any, tools: list[dict[str, Any]] | None, *, flat: bool = False) -> dict[str, Any]:
    """The :class:`ChatRequest` fields OpenAI's ``tool_choice`` sets: ``none``, ``auto``, ``required``, or a named
    tool (chat's ``{"type": "function", "function": {"name": N}}``, the Responses API's ``{"type": "function",
    "name": N}`` when ``flat``)."""
    if choice is None or choice == "auto":
        return {}
    if choice == "none":
        return {"parse_tools": False}
    if choice == "required":
        _needs_tools(tools, "'required'")
        return {"require_tool": True}
    if isinstance(choice, dict) and choice.get("type") == "function":
        named = choice if flat else choice.get("function")
        if isinstance(named, dict) and isinstance(named.get("name"), str):
            where = "tool_choice.name" if flat else "tool_choice.function.name"
            return {"require_tool": True, "tool_name": _chosen_tool(named["name"], tools, where)}
    shape = "{'type': 'function', 'name': ...}" if flat else "{'type': 'function', 'function': {'name': ...}}"
    raise RequestError(f"tool_choice must be 'none', 'auto', 'required' or {shape}", param="tool_choice")


def openai_chat_request(body: dict[str, Any], memo: MessageMemo | None = None) -> ChatRequest:
    """Validate an OpenAI ``/v1/chat/completions`` body; :class:`RequestError` names the field.

    ``memo`` (the job's) lets messages equal to the last request's keep their canonical form.
    """
    _refuse_unapplied(body, _OPENAI_UNAPPLIED)
    sampling = _openai_sampling(body)
    logprobs = _flag(body, "logprobs")
    # Checked as the broker checks the sampling field; only sent on when log-probs are asked for.
    top_logprobs = _sampling(body, "top_logprobs")
    if top_logprobs and not logprobs:  # as OpenAI answers: nothing would come back, and the user not know why
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    tools = _openai_tools(body.get("tools"))
    fmt = _json_format(body.get("response_format"), "response_format", nested=True)
    return ChatRequest(
        structured=_constraint(body, fmt),
        messages=openai_messages(body.get("messages"), memo),
        tools=tools,
        model=_model(body),
        stream=_flag(body, "stream"),
        stop=_stop(body.get("stop"), most=OPENAI_MAX_STOP),
        logprobs=logprobs,
        top_logprobs=top_logprobs if logprobs and top_logprobs else None,
        include_usage=_include_usage(body),
        parallel_tool_calls=_allow_parallel(body.get("parallel_tool_calls"), "parallel_tool_calls"),
        **_openai_tool_choice(body.get("tool_choice"), tools),
        **sampling,
    )


def openai_completion_request(body: dict[str, Any]) -> tuple[str, ChatRequest]:
    """Validate an OpenAI ``/v1/completions`` body: the prompt text and its sampling, as a message-less request."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string (one prompt per request)", param="prompt")
    _refuse_unapplied(body, _COMPLETION_UNAPPLIED)
    # Here ``logprobs`` is how many alternatives per token (0-5), not chat's boolean: 0 asks for the sampled
    # tokens' log-probs only.
    alternatives = _checked(body, "logprobs", _COMPLETION_LOGPROBS)
    req = ChatRequest(messages=[], tools=None, model=_model(body), stream=_flag(body, "stream"),
                      stop=_stop(body.get("stop"), most=OPENAI_MAX_STOP), include_usage=_include_usage(body),
                      logprobs=alternatives is not None, top_logprobs=alternatives or None,
                      structured=_constraint(body, _json_format(body.get("response_format"), "response_format",
                                                                nested=True)),
                      **_openai_sampling(body))
    return prompt, req


# ------------------------------------------------------- OpenAI Responses
#: ``include`` values a request may give: logprobs are returned; there is no reasoning item to encrypt.
_RESPONSES_INCLUDE = ("message.output_text.logprobs", "reasoning.encrypted_content")
_RESPONSES_UNAPPLIED: _Unapplied = {
    "truncation": (lambda v: v == "disabled", "the gateway never drops input items (only 'disabled')"),
    "background": (lambda v: v is False, "the gateway answers in the request (only false)"),
    "conversation": (lambda v: False, "the gateway keeps no conversations: send the items (or previous_response_id)"),
    "prompt": (lambda v: False, "reusable prompts are kept by OpenAI, not here: send instructions and input"),
    "context_management": (lambda v: v == [], "OpenAI's server-side compaction would change the prompt the "
                                              "trajectory records (a prompt too long is a 400: compact in the harness)"),
    **{key: _OPENAI_UNAPPLIED[key] for key in ("min_p", "repetition_penalty", "chat_template_kwargs")},
}


@dataclass
class ResponsesConversation:
    """A stored response's conversation (canonical messages, without its ``instructions``) and the tool name of
    each ``call_id`` in it: what a later request naming it in ``previous_response_id`` continues."""

    messages: list[dict[str, Any]]
    names: dict[str, str]


@dataclass
class ResponsesRequest:
    """An OpenAI ``/v1/responses`` body: the chat request it asks for, and what its response echoes or stores."""

    chat: ChatRequest
    #: The conversation without the instructions (stored when ``store``), and each call_id's tool name.
    conversation: list[dict[str, Any]]
    names: dict[str, str]
    #: ``instructions`` as the request gave them (the response echoes them).
    instructions: str | list[Any] | None
    previous_response_id: str | None
    store: bool


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string, got {type(value).__name__}", param=where.split("[")[0])
    return value


def responses_input(raw: Any, names: dict[str, str], field: str = "input") -> list[dict[str, Any]]:
    """Responses ``input`` (a string, or message / ``function_call`` / ``function_call_output`` / ``reasoning``
    items) in canonical form: a turn's message and its function calls become one assistant message, as the
    model wrote them; each call's name is added to ``names`` under its ``call_id``. ``field`` names the
    request's field in errors."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"{field} must be a string or a non-empty list of items", param=field)
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message this request's function_call items extend
    for i, item in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", param=field)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            content = _text(item.get("content"), f"{where}.content")
            if role in ("system", "developer"):
                out.append({"role": "system", "content": content})
            elif role in ("user", "assistant"):
                out.append({"role": role, "content": content})
            else:
                raise RequestError(f"{where}.role {role!r} is not supported (system, developer, user, assistant)",
                                   param=field)
            turn = out[-1] if role == "assistant" else None
        elif kind == "function_call":
            name, call_id = _string(item.get("name"), f"{where}.name"), _string(item.get("call_id"), f"{where}.call_id")
            names[call_id] = name
            call = tool_call_message(name, _arguments(_string(item.get("arguments", "{}"), f"{where}.arguments")))
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item.get("call_id"), f"{where}.call_id")
            text = _text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "name": names.get(call_id, ""), "content": text})
            turn = None
        elif kind == "reasoning":
            continue  # the model's reasoning came back as it wrote it, in the message's text
        else:
            raise RequestError(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                               "function_call_output, reasoning)", param=field)
    return out


def _responses_instructions(raw: Any) -> list[dict[str, Any]]:
    """Responses ``instructions`` as the messages that open the prompt: a string is one system (developer)
    message, as the API defines it; a list holds message items, as in ``input`` (a ``developer`` or ``system``
    item is a system message, a ``user`` or ``assistant`` one keeps its role). Other items are refused: they
    belong in ``input``."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "system", "content": raw}] if raw else []
    if not isinstance(raw, list):
        raise RequestError(f"instructions must be a string or a list of message items, got {type(raw).__name__}",
                           param="instructions")
    for i, item in enumerate(raw):
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind != "message":
            raise RequestError(f"instructions[{i}] must be a message item ({{'role': 'developer', 'content': ...}}), "
                               f"got {json.dumps(item)[:80]}: instructions are a string or a list of message "
                               "items; send function calls and their outputs in input", param="instructions")
    if not raw:
        return []
    return responses_input(raw, {}, field="instructions")


def _responses_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Responses function tools (``{"type": "function", "name", "parameters", ...}``) in chat's function format."""
    return _flat_tools(raw, ("function",), "parameters", "function tools only: the gateway runs no hosted tools")


def _responses_text(text: Any) -> dict[str, Any] | None:
    """``text``: its ``format`` (text, or a JSON object or schema the output is constrained to); ``verbosity``
    is checked, not applied (how long the model writes is its own, as for Anthropic's ``thinking``)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise RequestError("text must be an object", param="text")
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise RequestError("text.verbosity must be 'low', 'medium' or 'high'", param="text")
    return _json_format(text.get("format"), "text.format")


def _responses_reasoning(reasoning: Any) -> None:
    """``reasoning`` is checked as the API does, not applied: whether the model reasons, and how long, is its chat
    template's and its own."""
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise RequestError("reasoning must be an object", param="reasoning")
    for key in ("effort", "summary", "generate_summary"):
        if reasoning.get(key) is not None and not isinstance(reasoning[key], str):
            raise RequestError(f"reasoning.{key} must be a string", param="reasoning")


def openai_responses_request(body: dict[str, Any], stored: dict[str, ResponsesConversation]) -> ResponsesRequest:
    """Validate an OpenAI ``/v1/responses`` body; :class:`RequestError` names the field.

    ``stored``: the job's remembered responses, which ``previous_response_id`` may name.
    """
    _refuse_unapplied(body, _RESPONSES_UNAPPLIED)
    fmt = _responses_text(body.get("text"))
    _responses_reasoning(body.get("reasoning"))
    include = body.get("include") or []
    if not isinstance(include, list) or any(v not in _RESPONSES_INCLUDE for v in include):
        raise RequestError(f"include {json.dumps(include)[:80]} is not supported (only {list(_RESPONSES_INCLUDE)})",
                           param="include")
    previous = body.get("previous_response_id")
    names: dict[str, str] = {}
    conversation: list[dict[str, Any]] = []
    if previous is not None:
        if not isinstance(previous, str) or not previous:
            raise RequestError(f"previous_response_id must be a response id (a non-empty string), got "
                               f"{json.dumps(previous)[:80]}", param="previous_response_id")
        earlier = stored.get(previous)
        if earlier is None:
            # OpenAI's answer (a 400, not a 404: the request is at fault), which harnesses match by its code to
            # resend the whole conversation instead.
            raise RequestError(f"Previous response with id '{previous[:80]}' not found: previous_response_id "
                               "names none of this job's last stored responses (those created with store: false "
                               "are not kept)",
                               param="previous_response_id", code="previous_response_not_found")
        names.update(earlier.names)
        conversation = list(earlier.messages)
    conversation += responses_input(body.get("input"), names)
    instructions = _responses_instructions(body.get("instructions"))
    tools = _responses_tools(body.get("tools"))
    logprobs = "message.output_text.logprobs" in include
    top_logprobs = _sampling(body, "top_logprobs")
    max_tokens = _sampling(body, "max_output_tokens", "max_tokens")
    chat = ChatRequest(
        structured=_constraint(body, fmt, "text.format"),
        messages=instructions + conversation,
        tools=tools,
        model=_model(body),
        stream=_flag(body, "stream"),
        max_tokens=max_tokens,
        temperature=_float(_sampling(body, "temperature")),
        top_p=_float(_sampling(body, "top_p")),
        top_k=_sampling(body, "top_k"),
        seed=_sampling(body, "seed"),
        logprobs=logprobs,
        top_logprobs=top_logprobs if logprobs and top_logprobs else None,
        parallel_tool_calls=_allow_parallel(body.get("parallel_tool_calls"), "parallel_tool_calls"),
        **_openai_tool_choice(body.get("tool_choice"), tools, flat=True),
    )
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise RequestError(f"store must be a boolean, got {type(store).__name__}", param="store")
    return ResponsesRequest(chat, conversation, names, body.get("instructions"), previous, store is not False)


# ---------------------------------------------------------------- Anthropic
def anthropic_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Anthropic tool definitions in the OpenAI function format the chat template knows."""
    # Server and client tools of Anthropic's own (web_search_..., bash_..., text_editor_...) are refused: their
    # schema and behaviour are Anthropic's, and nothing here runs them.
    return _flat_tools(raw, ("custom", None), "input_schema", "custom tools with an input_schema only")


def _flat_tools(raw: Any, kinds: tuple[str | None, ...], schema_key: str, why: str) -> list[dict[str, Any]] | None:
    """Tool definitions that name their function at the top level (Anthropic's, the Responses API's) in the
    OpenAI function format the chat template knows; a ``type`` not in ``kinds`` is refused, saying ``why``."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise RequestError("tools must be a list", param="tools")
    out = []
    for i, t in enumerate(raw):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in kinds:
            raise RequestError(f"tools[{i}].type {kind!r} is not supported ({why})", param="tools")
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise RequestError(f"tools[{i}] needs a string name", param="tools")
        if t.get(schema_key) is not None and not isinstance(t[schema_key], dict):
            raise RequestError(f"tools[{i}].{schema_key} must be a JSON Schema object", param="tools")
        # The function as a chat request states it, key for key in this order (the OpenAI Agents SDK's for its
        # chat model): the template renders the dict as JSON, so the same tool gives the same prompt through
        # every API. ``strict`` is rendered, not applied (as on the chat route): the arguments are the model's.
        fn: dict[str, Any] = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = _string(t["description"], f"tools[{i}].description")
        fn["parameters"] = t.get(schema_key) or {"type": "object", "properties": {}}
        if t.get("strict") is not None:
            if not isinstance(t["strict"], bool):
                raise RequestError(f"tools[{i}].strict must be a boolean, got {type(t['strict']).__name__}",
                                   param="tools")
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out or None


def anthropic_messages(system: Any, raw: Any, *, prefill_ok: bool = False) -> list[dict[str, Any]]:
    """Anthropic ``system`` + ``messages`` in canonical form (``tool_result`` blocks become tool messages).

    A final assistant message (a prefill) is refused unless ``prefill_ok`` (counting tokens samples nothing).
    """
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError(f"{where} must be an object with role 'user' or 'assistant'", param="messages")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(f"{where}.content must be a string or a list of blocks", param="messages")
        if not blocks:  # as the API answers: the template would otherwise fail naming no message
            raise RequestError(f"{where}.content is empty: a message needs at least one content block",
                               param="messages")
        texts: list[str] = []
        if m["role"] == "assistant":
            calls = []
            for j, b in enumerate(blocks):
                kind = b.get("type") if isinstance(b, dict) else None
                if kind == "text":
                    texts.append(_text([b], f"{where}.content"))
                elif kind == "tool_use":
                    if not isinstance(b.get("name"), str):
                        raise RequestError(f"{where}.content[{j}] tool_use needs a name", param="messages")
                    if isinstance(b.get("id"), str):
                        names[b["id"]] = b["name"]
                    calls.append(tool_call_message(b["name"], b.get("input") if b.get("input") is not None else {}))
                elif kind in ("thinking", "redacted_thinking"):
                    continue
                else:
                    raise RequestError(f"{where}.content[{j}]: block type {kind!r} is not supported", param="messages")
            msg: dict[str, Any] = {"role": "assistant", "content": PART_SEPARATOR.join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "tool_result":
                result = b.get("content")
                text = _text(result if not isinstance(result, str) else [{"type": "text", "text": result}],
                             f"{where}.content[{j}].content")
                use_id = b.get("tool_use_id")
                out.append({"role": "tool", "name": names.get(use_id, "") if isinstance(use_id, str) else "",
                            "content": text})
            elif kind == "text":
                texts.append(_text([b], f"{where}.content"))
            else:
                raise RequestError(f"{where}.content[{j}]: block type {kind!r} is not supported", param="messages")
        if texts:
            out.append({"role": "user", "content": PART_SEPARATOR.join(texts)})
    if raw[-1]["role"] == "assistant" and not prefill_ok:
        # Anthropic continues a final assistant message (a prefill) in the same turn; the gateway's chat
        # template would close it and start a new turn: a different answer than the API's, so refused.
        raise RequestError(f"messages[{len(raw) - 1}]: a final assistant message (prefill) is not supported: "
                           "end with a user message", param="messages")
    return out


#: Anthropic fields whose work happens on Anthropic's servers (their tools, their context editing, their
#: sandbox): the answer or the prompt would not be what the harness asked for. An empty value asks nothing.
_ANTHROPIC_UNAPPLIED: _Unapplied = {
    "mcp_servers": (lambda v: v == [], "MCP servers are connected by Anthropic's API; run the MCP client in the "
                                       "harness and send its tools as tools"),
    "context_management": (lambda v: v == {} or v == {"edits": []}, "Anthropic's server-side context editing "
                                                                    "would change the prompt the trajectory records"),
    "container": (lambda v: False, "code-execution containers run on Anthropic's servers"),
}


#: A compaction request: Anthropic answers it with a summary block, not a turn. ``count_tokens`` takes and ignores
#: it, as Anthropic's does (the count is the conversation's as sent).
_ANTHROPIC_COMPACTION: _Unapplied = {
    "compaction": (lambda v: False, "a compaction request is summarised by Anthropic's servers into a compaction "
                                    "block; summarise in the harness and send the summary as a message"),
}


def _anthropic_output_config(config: Any, beta_format: Any) -> dict[str, Any] | None:
    """Check Anthropic's ``output_config`` and return the constraint its ``format`` asks for (structured outputs:
    ``{"type": "json_schema", "schema": ...}``; ``beta_format`` is the beta's older ``output_format``, the same);
    ``task_budget`` would change the answer and is refused; ``effort`` is checked, not applied (how long the
    model works is its own, as with ``thinking``)."""
    fmt = _json_format(beta_format, "output_format") if beta_format is not None else None
    if config is None:
        return fmt
    if not isinstance(config, dict):
        raise RequestError("output_config must be an object", param="output_config")
    if config.get("format") is not None:
        if fmt is not None:
            raise RequestError("output_config.format and output_format both give the output's format: give one",
                               param="output_config.format")
        fmt = _json_format(config["format"], "output_config.format")
    if config.get("task_budget") is not None:
        raise RequestError("output_config.task_budget is not supported: the gateway tracks no token budget for the "
                           "model to see", param="output_config.task_budget")
    effort = config.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise RequestError(f"output_config.effort must be 'low', 'medium', 'high', 'xhigh' or 'max', got "
                           f"{json.dumps(effort)[:40]}", param="output_config.effort")
    return fmt


def anthropic_request(body: dict[str, Any], *, count_only: bool = False) -> ChatRequest:
    """Validate an Anthropic ``/v1/messages`` body; :class:`RequestError` names the field.

    ``count_only``: a ``/v1/messages/count_tokens`` body (no ``max_tokens``; a final assistant message counts).
    """
    max_tokens = _sampling(body, "max_tokens")
    if max_tokens is None and not count_only:
        raise RequestError("max_tokens is required", param="max_tokens")
    _refuse_unapplied(body, _ANTHROPIC_UNAPPLIED)
    if not count_only:
        _refuse_unapplied(body, _ANTHROPIC_COMPACTION)
    tools = anthropic_tools(body.get("tools"))
    _anthropic_thinking(body.get("thinking"))
    fmt = _anthropic_output_config(body.get("output_config"), body.get("output_format"))
    return ChatRequest(
        structured=fmt,
        messages=anthropic_messages(body.get("system"), body.get("messages"), prefill_ok=count_only),
        tools=tools,
        model=_model(body),
        stream=_flag(body, "stream"),
        max_tokens=max_tokens,
        temperature=_float(_sampling(body, "temperature")),
        top_p=_float(_sampling(body, "top_p")),
        top_k=_sampling(body, "top_k"),
        stop=_stop(body.get("stop_sequences"), "stop_sequences"),
        **_anthropic_tool_choice(body.get("tool_choice"), tools),
    )


def _anthropic_thinking(thinking: Any) -> None:
    """Check Anthropic's ``thinking`` as the API does. It is not applied: whether the model reasons, and how long,
    is its chat template's and its own (its reasoning comes back as it wrote it, in the text)."""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        # Not held below max_tokens: Anthropic's interleaved thinking lets the budget exceed it.
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise RequestError(f"thinking.budget_tokens must be a positive integer, got {json.dumps(budget)[:40]}",
                               param="thinking")
    elif kind not in ("disabled", "adaptive"):
        raise RequestError("thinking must be {'type': 'enabled', 'budget_tokens': N}, {'type': 'disabled'} or "
                           "{'type': 'adaptive'}", param="thinking")


def _anthropic_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The :class:`ChatRequest` fields Anthropic's ``tool_choice`` sets (``auto``, ``any``, ``tool``, ``none``)."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "none":
        return {"parse_tools": False}
    disable = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if disable is not None and not isinstance(disable, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", param="tool_choice")
    parallel = {"parallel_tool_calls": False} if disable else {}
    if kind == "auto":
        return parallel
    if kind == "any":
        _needs_tools(tools, "{'type': 'any'}")
        return {"require_tool": True, **parallel}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"require_tool": True, "tool_name": _chosen_tool(choice["name"], tools, "tool_choice.name"), **parallel}
    raise RequestError("tool_choice must be {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or "
                       "{'type': 'tool', 'name': ...}", param="tool_choice")


#: Longest agent name a harness may give in the URL or the header (it is recorded with every call).
MAX_AGENT_CHARS = 128
#: Longest OpenAI ``user`` / Anthropic ``metadata.user_id`` taken as the agent's name: the length Anthropic's API
#: accepts, which clients fill (Claude Code sends ~150 characters of JSON naming its device and session).
MAX_API_USER_CHARS = 256
AGENT_HEADER = "X-Prorl-Agent"


def request_agent(path_agent: str | None, header: str | None, body: dict[str, Any]) -> str | None:
    """The agent a request names: its URL (``/jobs/<token>/agents/<name>/v1/...``), else the
    ``X-Prorl-Agent`` header, else the API's own field (OpenAI ``user``, Anthropic ``metadata.user_id``).

    Raises :class:`RequestError` (400) for a name that is empty, too long or not printable.
    """
    metadata = body.get("metadata")
    candidates = [(path_agent, "the URL's agent", MAX_AGENT_CHARS), (header, AGENT_HEADER, MAX_AGENT_CHARS),
                  (body.get("user"), "user", MAX_API_USER_CHARS),
                  (metadata.get("user_id") if isinstance(metadata, dict) else None, "metadata.user_id",
                   MAX_API_USER_CHARS)]
    for value, where, most in candidates:
        if value is None:
            continue
        if not isinstance(value, str) or not 0 < len(value) <= most or not value.isprintable():
            raise RequestError(f"{where} must name the agent in 1 to {most} printable characters",
                               param="user" if where == "user" else None)
        return value
    return None
