"""Chat-template rendering to token ids, turn by turn, without re-tokenizing the past.

The first prompt is the chat template applied to the opening messages. Every
later prompt is the previous prompt + the model's output ids, verbatim, +
the ids of only what is new: the end of the assistant turn the model did not
write itself (e.g. the newline after ``<|im_end|>``), the observation
messages, and the next assistant header. Those new pieces are rendered
through the same chat template, so the result reads exactly as the template
would have it, but nothing the model produced is ever decoded and encoded
again.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from prorl_cli.exceptions import ProrlError

# Stands in for assistant content when rendering turn boundaries; never sent to a model.
_LOAD_LOCK = threading.Lock()
_SENTINEL = "\u2063PRORL-ASSISTANT-CONTENT\u2063"


class ChatTemplateError(ProrlError, ValueError):
    """The tokenizer's chat template cannot be rendered turn by turn."""


class ChatTokens:
    """Turns chat messages into token ids through a tokenizer's chat template.

    ``tools`` (JSON schemas) are passed to the template the same way on every
    rendering, so the system turn they produce is the same in the first
    prompt and in the turn boundaries computed later.
    """

    def __init__(self, tokenizer: Any, *, tools: list[dict[str, Any]] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template")
        self.tokenizer = tokenizer
        self.tools = tools
        closed = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}], False)
        if _SENTINEL not in closed:
            raise ChatTemplateError("the chat template drops assistant content; cannot find the turn boundary")
        self._closed_turn = closed
        #: Text the template puts after assistant content (``<|im_end|>\n`` for ChatML).
        self.turn_suffix = closed[closed.index(_SENTINEL) + len(_SENTINEL) :]
        stop = set()
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None:
            stop.add(int(eos))
        #: Token ids that end an assistant turn (use as ``stop_token_ids``).
        self.stop_token_ids = sorted(stop)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], **kwargs: Any) -> ChatTokens:
        """Load the tokenizer of a local model directory (never downloads). Thread-safe."""
        # transformers' lazy module import is not thread-safe: handlers load tokenizers
        # with asyncio.to_thread, several at once, and could see half-imported modules.
        with _LOAD_LOCK:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(tokenizer, **kwargs)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja raises many types; name the template problem
            raise ChatTemplateError(f"chat template failed on {len(messages)} message(s): {type(e).__name__}: {e}") from e
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with no BOS/EOS added (the template places special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def initial_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first prompt: the whole template over ``messages`` plus the assistant header."""
        return self.encode(self._render(messages, True))

    def closing_text(self, output_ids: list[int]) -> str:
        """What the template adds after the model's last turn that the model did not write.

        A turn that ended with the end-of-turn token needs only the rest of the
        template's suffix (``\\n`` after ``<|im_end|>``); a turn cut short (by
        length or another stop id) gets the whole suffix.
        """
        if output_ids and output_ids[-1] in self.stop_token_ids:
            tail = self.decode(output_ids[-1:])
            if self.turn_suffix.startswith(tail):
                return self.turn_suffix[len(tail) :]
        return self.turn_suffix

    def observation_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` following a closed assistant turn."""
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
        full = self._render(base + list(messages), add_generation_prompt)
        if not full.startswith(self._closed_turn):
            raise ChatTemplateError(
                "the chat template re-renders earlier turns when messages are added; "
                "it cannot be extended token-exactly"
            )
        return full[len(self._closed_turn) :]

    def continuation(self, output_ids: list[int], messages: list[dict[str, Any]]) -> list[int]:
        """Ids to append after ``output_ids``: the turn's close, ``messages``, the next assistant header."""
        return self.encode(self.closing_text(output_ids) + self.observation_text(messages))
