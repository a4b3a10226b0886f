"""Per-call latency the gateway adds over ``ctx.generate``: HTTP + JSON parse + message comparison +
template rendering of the new messages + tool-call parsing + the response, p50/p99.

A harness-like client (aiohttp on loopback, resending the whole conversation
each call, OpenAI chat format with one tool) talks to an in-process gateway
whose model is an instant scripted ``generate``; the baseline is the same
``generate`` awaited directly. Conversations of 1 and 30 turns, streaming and
not. Also prints the token-continuity rate (calls that extended the previous
prompt exactly). Run::

    python benchmarks/gateway_overhead.py [--conversations 20] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def bench(tokenizer_dir: str, conversations: int, turns: int, stream: bool) -> dict[str, Any]:
    import aiohttp

    from prorl_cli.agent.chat import ChatTokens
    from prorl_cli.agent.tools import get_tool_parser
    from prorl_cli.gateway.server import Gateway
    from prorl_cli.inference.contract import Generation
    from prorl_cli.protocol import SamplingParams

    tok = ChatTokens.from_pretrained(tokenizer_dir).tokenizer
    texts = [f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{i}+1"}}}}\n</tool_call>'
             for i in range(turns - 1)] + ["The answer is 42."]
    outputs = [list(tok.encode(t + "<|im_end|>", add_special_tokens=False)) for t in texts]
    state = {"i": 0}

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        ids = outputs[state["i"] % turns]
        state["i"] += 1
        return Generation(ids, [-0.5] * len(ids), "stop", "bench")

    chats: dict[str, ChatTokens] = {}

    def chat_for(tools: list[dict[str, Any]] | None) -> ChatTokens:
        key = json.dumps(tools)
        if key not in chats:
            chats[key] = ChatTokens(tok, tools=tools)
        return chats[key]

    # Baseline: the same generate, awaited directly.
    direct = []
    for _ in range(conversations * turns):
        t0 = time.perf_counter()
        await generate([1, 2, 3], SamplingParams())
        direct.append(time.perf_counter() - t0)

    gw = Gateway()
    await gw.start()
    per_call: list[float] = []
    continuity: list[float] = []
    async with aiohttp.ClientSession() as http:
        for _ in range(conversations):
            state["i"] = 0
            job = gw.open_job("bench", generate=generate, chat_for=chat_for, parser=get_tool_parser("hermes"),
                              sampling=SamplingParams(max_tokens=256))
            url = f"{job.base_url()}/chat/completions"
            messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a calculator."},
                                              {"role": "user", "content": "Compute things."}]
            for t in range(turns):
                body = {"model": "prorl", "messages": messages, "tools": TOOLS, "stream": stream}
                t0 = time.perf_counter()
                async with http.post(url, json=body) as r:
                    raw = await r.read()
                per_call.append(time.perf_counter() - t0)
                if stream:
                    msg = {"role": "assistant", "content": "", "tool_calls": []}
                    for line in raw.decode().splitlines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            for c in chunk.get("choices", []):
                                msg["content"] += c["delta"].get("content") or ""
                                msg["tool_calls"] += [{k: v for k, v in tc.items() if k != "index"}
                                                      for tc in c["delta"].get("tool_calls") or []]
                else:
                    msg = json.loads(raw)["choices"][0]["message"]
                messages.append(msg)
                for tc in msg.get("tool_calls") or []:
                    messages.append({"role": "tool", "tool_call_id": tc["id"], "content": "42"})
                if t < turns - 1 and not msg.get("tool_calls"):
                    raise RuntimeError(f"turn {t}: expected a tool call, got {msg}")
            continuity.append(job.buffer.continuity)
            await job.close()
    await gw.close()
    ms = [x * 1e3 for x in per_call]
    base = [x * 1e3 for x in direct]
    return {"turns": turns, "stream": stream, "calls": len(ms),
            "p50_ms": _pct(ms, 0.5), "p99_ms": _pct(ms, 0.99),
            "direct_p50_ms": _pct(base, 0.5), "direct_p99_ms": _pct(base, 0.99),
            "added_p50_ms": _pct(ms, 0.5) - _pct(base, 0.5), "added_p99_ms": _pct(ms, 0.99) - _pct(base, 0.99),
            "continuity": statistics.mean(continuity)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the tiny model, made here)")
    args = parser.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None:
        from prorl_cli.inference.tiny_model import make_tiny_model

        tokenizer = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="prorl-gw-bench-"))))
    print(f"{'turns':>5} {'stream':>6} {'calls':>5} {'p50 ms':>8} {'p99 ms':>8} {'direct p50':>10} "
          f"{'added p50':>9} {'added p99':>9} {'continuity':>10}")
    for turns in (1, 30):
        for stream in (False, True):
            r = asyncio.run(bench(tokenizer, args.conversations, turns, stream))
            print(f"{r['turns']:>5} {str(r['stream']):>6} {r['calls']:>5} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
                  f"{r['direct_p50_ms']:>10.4f} {r['added_p50_ms']:>9.3f} {r['added_p99_ms']:>9.3f} "
                  f"{r['continuity']:>10.2f}")


if __name__ == "__main__":
    main()
