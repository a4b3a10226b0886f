"""Bad requests get clear HTTP errors and are not recorded; the job and the gateway keep serving;
a cancelled job or a client that goes away cancels the model call and ends the stream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prorl_cli import protocol as P
from prorl_cli.exceptions import InferenceError, ProtocolError
from prorl_cli.gateway.messages import SAMPLING_CHECKS
from prorl_cli.gateway.server import Gateway
from prorl_cli.testing.grammar import edge_values
from tests.gateway.conftest import ScriptedModel, open_job
from tests.harness import need_module

OK_BODY = {"model": "prorl", "messages": [{"role": "user", "content": "hi"}]}


async def _post(session: Any, url: str, data: Any, **headers: str) -> tuple[int, Any]:
    body = data if isinstance(data, bytes) else json.dumps(data).encode()
    async with session.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as r:
        text = await r.text()
        return r.status, json.loads(text)


def test_bad_requests_get_clear_errors_and_leave_the_job_unharmed(tokenizer: Any) -> None:
    import aiohttp

    async def main() -> None:
        gw = Gateway(max_body_bytes=64 * 1024)
        await gw.start()
        model = ScriptedModel(tokenizer, ["hello"])
        job = open_job(gw, tokenizer, model)
        base = job.base_url()
        root = f"http://127.0.0.1:{gw.port}"
        async with aiohttp.ClientSession() as s:
            cases: list[tuple[str, Any, int, str]] = [
                (f"{base}/chat/completions", b"{not json", 400, "not valid JSON"),
                (f"{base}/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
                (f"{base}/chat/completions", {**OK_BODY, "model": "gpt-9"}, 404, "model 'gpt-9' does not exist"),
                (f"{base}/chat/completions", {**OK_BODY, "n": 2}, 400, "n=2 is not supported"),
                (f"{base}/chat/completions", {**OK_BODY, "messages": []}, 400, "messages must be a non-empty list"),
                (f"{base}/chat/completions", {**OK_BODY, "temperature": "hot"}, 400, "temperature must be a number"),
                (f"{base}/chat/completions", {**OK_BODY, "top_p": 7}, 400, "top_p must be in (0, 1]"),
                (f"{base}/chat/completions", {**OK_BODY, "messages": [{"role": "wizard", "content": "x"}]}, 400,
                 "role 'wizard' is not supported"),
                (f"{base}/chat/completions", {**OK_BODY, "filler": "x" * 100_000}, 413, "exceeds the gateway's"),
                (f"{root}/jobs/forged-token/v1/chat/completions", OK_BODY, 401, "unknown or missing job token"),
                (f"{root}/jobs//v1/chat/completions", OK_BODY, 401, "unknown or missing job token"),
                (f"{root}/v1/chat/completions", OK_BODY, 404, "Not Found"),
                (f"{base}/messages", {"model": "prorl", "messages": [{"role": "user", "content": "x"}]}, 400,
                 "max_tokens is required"),
                (f"{base}/chat/completions", {**OK_BODY, "top_logprobs": 2}, 400, "top_logprobs needs logprobs: true"),
                (f"{base}/responses", {"model": "prorl", "input": "x", "previous_response_id": 5}, 400,
                 "previous_response_id must be a response id"),
                (f"{base}/messages", {"model": "prorl", "max_tokens": 4, "messages": [{"role": "user", "content": []}]},
                 400, "messages[0].content is empty"),
                (f"{base}/messages", {"model": "prorl", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                      "mcp_servers": [{"type": "url", "url": "https://example.invalid/mcp"}]},
                 400, "MCP servers are connected by Anthropic's API"),
                (f"{base}/messages", {"model": "prorl", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                      "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
                 400, "server-side context editing"),
            ]
            for url, data, status, words in cases:
                got, body = await _post(s, url, data)
                message = body["error"]["message"]
                assert (got, words in message) == (status, True), (url, data if isinstance(data, bytes) else "", body)
            assert model.calls == 0 and job.trajectory.calls == []  # nothing refused was recorded
            got, body = await _post(s, f"{base}/chat/completions", OK_BODY)
            assert got == 200 and body["choices"][0]["message"]["content"] == "hello"
            async with s.get(f"{base}/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["prorl"]
            await job.close()
            got, body = await _post(s, f"{base}/chat/completions", OK_BODY)
            assert got == 410 and "job job-1 has ended" in body["error"]["message"]
            assert len(job.trajectory.calls) == 1
        await gw.close()

    asyncio.run(main())


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
#: Numbers of every size: msgpack's 64-bit integers and past them, floats to infinity and NaN.
_numbers = st.integers() | st.integers(-(10**40), 10**40) | st.floats() | _json
_bodies = st.one_of(
    _json,
    st.fixed_dictionaries({"model": st.just("prorl"), "messages": _json}, optional={
        "tools": _json, "stream": st.booleans(), "max_tokens": _numbers, "stop": _json, "n": _numbers,
        "temperature": _numbers, "system": _json, "stop_sequences": _json, "prompt": _json, "seed": _numbers,
        "top_p": _numbers, "top_k": _numbers, "max_completion_tokens": _numbers, "top_logprobs": _numbers,
        "presence_penalty": _numbers, "frequency_penalty": _numbers, "logprobs": _numbers,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": _json}),
        "user": _json, "metadata": _json, "response_format": _json, "parallel_tool_calls": _json,
        "logit_bias": _json, "functions": _json, "function_call": _json, "tool_choice": _json, "thinking": _json,
        "echo": _json, "suffix": _json, "best_of": _numbers, "modalities": _json}),
    # The Responses API's own fields.
    st.fixed_dictionaries({"model": st.just("prorl"), "input": _json}, optional={
        "instructions": _json, "tools": _json, "tool_choice": _json, "stream": st.booleans(), "store": _json,
        "max_output_tokens": _numbers, "temperature": _numbers, "top_p": _numbers, "top_logprobs": _numbers,
        "previous_response_id": _json, "include": _json, "text": _json, "reasoning": _json, "truncation": _json,
        "background": _json, "conversation": _json, "prompt": _json, "parallel_tool_calls": _json,
        "metadata": _json, "user": _json}),
    st.fixed_dictionaries({"model": st.just("prorl"), "max_output_tokens": st.integers(1, 8), "input": st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output",
                                                         "reasoning"])},
                              optional={"role": st.sampled_from(["user", "assistant", "developer"]), "content": _json,
                                        "call_id": _json, "name": _json, "arguments": _json, "output": _json}),
        min_size=1, max_size=3)}),
    st.fixed_dictionaries({"model": st.just("prorl"), "max_tokens": st.integers(1, 8), "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system"]), "content": _json}),
        min_size=1, max_size=3)}),
)


def test_fuzzed_requests_never_break_the_gateway(tokenizer: Any) -> None:
    import aiohttp

    loop = asyncio.new_event_loop()
    gw = Gateway()
    loop.run_until_complete(gw.start())
    job = open_job(gw, tokenizer, ScriptedModel(tokenizer, ["ok"] * 100))
    session = loop.run_until_complete(_session())
    statuses: set[int] = set()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(route=st.sampled_from(["chat/completions", "completions", "responses", "messages",
                                  "messages/count_tokens"]),
           body=_bodies)
    def one(route: str, body: Any) -> None:
        async def go() -> None:
            async with session.post(f"{job.base_url()}/{route}", data=json.dumps(body).encode()) as r:
                text = await r.text()
                statuses.add(r.status)
                assert r.status < 500, text
                if r.status >= 400:
                    assert json.loads(text)["error"]["message"]
        loop.run_until_complete(go())

    try:
        one()
        status, body = loop.run_until_complete(_post(session, f"{job.base_url()}/chat/completions", OK_BODY))
        assert status == 200 and body["choices"][0]["message"]["content"] == "ok"
        assert 400 in statuses
    finally:
        loop.run_until_complete(session.close())
        loop.run_until_complete(gw.close())
        loop.close()
    del aiohttp


async def _session() -> Any:
    import aiohttp

    return aiohttp.ClientSession(headers={"Content-Type": "application/json"})


def test_job_end_and_client_disconnect_cancel_the_model_call(tokenizer: Any) -> None:
    import aiohttp

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, ["never sent"])
        model.gate = asyncio.Event()  # the model call hangs until cancelled
        job = open_job(gw, tokenizer, model)
        async with aiohttp.ClientSession() as s:
            # 1. The job ends while a stream is open and a plain request waits: the model calls are cancelled,
            # the stream ends with the API's error event and the request gets the 410 a later one would.
            async with s.post(f"{job.base_url()}/chat/completions", json={**OK_BODY, "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                await model.entered.wait()
                model.entered.clear()
                plain = asyncio.ensure_future(_post(s, f"{job.base_url()}/chat/completions",
                                                    {**OK_BODY, "messages": [{"role": "user", "content": "other"}]}))
                await model.entered.wait()
                await job.close()
                rest = await r.read()
                assert b"[DONE]" not in rest and b"job job-1 has ended" in rest
            status, body = await plain
            assert status == 410 and body["error"]["code"] == "job_ended"
            assert model.cancelled == 2 and job.trajectory.calls == []
            # 2. The client goes away mid-call: the server cancels the model call it was waiting on.
            job2 = open_job(gw, tokenizer, model)
            model.entered.clear()
            request = asyncio.ensure_future(s.post(f"{job2.base_url()}/chat/completions", json=OK_BODY))
            await model.entered.wait()
            request.cancel()
            async with asyncio.timeout(30):
                while model.cancelled < 3:
                    await asyncio.sleep(0.01)
            assert job2.trajectory.calls == []
            # 3. The gateway still serves.
            model.gate = None
            job3 = open_job(gw, tokenizer, model)
            status, body = await _post(s, f"{job3.base_url()}/chat/completions", OK_BODY)
            assert status == 200 and body["choices"][0]["message"]["content"] == "never sent"
        await gw.close()

    asyncio.run(main())


#: Where each route reads each sampling field: the API's name -> the ``SamplingParams`` field it sets.
_SAMPLING_KEYS = {
    "chat/completions": {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
                         "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"},
    "completions": {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
                    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"},
    "messages": {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"},
    "responses": {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "seed": "seed"},
}
_BASE: dict[str, dict[str, Any]] = {
    "chat/completions": OK_BODY,
    "completions": {"model": "prorl", "prompt": "hi"},
    "messages": {**OK_BODY, "max_tokens": 8},
    "responses": {"model": "prorl", "input": "hi"},
}
#: Past msgpack's 64 bits, and past a float's range (a valid JSON integer still).
_HUGE = [10**12, 2**63, 2**64, -(2**64), 10**30, 2**70, -(2**70), 10**400, -(10**400)]


def _broker_accepts(field: str, value: Any) -> bool:
    """Whether a generate call with ``sampling: {field: value}`` can be sent and passes the broker's check."""
    try:
        P.parse(P.decode_header(P.encode({"op": "generate", "rid": 1, "job_id": "j", "sampling": {field: value}})[0]), 1)
    except (ProtocolError, OverflowError):
        return False
    return True


