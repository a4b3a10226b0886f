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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import ConfigError, ProrlError

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
        closed = self._render(self._base(), False)
        if _SENTINEL not in closed:
            raise ChatTemplateError("the chat template drops assistant content; cannot find the turn boundary")
        #: Text the template puts after assistant content (``<|im_end|>\n`` for ChatML).
        self.turn_suffix = closed[closed.index(_SENTINEL) + len(_SENTINEL) :]
        stop = set()
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None:
            stop.add(int(eos))
        # A base model's tokenizer (Qwen2.5/Qwen3 base) names <|endoftext|> as EOS while its template ends a
        # turn with <|im_end|>: without that token as a stop, the model runs on into turns it invents.
        end = self.encode(self.turn_suffix)[:1]
        if end and self._is_special(end[0]) and self.turn_suffix.startswith(self.decode(end)):
            stop.add(end[0])
        #: Token ids that end an assistant turn (use as ``stop_token_ids``): EOS and the special token
        #: the template closes an assistant turn with.
        self.stop_token_ids = sorted(stop)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], **kwargs: Any) -> ChatTokens:
        """Load the tokenizer of a local model directory (never downloads). Thread-safe.

        A path that holds no tokenizer raises :class:`ConfigError` naming it.
        """
        # transformers' lazy module import is not thread-safe: handlers load tokenizers
        # with asyncio.to_thread, several at once, and could see half-imported modules.
        with _LOAD_LOCK:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except (OSError, ValueError) as e:
                # transformers words a missing directory as a bad hub repo id or a failed download.
                what = ("the directory holds no tokenizer files" if Path(path).is_dir() else
                        "no such directory, and no model of that name in the Hugging Face cache "
                        "(nothing is downloaded)")
                cause = (str(e).strip().splitlines() or [""])[0]
                raise ConfigError(f"cannot load a tokenizer from {str(path)!r}: {what} "
                                  f"({type(e).__name__}: {cause})") from e
        return cls(tokenizer, **kwargs)

    def _is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (a control token, not text the model could spell out)."""
        if token_id in (getattr(self.tokenizer, "all_special_ids", None) or []):
            return True
        added = (getattr(self.tokenizer, "added_tokens_decoder", None) or {}).get(token_id)
        return bool(getattr(added, "special", False))

    @staticmethod
    def _base() -> list[dict[str, Any]]:
        """A closed assistant turn whose content is the sentinel: what observations are rendered after."""
        return [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]

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

    def shortest_prefix(self, ids: list[int], holds: Callable[[str], bool]) -> int | None:
        """The fewest leading ``ids`` whose text ``holds`` accepts (a stop string, a closing tag): where sampling
        would have stopped had the engine known to; ``None`` when the text of all of them fails it.

        ``holds`` must stay true for longer prefixes (a longer prefix decodes to a longer text): the shortest
        one is then found by bisection, a few decodes rather than one per token (byte-level tokens need not
        decode one by one).
        """
        if not ids or not holds(self.decode(ids)):
            return None
        low, high = 1, len(ids)  # the prefix of `high` ids holds
        while low < high:
            mid = (low + high) // 2
            if holds(self.decode(ids[:mid])):
                high = mid
            else:
                low = mid + 1
        return low

    def turn_text(self, output_ids: list[int]) -> str:
        """An assistant turn's text, for tool parsing and people: the end-of-turn stop id dropped,
        other special tokens kept.

        Some models' tokenizers mark ``<tool_call>`` as a special token (vLLM's Hermes parser keeps special
        tokens for that reason): a decode that skips them would hide every tool call from the parser.
        """
        ids = list(output_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        return self.decode(ids)

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
        full = self._render(self._base() + list(messages), add_generation_prompt)
        # The turns before the assistant's, rendered alone, must start the longer conversation unchanged.
        # The assistant turn's own start is not compared: the model continued the generation prompt, and
        # some templates render a closed turn's start otherwise (Qwen3 gives only the last assistant turn
        # an empty <think> block; DeepSeek-R1 drops the reasoning the prompt opened). Rendered now, not
        # once: a template may print today's date (Llama 3.2), and a node runs past midnight.
        earlier = self._render(self._base()[:1], False)
        at = full.find(_SENTINEL)
        rest = full[at + len(_SENTINEL) :]
        if at < len(earlier) or not full.startswith(earlier) or not rest.startswith(self.turn_suffix):
            raise ChatTemplateError(
                "the chat template re-renders earlier turns when messages are added; "
                "it cannot be extended token-exactly"
            )
        return rest[len(self.turn_suffix) :]

    def continuation(self, output_ids: list[int], messages: list[dict[str, Any]]) -> list[int]:
        """Ids to append after ``output_ids``: the turn's close, ``messages``, the next assistant header."""
        return self.encode(self.closing_text(output_ids) + self.observation_text(messages))
