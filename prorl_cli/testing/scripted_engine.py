"""A scripted model behind a real inference bridge: predetermined assistant turns as token ids.

The test (or benchmark) decides every model turn. A script is a JSON file (re-read when it changes, so tests sharing one
deployment add their own entries) holding a list of
``{"match": TEXT, "turns": [TEXT, ...]}``: a call whose prompt contains
``match`` gets ``turns[i]`` (plus ``<|im_end|>``) encoded with the real
tokenizer, where ``i`` is the number of assistant turns already in the
prompt. A turn ``<<sleep:S>>TEXT`` answers ``TEXT`` after ``S`` seconds (a
model call still in flight when a job's limit strikes). A call that asks for
``top_logprobs = k`` gets, at every position, the sampled token (log-prob
-0.1) then the first tokens of the entry's ``"alternatives"`` texts (log-probs
-1, -2, ...), then the ids after the sampled one, k in all. A call with
``sampling.stop`` ends at the token whose text completes one of the strings
(``finish_reason`` ``stop``, ``stop_string`` naming it), as the transformers
engine ends it. Every call is recorded (``calls_path_for``: its prompt and output ids, and the sampling fields it was sent). The engine serves through :class:`prorl_cli.inference.InferenceBridge`,
so every call goes node -> broker -> bridge -> engine and back (the real
generate contract). Run: ``python -m prorl_cli.testing.scripted_engine SCRIPT
TOKENIZER_DIR BACKEND_ID DEPLOYMENT_DIR``.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from prorl_cli.inference.bridge import InferenceBridge
from prorl_cli.inference.contract import Engine, Generation, stop_matcher
from prorl_cli.protocol import SamplingParams
from prorl_cli.rendezvous import await_rendezvous

FALLBACK_TURN = "I have no script for this prompt."
SLEEP = re.compile(r"<<sleep:([0-9.]+)>>")


def calls_path_for(script_path: Path) -> Path:
    """Where the engine records the calls it served."""
    return script_path.with_name(script_path.stem + "-calls.jsonl")


class ScriptedEngine(Engine):
    """Answers from a script; stateless, so any number of jobs may interleave."""

    model = "scripted"
    max_model_len = 1 << 20

    def __init__(self, script_path: Path, tokenizer_dir: str) -> None:
        from transformers import AutoTokenizer

        self.script_path = script_path
        self._mtime_ns = -1
        self.script: list[dict[str, Any]] = []
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        self.calls = 0
        #: The matched entry's ``alternatives`` (first token ids) for the current call.
        self._alternatives: list[int] = []
        #: Every call's prompt and output ids, one JSON object a line (``calls_path_for(script_path)``).
        self.calls_path = calls_path_for(script_path)

    def turn_for(self, prompt: str) -> str:
        mtime_ns = self.script_path.stat().st_mtime_ns
        if mtime_ns != self._mtime_ns:
            self.script, self._mtime_ns = json.loads(self.script_path.read_text()), mtime_ns
        done = prompt.count("<|im_start|>assistant") - 1
        self._alternatives = []
        for entry in self.script:
            if entry["match"] in prompt:
                self._alternatives = [self.tokenizer.encode(t, add_special_tokens=False)[0]
                                      for t in entry.get("alternatives", []) if t]
                turns = entry["turns"]
                return str(turns[done]) if done < len(turns) else FALLBACK_TURN
        return FALLBACK_TURN

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.calls += 1
        prompt = str(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        text = self.turn_for(prompt)
        alternatives = self._alternatives  # read before any await: calls interleave
        slow = SLEEP.match(text)
        if slow:
            await asyncio.sleep(float(slow.group(1)))
            text = text[slow.end():]
        ids = list(self.tokenizer.encode(text + "<|im_end|>", add_special_tokens=False))
        ids, stop_string = self.cut_at_stop(ids, sampling)
        finish = "stop"
        if stop_string is None and len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        with self.calls_path.open("a") as record:  # what the model saw, for tests that check the wire
            record.write(json.dumps({"prompt_ids": list(prompt_ids), "output_ids": ids,
                                     "sampling": sampling.to_wire()}) + "\n")  # as sent: the fields given only
        return Generation(ids, [-0.1] * len(ids), finish, None,
                          top_logprobs=top_logprobs(ids, sampling.top_logprobs, alternatives) if sampling.top_logprobs else None,
                          stop_string=stop_string)

    def cut_at_stop(self, ids: list[int], sampling: SamplingParams) -> tuple[list[int], str | None]:
        """``ids`` up to the token whose text completes one of ``sampling.stop`` (within ``max_tokens``), and that
        string; ``(ids, None)`` when none does. As the transformers engine: the output so far decoded with special
        tokens kept after every token, never cut inside a token (the last id may carry text past the string)."""
        if not sampling.stop:
            return ids, None
        match = stop_matcher(lambda part: str(self.tokenizer.decode(part, skip_special_tokens=False)), sampling.stop)
        for end in range(1, min(len(ids), sampling.max_tokens) + 1):
            stop = match(ids[:end])
            if stop is not None:
                return ids[:end], stop
        return ids, None


def top_logprobs(ids: list[int], k: int, alternatives: list[int]) -> list[list[tuple[int, float]]]:
    """Per position: the sampled token, then ``alternatives``, then the ids after the sampled one, k in all."""
    rows = []
    for token in ids:
        others = [t for t in alternatives if t != token]
        others += [t for t in range(token + 1, token + k + 1) if t not in others]  # k of them, whatever is configured
        rows.append([(token, -0.1)] + [(t, -1.0 - j) for j, t in enumerate(others[: k - 1])])
    return rows


async def serve(script_path: str, tokenizer_dir: str, backend_id: str, deployment_dir: str) -> None:
    engine = ScriptedEngine(Path(script_path), tokenizer_dir)
    info = await await_rendezvous(Path(deployment_dir), 60.0)
    bridge = InferenceBridge(engine, address=info.address, backend_id=backend_id, host=socket.gethostname(),
                             capacity=256, deployment_dir=Path(deployment_dir))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, bridge.stop)
    await bridge.serve()


if __name__ == "__main__":
    asyncio.run(serve(*sys.argv[1:5]))
