"""Bad requests get clear HTTP errors and are not recorded; the job and the gateway keep serving;
a cancelled job or a client that goes away cancels the model call and ends the stream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prorl_cli.gateway.server import Gateway
from tests.gateway.conftest import ScriptedModel, open_job

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
_bodies = st.one_of(
    _json,
    st.fixed_dictionaries({"model": st.just("prorl"), "messages": _json}, optional={
        "tools": _json, "stream": st.booleans(), "max_tokens": _json, "stop": _json, "n": _json,
        "temperature": _json, "system": _json, "stop_sequences": _json, "prompt": _json}),
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
    @given(route=st.sampled_from(["chat/completions", "completions", "messages"]), body=_bodies)
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
            # 1. The job ends while a stream is open: the stream ends, the model call is cancelled.
            async with s.post(f"{job.base_url()}/chat/completions", json={**OK_BODY, "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                await model.entered.wait()
                await job.close()
                try:
                    rest = await r.read()
                except aiohttp.ClientPayloadError:
                    rest = b""
                assert b"[DONE]" not in rest
            assert model.cancelled == 1 and job.trajectory.calls == []
            # 2. The client goes away mid-call: the server cancels the model call it was waiting on.
            job2 = open_job(gw, tokenizer, model)
            model.entered.clear()
            request = asyncio.ensure_future(s.post(f"{job2.base_url()}/chat/completions", json=OK_BODY))
            await model.entered.wait()
            request.cancel()
            async with asyncio.timeout(30):
                while model.cancelled < 2:
                    await asyncio.sleep(0.01)
            assert job2.trajectory.calls == []
            # 3. The gateway still serves.
            model.gate = None
            job3 = open_job(gw, tokenizer, model)
            status, body = await _post(s, f"{job3.base_url()}/chat/completions", OK_BODY)
            assert status == 200 and body["choices"][0]["message"]["content"] == "never sent"
        await gw.close()

    asyncio.run(main())
