"""A job's model calls carry the sampling fields its submitter gave and its handler set, and no others, all the
way to the engine: node -> broker -> bridge, on a real deployment with the scripted model (``conftest.py``).

A field left out stays the receiver's: the broker's KV admission reserves a call's prompt when the job set no
``max_tokens`` (``call_tokens``; tests/node/test_handler_sampling.py checks the estimate itself), and an engine
applies its own default. The broker forwards the fields it read, so what the engine got is what it counted.
"""

from __future__ import annotations

import json
from typing import Any

from prorl_cli.agent.chat import ChatTokens
from prorl_cli.testing.scripted_engine import calls_path_for
from tests.domains.conftest import ScriptedStack
from tests.harness import need_module


def test_the_engine_gets_the_fields_the_job_and_its_handler_set(stack: ScriptedStack) -> None:
    need_module("bm25s", "domains")
    stack.add("SAMPLING-", "\\boxed{Alexander Fleming}")
    stack.start_model()
    client = stack.d.client

    def job(tag: str, **settings: Any) -> dict[str, Any]:
        return {"question": f"SAMPLING-{tag}: who discovered penicillin?", "answers": ["Alexander Fleming"],
                "settings": settings}

    # A temperature and no max_tokens, the search task's max_tokens setting turned off; then a job that gave
    # no sampling at all, under the setting (512).
    ids = [*client.submit("search", [job("chosen", max_tokens=None)], sampling={"temperature": 0.5}, timeout_s=120),
           *client.submit("search", [job("default")], timeout_s=120)]
    for result in client.wait(ids, timeout_s=180):
        assert (result.state, result.reward) == ("done", 1.0), result.error

    chat = ChatTokens.from_pretrained(stack.tiny_model)
    sent: dict[str, list[dict[str, Any]]] = {}
    for line in calls_path_for(stack.script_path).read_text().splitlines():
        call = json.loads(line)
        prompt = chat.decode(call["prompt_ids"])
        for tag in ("chosen", "default"):
            if f"SAMPLING-{tag}:" in prompt:
                sent.setdefault(tag, []).append(call["sampling"])
    # The agent loop adds the template's stop ids (it chose them); nothing else is sent as if chosen.
    assert sent == {"chosen": [{"temperature": 0.5, "stop_token_ids": chat.stop_token_ids}],
                    "default": [{"max_tokens": 512, "stop_token_ids": chat.stop_token_ids}]}