def test_every_sampling_number_is_accepted_exactly_when_the_broker_accepts_it(tokenizer: Any) -> None:
    """Each sampling field of each route, at the edges of the broker's schema (``edge_values`` reads them off
    ``prorl_cli.protocol.schema.SAMPLING``), past msgpack's integers and past a float's range: the gateway answers
    200 when the broker would take the value and 400 naming the field when it would not: never 500, never a
    502 from the broker, and nothing it refused reaches the model."""
    import aiohttp

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, ["ok"] * 10_000)
        job = open_job(gw, tokenizer, model)
        refused = accepted = 0
        async with aiohttp.ClientSession() as s:
            for route, keys in _SAMPLING_KEYS.items():
                for key, field in keys.items():
                    values = [v for v in edge_values(SAMPLING_CHECKS[field]) if not isinstance(v, bytes)] + _HUGE
                    for value in values:
                        calls = model.calls
                        status, body = await _post(s, f"{job.base_url()}/{route}", {**_BASE[route], key: value})
                        what = (route, key, value, body)
                        required = route == "messages" and key == "max_tokens"  # Anthropic's max_tokens
                        if _broker_accepts(field, value) and not (required and value is None):
                            accepted += 1
                            assert status == 200 and model.calls == calls + 1, what
                            continue
                        refused += 1
                        assert status == 400 and model.calls == calls, what
                        message = body["error"]["message"]
                        assert message.startswith(f"{key} "), what
                        if route != "messages":  # Anthropic's error body has no param; its message names the field
                            assert body["error"]["param"] == key, what
        assert refused > 100 and accepted > 20  # both sides of every bound were crossed
        await gw.close()

    asyncio.run(main())


