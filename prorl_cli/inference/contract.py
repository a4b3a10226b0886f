"""The generate contract: ``generate(prompt_ids, sampling) -> output_ids, logprobs, finish_reason``.

Every engine (vLLM over HTTP, the in-process transformers engine) and every
path through the broker returns a :class:`Generation`. Tokens are ids, never
text: on the wire they travel as int32 bytes (``protocol.pack_tokens``),
log-probs as float32 bytes. When a call asks for ``sampling.top_logprobs = k``
and the engine can say, each output position also carries its k most likely
tokens (``Generation.top_logprobs``), as two more frames. A call with stop
strings (``sampling.stop``) ends at the token that completes one, that token
included, and names the string (``Generation.stop_string``; :func:`first_stop`
says which, when one token completes several).
"""

from __future__ import annotations

import abc
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.exceptions import InferenceError, ProtocolError
from prorl_cli.protocol import (
    ErrorCode,
    SamplingParams,
    pack_floats,
    pack_tokens,
    unpack_floats,
    unpack_tokens,
)

FINISH_REASONS = ("stop", "length", "abort")

#: The job whose call an engine is serving (set by the bridge around ``Engine.generate``; ``None`` elsewhere).
#: Engines that account per job (the simulated engine's ledger) read it; the others ignore it.
CALL_JOB_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("prorl_call_job_id", default=None)


