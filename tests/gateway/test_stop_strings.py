"""Where a stop string ends a turn: the same token as the one-decode-per-token definition, in a few decodes."""

from __future__ import annotations

import random
from typing import Any

from prorl_cli.agent.chat import ChatTokens
from prorl_cli.gateway.buffer import _cut_at_stop
from prorl_cli.inference.contract import first_stop

WORDS = ["the", " answer", " is", " 42", ".", "\n", " END", "END", " stop", "é", "日本", " <", "/", "tool", ">", " x"]


class CountingChat:
    """A ChatTokens that counts its decodes."""

    def __init__(self, chat: ChatTokens) -> None:
        self.chat = chat
        self.decodes = 0

    def decode(self, ids: list[int]) -> str:
        self.decodes += 1
        return self.chat.decode(ids)

    shortest_prefix = ChatTokens.shortest_prefix  # its decodes counted


def _by_definition(chat: ChatTokens, out: list[int], stops: list[str]) -> tuple[int, str | None]:
    for k in range(1, len(out) + 1):
        stop = first_stop(chat.decode(out[:k]), stops)
        if stop is not None:
            return k, stop
    return len(out), None


def test_the_cut_is_the_first_token_that_completes_a_stop_string(tokenizer: Any) -> None:
    chat = ChatTokens(tokenizer)
    rng = random.Random(7)
    cut_somewhere = 0
    for _ in range(60):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        out = list(tokenizer.encode(text, add_special_tokens=False))
        lps = [-float(i) for i in range(len(out))]
        stops = rng.sample(["END", " stop", "42.", "</tool>", "日本", "never there"], rng.randint(1, 3))
        got_out, got_lps, got_stop = _cut_at_stop(chat, out, lps, stops)
        k, stop = _by_definition(chat, out, stops)
        assert (len(got_out), got_stop) == (k, stop), (text, stops)
        assert got_out == out[:k] and got_lps == lps[:k]
        cut_somewhere += stop is not None
    assert cut_somewhere > 20, "the random turns exercised the cut"


def test_a_long_turn_with_a_late_stop_takes_few_decodes(tokenizer: Any) -> None:
    chat = CountingChat(ChatTokens(tokenizer))
    out = list(tokenizer.encode(" word" * 3000 + " END and more", add_special_tokens=False))
    got_out, _, stop = _cut_at_stop(chat, out, [0.0] * len(out), ["END"])  # type: ignore[arg-type]
    assert stop == "END" and chat.chat.decode(got_out).endswith("END")
    assert len(got_out) < len(out)
    assert chat.decodes < 20, f"{chat.decodes} decodes for a {len(out)}-token turn"
