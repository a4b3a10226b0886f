"""Retokenization drift: the text path against prorl's token path, on real trajectories.

Generates multi-turn trajectories with prorl's token-exact session (the
tiny model by default, or any local model dir), then rebuilds each one the
text way a text-based pipeline would: decode every assistant turn, re-render
the chat template over the messages, re-tokenize. It counts the
trajectories and the sampled tokens that come out different from what was
sampled, and does the same for prorl's token path (which must be zero).

    python benchmarks/retokenization_drift.py                  # tiny model, made on the fly
    python benchmarks/retokenization_drift.py --model DIR      # a local HF model (weights + tokenizer)
    python benchmarks/retokenization_drift.py --tokenizer DIR  # tokenizer only: outputs are random ids
    python benchmarks/retokenization_drift.py --tokenizer DIR --canonical  # outputs: canonically tokenized text

With ``--tokenizer`` alone there is no model: each "model output" is random
token ids from the vocabulary, ended by the end-of-turn token, which is what
a random model emits and a worst case for the text path.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prorl_cli.agent import ChatTokens, TokenSession, Trajectory
from prorl_cli.inference import Generation
from prorl_cli.protocol import SamplingParams

OBSERVATIONS = [
    "result: 391", "  having 2 spaces", "ls -la\ntotal 8\ndrwxr-xr-x 2 root root 4096 .", "{\"ok\": true, \"value\": 3.14}",
    "Traceback (most recent call last):\n  File \"x.py\", line 1", "naïve café — ünïcödé", "done.",
]


class RandomIds:
    """A stand-in model for tokenizer-only runs: random ids, then the end-of-turn id."""

    def __init__(self, chat: ChatTokens, seed: int) -> None:
        self.vocab = len(chat.tokenizer)
        self.stop = chat.stop_token_ids
        self.rng = random.Random(seed)

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        ids = [self.rng.randrange(self.vocab) for _ in range(self.rng.randrange(1, sampling.max_tokens))] + self.stop
        return Generation(ids, [0.0] * len(ids), "stop")


class CanonicalText:
    """A stand-in model that writes real text, tokenized the way the tokenizer itself would.

    This is the best case for the text path: a model whose every output is
    the canonical tokenization of its text (trained models are close to it).
    """

    def __init__(self, chat: ChatTokens, seed: int) -> None:
        import sysconfig

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        self.text = "".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))[:40])
        self.chat = chat
        self.rng = random.Random(seed)

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        start = self.rng.randrange(len(self.text) - 400)
        ids = self.chat.encode(self.text[start : start + self.rng.randrange(20, 200)])[: sampling.max_tokens - 1]
        ids += self.chat.stop_token_ids
        return Generation(ids, [0.0] * len(ids), "stop")


class Recorder:
    """Wraps a generate function and keeps every answer the engine gave, untouched."""

    def __init__(self, generate: Any) -> None:
        self.generate = generate
        self.answers: list[tuple[list[int], list[int]]] = []

    async def __call__(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        gen = await self.generate(prompt_ids, sampling)
        self.answers.append((list(prompt_ids), list(gen.output_ids)))
        return gen


async def rollout(chat: ChatTokens, generate: Any, turns: int, sampling: SamplingParams, i: int) -> Trajectory:
    session = TokenSession(chat, generate, [{"role": "system", "content": "You are a helpful agent."},
                                            {"role": "user", "content": f"Task {i}: list the files, having a look."}])
    for t in range(turns):
        await session.generate(sampling)
        if t < turns - 1:
            session.add_messages([{"role": "tool", "content": OBSERVATIONS[(i + t) % len(OBSERVATIONS)]}])
    return session.trajectory


def text_path(chat: ChatTokens, traj: Trajectory) -> list[list[int]]:
    """Each call's prompt + output rebuilt from text: decode, re-render the template, re-tokenize."""
    rebuilt = []
    msgs: list[dict[str, Any]] = []
    source = [m for m in traj.messages if m["role"] != "assistant"]
    # messages alternate: opening (system, user), then [assistant, tool] per turn
    opening, tools = source[:2], source[2:]
    msgs = list(opening)
    for k, call in enumerate(traj.calls):
        prompt = chat.encode(chat.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        text = chat.decode(call.output_ids, skip_special_tokens=True)
        closed = call.output_ids[-1:] == chat.stop_token_ids
        output = chat.encode(text) + (chat.stop_token_ids if closed else [])
        rebuilt.append(prompt + output)
        msgs.append({"role": "assistant", "content": text})
        if k < len(tools):
            msgs.append(tools[k])
    return rebuilt


def mismatched(sampled: list[int], rebuilt: list[int], mask: list[int]) -> int:
    """Sampled model tokens (mask 1) that the rebuilt sequence does not reproduce in place."""
    kept = [False] * len(sampled)
    for block in difflib.SequenceMatcher(None, sampled, rebuilt, autojunk=False).get_matching_blocks():
        for j in range(block.a, block.a + block.size):
            kept[j] = True
    return sum(1 for j, m in enumerate(mask) if m and not kept[j])


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local model dir (weights + tokenizer); default: a tiny model made now")
    ap.add_argument("--tokenizer", help="tokenizer dir only (outputs are random ids, or --canonical text)")
    ap.add_argument("--canonical", action="store_true",
                    help="with --tokenizer: outputs are canonically tokenized source text (the text path's best case)")
    ap.add_argument("--n", type=int, default=40, help="trajectories")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t0 = time.monotonic()
    if args.tokenizer:
        chat = ChatTokens.from_pretrained(args.tokenizer)
        engine: Any = CanonicalText(chat, args.seed) if args.canonical else RandomIds(chat, args.seed)
        source = f"tokenizer {args.tokenizer}, " + ("canonical text outputs" if args.canonical else "random output ids")
    else:
        from prorl_cli.inference.transformers_engine import TransformersEngine

        model_dir = args.model
        if model_dir is None:
            from prorl_cli.inference.tiny_model import make_tiny_model

            model_dir = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="prorl-tiny-"))))
        chat = ChatTokens.from_pretrained(model_dir)
        engine = TransformersEngine(model_dir)
        await engine.start()
        source = f"model {args.model or 'tiny (prorl dev tiny-model)'}, transformers engine, temperature 1"
    recorder = Recorder(engine.generate if hasattr(engine, "generate") else engine)
    trajs = []
    for i in range(args.n):
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed * 100003 + i,
                                  stop_token_ids=chat.stop_token_ids)
        trajs.append(await rollout(chat, recorder, args.turns, sampling, i))

    answers = iter(recorder.answers)
    stats = {"text": [0, 0], "prorl": [0, 0]}  # [trajectories differing, model tokens differing]
    calls_drifting = total_calls = total_tokens = 0
    for traj in trajs:
        sampled = [p + o for p, o in ((next(answers)) for _ in traj.calls)]  # what the engine saw and returned
        total_tokens += sum(len(c.output_ids) for c in traj.calls)
        rebuilt_text = text_path(chat, traj)
        rebuilt_tokens = [c.prompt_ids + c.output_ids for c in traj.calls]  # prorl: the record itself
        for name, rebuilt in (("text", rebuilt_text), ("prorl", rebuilt_tokens)):
            bad_tokens = 0
            for k, (s, r) in enumerate(zip(sampled, rebuilt, strict=True)):
                mask = [0] * len(traj.calls[k].prompt_ids) + [1] * len(traj.calls[k].output_ids)
                bad_tokens += mismatched(s, r, mask) if s != r else 0
                if name == "text":
                    total_calls += 1
                    calls_drifting += s != r
            stats[name][0] += any(s != r for s, r in zip(sampled, rebuilt, strict=True))
            stats[name][1] += bad_tokens
        # prorl's whole sequence must be the last prompt + output, with the mask on model tokens only.
        assert traj.token_exact and traj.sequence_ids == sampled[-1]

    print(f"retokenization drift: {args.n} trajectories x {args.turns} turns, {source}")
    print(f"  sampled model tokens: {total_tokens}; model calls: {total_calls}; took {time.monotonic() - t0:.1f} s")
    print(f"  {'path':<8}{'trajectories differing':>26}{'sampled tokens not reproduced':>34}")
    for name in ("text", "prorl"):
        nt, nk = stats[name]
        print(f"  {name:<8}{f'{nt}/{args.n} ({100 * nt / args.n:.1f}%)':>26}"
              f"{f'{nk}/{total_tokens} ({100 * nk / max(total_tokens, 1):.2f}%)':>34}")
    print(f"  calls whose prompt+output differ on the text path: {calls_drifting}/{total_calls}")
    if stats["prorl"] != [0, 0]:
        sys.exit("prorl's token path drifted: this is a bug")


if __name__ == "__main__":
    asyncio.run(main())