@pytest.mark.parametrize(("route", "extra", "param", "words"), [
    ("chat/completions", {"n": 2**70}, "n", "is not supported"),
    ("chat/completions", {"n": 1.0}, "n", "n must be an integer"),
    ("chat/completions", {"top_logprobs": 10**30}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ("chat/completions", {"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    ("chat/completions", {"frequency_penalty": -(10**400)}, "frequency_penalty", "frequency_penalty must be in"),
    ("chat/completions", {"frequency_penalty": float("nan")}, "frequency_penalty", "must be a finite number"),
    ("chat/completions", {"logprobs": 10**30}, "logprobs", "logprobs must be a boolean"),
    ("chat/completions", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "stream_options.include_usage must be a boolean"),
    ("completions", {"logprobs": 6}, "logprobs", "logprobs must be in [0, 5]"),
    ("completions", {"n": 2}, "n", "is not supported"),
])
def test_numbers_the_gateway_keeps_are_checked_too(tokenizer: Any, route: str, extra: dict[str, Any], param: str,
                                                   words: str) -> None:
    """Numbers that never reach the broker (``n``, ``top_logprobs``, penalties, the legacy ``logprobs``) are held
    to the OpenAI API's ranges: 400 naming the field, nothing sampled, the job served afterwards."""
    import aiohttp

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, ["hello"])
        job = open_job(gw, tokenizer, model)
        async with aiohttp.ClientSession() as s:
            status, body = await _post(s, f"{job.base_url()}/{route}", {**_BASE[route], **extra})
            assert (status, body["error"]["param"]) == (400, param) and words in body["error"]["message"], body
            assert model.calls == 0
            status, body = await _post(s, f"{job.base_url()}/{route}", _BASE[route])
            assert status == 200 and model.calls == 1
        await gw.close()

    asyncio.run(main())


def test_a_stream_whose_model_call_fails_ends_with_an_error_event_the_sdks_raise(tokenizer: Any) -> None:
    """A streamed request's 200 and headers go out before the model answers; when the model call then fails,
    the stream ends with the API's error event (the SDKs raise it, naming the failure), never a second HTTP
    response written into the stream's body; the gateway keeps serving."""
    need_module("openai", "test")
    need_module("anthropic", "test")
    import anthropic
    import openai

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, ["fine again"])
        failing = True

        async def generate(prompt_ids: list[int], sampling: Any) -> Any:
            if failing:
                raise InferenceError("the engine died")
            return await model(prompt_ids, sampling)

        job = open_job(gw, tokenizer, generate)
        try:
            async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0) as oa:
                with pytest.raises(openai.APIError, match="the model call failed: InferenceError: the engine died"):
                    async for _ in await oa.chat.completions.create(model="prorl", messages=OK_BODY["messages"],
                                                                     stream=True):
                        pass
                with pytest.raises(openai.APIError, match="the engine died"):
                    async for _ in await oa.completions.create(model="prorl", prompt="hi", stream=True):
                        pass
                async with anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key,
                                                    max_retries=0) as an:
                    with pytest.raises(anthropic.APIError, match="the engine died"):
                        async for _ in await an.messages.create(model="prorl", max_tokens=8, stream=True,
                                                                messages=[{"role": "user", "content": "hi"}]):
                            pass
                failing = False
                chunks = [c async for c in await oa.chat.completions.create(
                    model="prorl", messages=OK_BODY["messages"], stream=True)]
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "fine again"
        finally:
            await gw.close()

    asyncio.run(main())


