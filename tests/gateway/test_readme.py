"""The quick-start code of the ``openai`` and ``anthropic`` READMEs, unchanged, against a job's gateway.

The clients are built as the READMEs build them (``OpenAI()``, ``Anthropic(api_key=...)``), reading
the base URLs and keys from the environment the gateway gives a harness (``JobGateway.env``); the
job serves the model names the snippets ask for. The snippets are synchronous, so the gateway runs
on a loop of its own thread (``threaded_gateway``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.conftest import ThreadedGateway
from tests.harness import need_module

#: The model names the READMEs use.
OPENAI_MODEL = "gpt-5.5"
ANTHROPIC_MODEL = "claude-opus-5-5"


def _environ(monkeypatch: pytest.MonkeyPatch, job: Any) -> None:
    for key, value in job.env().items():
        monkeypatch.setenv(key, value)


def test_openai_readme_chat_completion(threaded_gateway: ThreadedGateway, tokenizer: Any,
                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    need_module("openai", "test")
    job, model = threaded_gateway.open(tokenizer, ["Use isinstance(obj, cls), matey."], models=(OPENAI_MODEL,))
    _environ(monkeypatch, job)

    # ---- openai-python README: "Chat Completions API" (the model name is the README's) ----
    from openai import OpenAI

    client = OpenAI()

    completion = client.chat.completions.create(
        model="gpt-5.5",
        messages=[
            {"role": "developer", "content": "Talk like a pirate."},
            {
                "role": "user",
                "content": "How do I check if a Python object is an instance of a class?",
            },
        ],
    )

    print(completion.choices[0].message.content)
    # ---- end of README code ----
    client.close()
    assert capsys.readouterr().out == "Use isinstance(obj, cls), matey.\n"
    assert model.calls == 1 and len(job.trajectory.calls) == 1


def test_openai_readme_streaming_loop(threaded_gateway: ThreadedGateway, tokenizer: Any,
                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every chunk of a stream has a choice unless usage was asked for (``chunk.choices[0]`` never fails)."""
    need_module("openai", "test")
    job, _ = threaded_gateway.open(tokenizer, ["This is a test."], models=(OPENAI_MODEL,))
    _environ(monkeypatch, job)

    # ---- openai-python README: streaming chat completions ----
    from openai import OpenAI

    client = OpenAI()

    stream = client.chat.completions.create(
        model="gpt-5.5",
        messages=[{"role": "user", "content": "Say this is a test"}],
        stream=True,
    )
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="")
    # ---- end of README code ----
    client.close()
    assert capsys.readouterr().out == "This is a test."


def test_anthropic_readme_create_and_stream(threaded_gateway: ThreadedGateway, tokenizer: Any,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    need_module("anthropic", "test")
    job, _ = threaded_gateway.open(tokenizer, ["Hello! How can I help?"], models=(ANTHROPIC_MODEL,))
    _environ(monkeypatch, job)

    # ---- anthropic-sdk-python README: "Getting started" ----
    import os

    from anthropic import Anthropic

    client = Anthropic(
        api_key=os.environ.get("ANTHROPIC_API_KEY"),  # This is the default and can be omitted
    )

    message = client.messages.create(
        max_tokens=1024,
        messages=[
            {
                "role": "user",
                "content": "Hello, Claude",
            }
        ],
        model="claude-opus-5-5",
    )
    print(message.content)
    # ---- end of README code ----
    out = capsys.readouterr().out
    assert "TextBlock" in out and "Hello! How can I help?" in out
    assert message.stop_reason == "end_turn"

    # ---- anthropic-sdk-python README: "Streaming helpers" (a new conversation: a second segment) ----
    with client.messages.stream(
        max_tokens=1024,
        messages=[{"role": "user", "content": "Say hello there!"}],
        model="claude-opus-5-5",
    ) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
        print()
    # ---- end of README code ----
    client.close()
    assert capsys.readouterr().out == "Hello! How can I help?\n"
    assert len(job.trajectory.calls) == 2


@pytest.mark.parametrize(("field", "value"), [("max_tokens", 10**30), ("seed", 2**70), ("max_tokens", 10**12),
                                              ("max_completion_tokens", 10**30), ("temperature", 10**400)],
                         ids=["max_tokens-1e30", "seed-2e70", "max_tokens-1e12", "max_completion_tokens", "temp-1e400"])
def test_openai_sdk_out_of_range_numbers_are_bad_requests(threaded_gateway: ThreadedGateway, tokenizer: Any,
                                                          monkeypatch: pytest.MonkeyPatch, field: str,
                                                          value: int) -> None:
    """A number past the broker's range (or msgpack's) is a 400 naming the field, never a 500 or a 502;
    nothing is recorded, and the same client is served at once afterwards."""
    need_module("openai", "test")
    import openai

    job, model = threaded_gateway.open(tokenizer, ["still here"], models=(OPENAI_MODEL,))
    _environ(monkeypatch, job)
    client = openai.OpenAI(max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    try:
        given: dict[str, Any] = {field: value}
        for stream in (False, True):  # a stream is refused before its events start
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=OPENAI_MODEL, messages=messages, stream=stream, **given)
            assert refused.value.status_code == 400 and refused.value.param == field
            assert f"{field} must be in [" in refused.value.message
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=OPENAI_MODEL, prompt="hi", extra_body={field: value})
        assert refused.value.param == field
        assert model.calls == 0 and job.trajectory.calls == []
        answer = client.chat.completions.create(model=OPENAI_MODEL, messages=messages, max_tokens=16, seed=2**62)
        assert answer.choices[0].message.content == "still here"
    finally:
        client.close()


@pytest.mark.parametrize(("field", "value"), [("max_tokens", 10**30), ("max_tokens", 10**12), ("top_k", 2**70),
                                              ("temperature", 10**400)])
def test_anthropic_sdk_out_of_range_numbers_are_bad_requests(threaded_gateway: ThreadedGateway, tokenizer: Any,
                                                             monkeypatch: pytest.MonkeyPatch, field: str,
                                                             value: int) -> None:
    need_module("anthropic", "test")
    import anthropic

    job, model = threaded_gateway.open(tokenizer, ["still here"], models=(ANTHROPIC_MODEL,))
    _environ(monkeypatch, job)
    client = anthropic.Anthropic(max_retries=0)
    body: dict[str, Any] = {"model": ANTHROPIC_MODEL, "max_tokens": 16,
                            "messages": [{"role": "user", "content": "hi"}]}
    try:
        with pytest.raises(anthropic.BadRequestError) as refused:
            # Streaming, with the value as extra body: this SDK refuses a non-streaming call with so large a
            # max_tokens itself (too slow, it says), and takes no top_k or temperature keyword of its own.
            client.messages.create(**body, stream=True, extra_body={field: value})
        assert refused.value.status_code == 400
        assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert refused.value.body["error"]["message"].startswith(f"{field} must be in [")  # type: ignore[index]
        assert model.calls == 0
        answer = client.messages.create(**body)
        assert [b.text for b in answer.content if b.type == "text"] == ["still here"]
    finally:
        client.close()
