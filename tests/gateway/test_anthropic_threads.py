"""The ``anthropic`` SDK's message threads through the gateway: its tool runner sends each turn's new messages
only (``thread: {"type": "continue", "previous_message_id": ...}``, without ``system`` or ``tools``), and the
gateway rebuilds the whole request from the thread it keeps. The run ends, and its tokens are exactly those of
the same run resending its whole history (``thread=False``); a thread the job no longer keeps is Anthropic's
``thread_not_found``, on which the SDK resends the whole history by itself."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.conftest import ThreadedGateway, turn
from tests.harness import need_module

SYSTEM = "You are a calculator agent."
TASK = "What is 2+3?"
TURNS = [turn("Let me compute.", ("calculator", {"expression": "2+3"})), "The answer is 5."]


def _run(served: ThreadedGateway, tokenizer: Any, *, stream: bool, thread: bool,
         between: Any = None) -> tuple[list[str | None], Any, list[dict[str, Any]]]:
    """The tool runner's loop against a fresh job: each reply's stop reason, the job, and the bodies sent."""
    import anthropic
    from anthropic import beta_tool

    job, _ = served.open(tokenizer, TURNS)
    sent: list[dict[str, Any]] = []

    def record(request: Any) -> None:
        import json
        sent.append(json.loads(request.content))

    import httpx2  # the transport of this SDK

    client = anthropic.Anthropic(base_url=job.anthropic_base_url(), api_key=job.api_key, max_retries=0,
                                 http_client=httpx2.Client(event_hooks={"request": [record]}))

    @beta_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the expression
        """
        return "5"

    kwargs: dict[str, Any] = {} if thread else {"thread": False}
    runner = client.beta.messages.tool_runner(
        model="prorl", max_tokens=200, system=SYSTEM, tools=[calculator], stream=stream, max_iterations=4,
        messages=[{"role": "user", "content": TASK}], **kwargs)
    stops: list[str | None] = []
    for item in runner:
        message = item.get_final_message() if stream else item
        stops.append(message.stop_reason)
        if between is not None:
            between(job)
    client.close()
    return stops, job, sent


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_tool_runners_thread_ends_and_records_the_tokens_a_full_history_would(
        threaded_gateway: ThreadedGateway, tokenizer: Any, stream: bool) -> None:
    need_module("anthropic", "test")
    stops, job, sent = _run(threaded_gateway, tokenizer, stream=stream, thread=True)
    assert stops == ["tool_use", "end_turn"]
    # The SDK did thread: its second request continued the first reply with the tool result alone.
    assert sent[0]["thread"] == {"type": "create"} and "tools" in sent[0]
    assert sent[1]["thread"]["type"] == "continue" and "tools" not in sent[1] and "system" not in sent[1]
    assert [m["role"] for m in sent[1]["messages"]] == ["user"]
    _, full, full_sent = _run(threaded_gateway, tokenizer, stream=stream, thread=False)
    assert "thread" not in full_sent[1] and len(full_sent[1]["messages"]) == 3
    got, want = job.trajectory, full.trajectory
    assert [(c.prompt_ids, c.output_ids, c.segment, c.prefix_ok) for c in got.calls] == \
        [(c.prompt_ids, c.output_ids, c.segment, c.prefix_ok) for c in want.calls]
    assert got.violations == [] and got.token_exact and got.sequence_ids == want.sequence_ids


def test_a_thread_the_job_no_longer_keeps_is_resent_whole_by_the_sdk(
        threaded_gateway: ThreadedGateway, tokenizer: Any) -> None:
    need_module("anthropic", "test")

    def forget(job: Any) -> None:
        async def clear() -> None:
            job.threads.clear()
        threaded_gateway.call(clear())

    stops, job, sent = _run(threaded_gateway, tokenizer, stream=False, thread=True, between=forget)
    assert stops == ["tool_use", "end_turn"]
    # The continue was refused (thread_not_found) and the SDK replayed the whole history under a new thread.
    assert [s["thread"]["type"] for s in sent] == ["create", "continue", "create"]
    assert len(sent[2]["messages"]) == 3 and "tools" in sent[2]
    calls = job.trajectory.calls
    assert len(calls) == 2 and calls[1].segment == 0 and calls[1].prefix_ok and job.trajectory.violations == []


def test_thread_errors_are_anthropics_with_the_code_the_sdk_reads(
        threaded_gateway: ThreadedGateway, tokenizer: Any) -> None:
    need_module("anthropic", "test")
    import anthropic

    job, model = threaded_gateway.open(tokenizer, TURNS)
    client = anthropic.Anthropic(base_url=job.anthropic_base_url(), api_key=job.api_key, max_retries=0)
    create = client.beta.messages.create
    first = create(model="prorl", max_tokens=100, system=SYSTEM, messages=[{"role": "user", "content": TASK}],
                   thread={"type": "create"})
    go_on = [{"role": "user", "content": "go on"}]
    create(model="prorl", max_tokens=100, messages=go_on,
           thread={"type": "continue", "previous_message_id": first.id})
    refused: list[tuple[dict[str, Any], type[Exception], str | None]] = [
        ({"thread": {"type": "continue", "previous_message_id": first.id}},
         anthropic.BadRequestError, "thread_already_continued"),
        ({"thread": {"type": "continue", "previous_message_id": "msg_unknown"}},
         anthropic.NotFoundError, "thread_not_found"),
        ({"thread": {"type": "fork"}}, anthropic.BadRequestError, None),
    ]
    calls = model.calls
    for extra, kind, code in refused:
        with pytest.raises(kind) as raised:
            create(model="prorl", max_tokens=100, messages=go_on, **extra)
        assert raised.value.error_code == code and "thread" in str(raised.value)
    second = create(model="prorl", max_tokens=100, system=SYSTEM, messages=[{"role": "user", "content": "2+2?"}],
                    thread={"type": "create"})
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(model="prorl", max_tokens=100, system="Another system prompt.", messages=go_on,
               thread={"type": "continue", "previous_message_id": second.id})
    assert raised.value.error_code == "thread_fingerprint_mismatch" and "system" in str(raised.value)
    assert model.calls == calls + 1  # nothing refused was sampled
    client.close()