def test_a_prompt_too_long_for_the_model_is_a_400_the_sdks_do_not_retry(tokenizer: Any) -> None:
    """The APIs' answer (OpenAI's context_length_exceeded, Anthropic's "prompt is too long"), which harnesses
    use to stop or compact; a 5xx would be retried by the SDKs, each retry one more model call."""
    need_module("openai", "test")
    need_module("anthropic", "test")
    import anthropic
    import openai

    from prorl_cli.exceptions import ContextLengthExceeded, RemoteError, context_length_message

    calls = 0

    async def generate(prompt_ids: list[int], sampling: Any) -> Any:
        nonlocal calls
        calls += 1
        # As a remote backend's refusal reaches the node: the broker's error reply, typed by its code.
        raise RemoteError.from_reply({"error": {"code": "context_length_exceeded", "message": "backend b0: "
                                                + context_length_message(len(prompt_ids), 64)}})

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, generate)
        try:
            async with openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key) as oa:  # SDK retries on
                with pytest.raises(openai.BadRequestError) as refused:
                    await oa.chat.completions.create(model="prorl", messages=OK_BODY["messages"])
                assert refused.value.code == "context_length_exceeded"
                assert "maximum context length is 64 tokens" in refused.value.message
                # A stream has its 200 before the model is called: the refusal is its error event, raised as one.
                with pytest.raises(openai.APIError, match="maximum context length is 64 tokens"):
                    async for _ in await oa.chat.completions.create(model="prorl", messages=OK_BODY["messages"],
                                                                     stream=True):
                        pass
            async with anthropic.AsyncAnthropic(base_url=job.anthropic_base_url(), api_key=job.api_key) as an:
                with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 63 maximum"):
                    await an.messages.create(model="prorl", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
            assert calls == 3  # one model call per request: nothing retried
            assert job.trajectory.calls == []
        finally:
            await gw.close()

    error = RemoteError.from_reply({"error": {"code": "context_length_exceeded",
                                              "message": context_length_message(70, 64)}})
    assert isinstance(error, ContextLengthExceeded) and isinstance(error, InferenceError) and error.lengths() == (70, 64)
    asyncio.run(main())


def test_unpaired_surrogates_and_deep_nesting_are_400s_naming_the_field(tokenizer: Any) -> None:
    """A JavaScript harness that cuts a string inside an emoji sends "\\ud83d" alone: a 400 naming where, never a
    500 the SDKs would retry; a paired escape is one character and is served."""
    import aiohttp

    async def main() -> None:
        gw = Gateway()
        await gw.start()
        model = ScriptedModel(tokenizer, ["ok", "ok", "ok"])
        job = open_job(gw, tokenizer, model)
        base = job.base_url()
        lone = b'{"model": "prorl", "messages": [{"role": "user", "content": "cut \\ud83d"}]}'
        anthropic_lone = (b'{"model": "prorl", "max_tokens": 4, "system": "s", '
                          b'"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\udc00"}]}]}')
        deep = b'{"model": "prorl", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        paired = b'{"model": "prorl", "messages": [{"role": "user", "content": "whole \\ud83d\\ude00"}]}'
        async with aiohttp.ClientSession() as s:
            for url, data, words in [
                (f"{base}/chat/completions", lone, "messages[0].content holds an unpaired UTF-16 surrogate"),
                (f"{base}/completions", b'{"model": "prorl", "prompt": "\\ud800"}', "prompt holds an unpaired"),
                (f"{base}/messages", anthropic_lone, "messages[0].content[0].text holds an unpaired"),
                (f"{base}/chat/completions", deep, "nested deeper"),
            ]:
                got, body = await _post(s, url, data)
                assert got == 400 and words in body["error"]["message"], (url, body)
            assert model.calls == 0 and job.trajectory.calls == []
            got, body = await _post(s, f"{base}/chat/completions", paired)
            assert got == 200 and body["choices"][0]["message"]["content"] == "ok"
        await gw.close()

    asyncio.run(main())


def test_a_stream_waiting_for_its_turn_sends_keep_alive_comments_the_sdks_skip(tokenizer: Any) -> None:
    """A turn is whole before its first event and may take minutes: meanwhile the stream carries SSE comments,
    so a client's idle or read timeout sees a live connection; SSE parsers (the SDKs') skip them."""
    need_module("openai", "test")
    import aiohttp
    import openai

    async def main() -> None:
        gw = Gateway(keepalive_s=0.05)
        await gw.start()
        model = ScriptedModel(tokenizer, ["after a long turn", "again"])
        model.gate = asyncio.Event()
        job = open_job(gw, tokenizer, model)
        try:
            async with aiohttp.ClientSession() as s, s.post(f"{job.base_url()}/chat/completions",
                                                            json={**OK_BODY, "stream": True}) as r:
                assert r.status == 200
                first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 60)  # before the model answered
                assert first == b": keep-alive\n\n" and not model.gate.is_set()
                model.gate.set()
                rest = (await r.content.read()).decode()
            data = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in data if c["choices"]) == \
                "after a long turn"
            # The SDK reads a stream with comments in it as the same chunks.
            async def slow(prompt_ids: list[int], sampling: Any) -> Any:
                await asyncio.sleep(0.3)  # several keep-alive intervals: the stream carries comments first
                return await model(prompt_ids, sampling)

            job2 = open_job(gw, tokenizer, slow)
            async with openai.AsyncOpenAI(base_url=job2.base_url(), api_key=job2.api_key, max_retries=0) as oa:
                chunks = [c async for c in await oa.chat.completions.create(model="prorl", messages=OK_BODY["messages"],
                                                                            stream=True)]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "after a long turn"
        finally:
            await gw.close()

    asyncio.run(main())


def test_a_tool_format_that_continues_the_models_turn_is_refused_by_name(tokenizer: Any) -> None:
    """Search-R1's tags put a result inside the model's own turn; a chat client sends results back as a new
    turn's tool messages, so a job opened with such a parser would train on prompts the model never saw."""
    from prorl_cli.agent.chat import ChatTokens
    from prorl_cli.agent.tools import get_tool_parser
    from prorl_cli.exceptions import ConfigError

    gw = Gateway()
    with pytest.raises(ConfigError, match=r"SearchR1ToolParser continues the model's own turn .*ctx.agent\(parser=") as e:
        gw.open_job("job-1", generate=ScriptedModel(tokenizer, ["x"]), chat_for=lambda tools: ChatTokens(tokenizer),
                    parser=get_tool_parser("search_r1"), sampling=P.SamplingParams(max_tokens=8))
    assert isinstance(e.value, ValueError) and not gw._jobs, "nothing opened"