@dataclass
class Generation:
    """One model call's result.

    ``logprobs[i]`` is the log-probability the engine assigned to
    ``output_ids[i]`` under the unmodified model distribution (vLLM's default
    ``raw_logprobs``; the transformers engine does the same).

    ``top_logprobs[i]``, when the call asked for ``k`` alternatives and the
    engine returns them, is the ``k`` most likely ``(token id, logprob)`` at
    position ``i``, most likely first (the same distribution); ``None`` when
    not asked for or the engine cannot say.
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    backend_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: The policy version the broker served the call under (``generate`` reply field; ``None`` if absent).
    policy_version: int | None = None
    #: Seconds the call spent at its engine, queued and generating: the bridge's timing, or the node's
    #: around an HTTP backend's request. The rest of a call's latency is transport (node, broker, bridge).
    engine_s: float | None = None
    #: Per output position, the ``k`` most likely ``(token id, logprob)`` (see the class docstring).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: The ``sampling.stop`` string that ended the generation (``finish_reason`` ``stop``; the last output id
    #: completes it); ``None`` when none did, or the engine did not say (docs/inference.md, "Stop strings").
    stop_string: str | None = None

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(
                f"generation has {len(self.output_ids)} output ids but {len(self.logprobs)} logprobs"
            )
        if self.top_logprobs is not None:
            if len(self.top_logprobs) != len(self.output_ids):
                raise ValueError(f"generation has {len(self.output_ids)} output ids but top_logprobs for "
                                 f"{len(self.top_logprobs)} positions")
            widths = {len(row) for row in self.top_logprobs}
            if len(widths) > 1:
                raise ValueError(f"generation's top_logprobs rows differ in length: {sorted(widths)}")

    def payload(self) -> list[bytes]:
        """The payload frames of a ``generate_reply``: ids (int32) and logprobs (float32); with
        :attr:`top_logprobs`, two more: their ids (int32, n*k) and logprobs (float32, n*k), row by row."""
        frames = [pack_tokens(self.output_ids), pack_floats(self.logprobs)]
        if self.top_logprobs is not None:
            frames += [pack_tokens([t for row in self.top_logprobs for t, _ in row]),
                       pack_floats([lp for row in self.top_logprobs for _, lp in row])]
        return frames

    @classmethod
    def from_payload(cls, frames: list[bytes], finish_reason: str, backend_id: str | None) -> Generation:
        """Inverse of :meth:`payload` (2 or 4 frames); raises ``ProtocolError`` on malformed frames."""
        from prorl_cli.exceptions import ProtocolError
        from prorl_cli.protocol import ErrorCode

        if len(frames) not in (2, 4):
            raise ProtocolError(
                ErrorCode.BAD_FRAME, "generate reply needs 2 payload frames (ids, logprobs) or 4 (and top_logprobs "
                f"ids, logprobs), got {len(frames)}"
            )
        ids, lps = unpack_tokens(frames[0]), unpack_floats(frames[1])
        if len(ids) != len(lps):
            raise ProtocolError(
                ErrorCode.BAD_FRAME, f"generate reply has {len(ids)} ids but {len(lps)} logprobs"
            )
        top = None
        if len(frames) == 4:
            top_ids, top_lps = unpack_tokens(frames[2]), unpack_floats(frames[3])
            if len(top_ids) != len(top_lps) or (ids and len(top_ids) % len(ids)) or (not ids and top_ids):
                raise ProtocolError(
                    ErrorCode.BAD_FRAME, f"generate reply has {len(top_ids)} top_logprobs ids and {len(top_lps)} "
                    f"logprobs for {len(ids)} output tokens (needs k per token for both)"
                )
            k = len(top_ids) // len(ids) if ids else 0
            pairs = list(zip(top_ids, top_lps, strict=True))
            top = [pairs[i * k:(i + 1) * k] for i in range(len(ids))]
        return cls(ids, lps, finish_reason, backend_id, top_logprobs=top)


def refuse_structured(engine: str, sampling: SamplingParams) -> None:
    """For an engine that cannot constrain its output: a call asking for it (``sampling.structured``) is refused
    as a bad field naming the fix, not served unconstrained (the caller would parse what it did not ask for)."""
    if sampling.structured is not None:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"sampling.structured ({next(iter(sampling.structured))}): the "
                            f"{engine} cannot constrain its output; serve the model with vLLM (inference.engine: "
                            "vllm, or an HTTP backend that is a vLLM server)")


def first_stop(text: str, stops: list[str]) -> str | None:
    """The stop string ``text`` completes first: of those it holds, the one whose first occurrence ends earliest
    (on a tie, the first listed); ``None`` when it holds none. vLLM picks the same one."""
    best: tuple[int, int] | None = None
    for i, stop in enumerate(stops):
        at = text.find(stop)
        if at >= 0 and (best is None or at + len(stop) < best[0]):
            best = (at + len(stop), i)
    return None if best is None else stops[best[1]]


def stop_matcher(decode: Callable[[list[int]], str], stops: list[str]) -> Callable[[list[int]], str | None]:
    """``match(ids)``: :func:`first_stop` of the output ``ids`` decoded, for an engine that checks after every
    token, decoding only the last few ids instead of the whole output (quadratic in a long turn).

    Checked after every token, a string can only be completed by the newest one, so it lies in the text of the
    newest token and the string's length of text before it. A token holds at least one byte of text and a
    character at most four, so ``4 * longest + 16`` ids hold that and more; what a window cut at its start
    decodes differently (half a character, a dropped leading space) lies before any string it must find.
    """
    window = 4 * max((len(s) for s in stops), default=0) + 16
    return lambda ids: first_stop(decode(ids[-window:]), stops)


class Engine(abc.ABC):
    """Something that generates token ids from token ids (an inference backend's engine)."""

    #: The model name it serves (what the bridge registers).
    model: str = ""
    #: Longest prompt + output it accepts, in tokens.
    max_model_len: int = 0

    async def start(self) -> None:  # noqa: B027 (optional hook; most engines need nothing)
        """Get ready to serve (start or attach to a server, load weights)."""

    async def healthy(self) -> bool:
        """Whether the engine can serve right now."""
        return True

    @abc.abstractmethod
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        """Generate from ``prompt_ids``; raise ``InferenceError`` with the server's message on failure."""

    async def reload(self, checkpoint: str, policy_version: int) -> None:
        """Load the weights in ``checkpoint`` (a model directory) in place; the bridge calls it between calls.

        Raise ``InferenceError`` naming the problem. Engines that cannot
        reload keep this default: the caller restarts the backend instead.
        """
        raise InferenceError(
            f"the {type(self).__name__} cannot load weights in place; restart the backend on {checkpoint}"
        )

    def stats(self) -> dict[str, float]:
        """Figures the bridge reports in its heartbeat (``stats``); the simulated engine has some."""
        return {}

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release what :meth:`start` acquired (stop a child server)."""
