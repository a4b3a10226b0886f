"""Per-call latency the gateway adds over ``ctx.generate``: HTTP + JSON parse + message comparison +
template rendering of the new messages + tool-call parsing + the response, p50/p99/p999.

A harness-like client (aiohttp on loopback, resending the whole conversation
each call, OpenAI chat format with one tool) runs in a process of its own, as
a harness does in its sandbox, so its own JSON encoding and HTTP parsing are
not counted as the gateway's. It talks to an in-process gateway whose model is
an instant scripted ``generate``; the baselines are the same ``generate``
awaited directly and, for the HTTP floor, a bare aiohttp server that answers
every request with the same canned body (the round trip any OpenAI endpoint
costs this client). Conversations of 1 and 30 turns, streaming and not. One
warm-up conversation per row is not counted. Also prints the serving
process's CPU time per call (gateway and echo server), a figure other load on
the machine does not move, and the token-continuity rate (calls that extended
the previous prompt exactly). Then multi-agent jobs: a main agent and 3
sub-agents taking turns, and 8 conversations with a call in flight together,
30 turns each, with the lowest per-conversation continuity. Run::

    python benchmarks/gateway_overhead.py [--conversations 40] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
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


def _assistant_message(raw: bytes, stream: bool) -> dict[str, Any]:
    """The assistant message a client rebuilds from a response (or its SSE chunks)."""
    if not stream:
        return json.loads(raw)["choices"][0]["message"]
    msg: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": []}
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:]).get("choices", []):
                msg["content"] += c["delta"].get("content") or ""
                msg["tool_calls"] += [{k: v for k, v in tc.items() if k != "index"}
                                      for tc in c["delta"].get("tool_calls") or []]
    return msg


async def _client(urls: list[str], turns: int, stream: bool, replay: list[bytes] | None) -> tuple[list[float], list[bytes]]:
    """Run one conversation per URL; per-call seconds (and each response, to replay through the echo server)."""
    import aiohttp

    per_call: list[float] = []
    responses: list[bytes] = []
    async with aiohttp.ClientSession() as http:
        for c, base in enumerate(urls):
            messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a calculator."},
                                              {"role": "user", "content": "Compute things."}]
            for t in range(turns):
                body = {"model": "prorl", "messages": messages, "tools": TOOLS, "stream": stream}
                t0 = time.perf_counter()
                async with http.post(f"{base}/chat/completions", json=body) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {raw[:300]!r}")
                if c:  # the first conversation warms up the connection, the template and the tokenizer
                    per_call.append(time.perf_counter() - t0)
                # The echo server answers bytes; the conversation grows as it did against the gateway.
                msg = _assistant_message(replay[t] if replay is not None else raw, stream)
                responses.append(raw)
                messages.append(msg)
                for tc in msg.get("tool_calls") or []:
                    messages.append({"role": "tool", "tool_call_id": tc["id"], "content": "42"})
                if t < turns - 1 and not msg.get("tool_calls"):
                    raise RuntimeError(f"turn {t}: expected a tool call, got {msg}")
    return per_call, responses


async def _agents_client(urls: list[str], turns: int, agents: int, parallel: bool) -> list[float]:
    """Per job (URL): a main agent and ``agents - 1`` sub-agents, each its own conversation named by its URL;
    each turn, every conversation sends one call: one after another (interleaved) or all at once (``parallel``)."""
    import aiohttp

    per_call: list[float] = []
    names = ["main"] + [f"sub{i}" for i in range(1, agents)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for c, base in enumerate(urls):
            convs = {n: [{"role": "system", "content": f"You are {n}, a calculator."},
                         {"role": "user", "content": "Compute things."}] for n in names}

            async def turn(name: str, base: str = base, c: int = c, convs: dict[str, Any] = convs) -> None:
                body = {"model": "prorl", "messages": convs[name], "tools": TOOLS}
                t0 = time.perf_counter()
                async with http.post(base.replace("/v1", f"/agents/{name}/v1") + "/chat/completions", json=body) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {raw[:300]!r}")
                if c:  # the first job warms up
                    per_call.append(time.perf_counter() - t0)
                msg = json.loads(raw)["choices"][0]["message"]
                convs[name].append(msg)
                convs[name] += [{"role": "tool", "tool_call_id": tc["id"], "content": "42"}
                                for tc in msg.get("tool_calls") or []]

            for _ in range(turns):
                if parallel:
                    await asyncio.gather(*(turn(n) for n in names))
                else:
                    for n in names:
                        await turn(n)
    return per_call


def _child(conn: Any, client: Any, *args: Any) -> None:
    """Run the async ``client(*args)`` in this (spawned) process and send back its result or its error."""
    try:
        conn.send(("ok", asyncio.run(client(*args))))
    except Exception as e:  # the parent reports it; a benchmark has no one else to tell
        conn.send(("error", repr(e)))
    finally:
        conn.close()


async def _in_client_process(urls: list[str], turns: int, stream: bool,
                             replay: list[bytes] | None = None) -> tuple[list[float], list[bytes]]:
    return await _in_process(_client, (urls, turns, stream, replay))


async def _in_process(client: Any, args: tuple[Any, ...]) -> Any:
    """The async ``client(*args)`` run in a spawned process; what it returns (or its error, raised)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, client, *args))
    proc.start()
    child.close()
    try:
        status, value = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
    finally:
        proc.join(30)
    if status != "ok":
        raise RuntimeError(f"client process: {value}")
    return value


async def _echo_floor(responses: list[bytes], conversations: int, turns: int,
                      stream: bool) -> tuple[list[float], float]:
    """The same client against a bare aiohttp server answering each call with the gateway's own response bytes.

    Returns the per-call seconds and the server process's CPU seconds over the run.
    """
    from aiohttp import web

    counter = {"i": 0}

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        raw = responses[counter["i"] % len(responses)]
        counter["i"] += 1
        return web.Response(body=raw, content_type="text/event-stream" if stream else "application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        cpu0 = time.process_time()
        per_call, _ = await _in_client_process([f"http://127.0.0.1:{port}/v1"] * (conversations + 1), turns, stream,
                                               replay=responses[:turns])
        cpu = time.process_time() - cpu0
    finally:
        await runner.cleanup()
    return per_call, cpu


def _chat_factory(tok: Any) -> Any:
    """``chat_for(tools)``: the tokenizer's template with these tools, made once per tool list."""
    from prorl_cli.agent.chat import ChatTokens

    chats: dict[str, ChatTokens] = {}

    def chat_for(tools: list[dict[str, Any]] | None) -> ChatTokens:
        key = json.dumps(tools)
        if key not in chats:
            chats[key] = ChatTokens(tok, tools=tools)
        return chats[key]
    return chat_for


async def bench(tokenizer_dir: str, conversations: int, turns: int, stream: bool) -> dict[str, Any]:
    from prorl_cli.agent.chat import ChatTokens
    from prorl_cli.agent.tools import get_tool_parser
    from prorl_cli.gateway.server import Gateway
    from prorl_cli.inference.contract import Generation
    from prorl_cli.protocol import SamplingParams

    tok = ChatTokens.from_pretrained(tokenizer_dir).tokenizer
    texts = [f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{i}+1"}}}}\n</tool_call>'
             for i in range(turns - 1)] + ["The answer is 42."]
    outputs = [list(tok.encode(t + "<|im_end|>", add_special_tokens=False)) for t in texts]

    def scripted() -> Any:
        calls = {"i": 0}

        async def generate(prompt_ids: list[int], sampling: SamplingParams) -> Generation:
            ids = outputs[calls["i"] % turns]
            calls["i"] += 1
            return Generation(ids, [-0.5] * len(ids), "stop", "bench")
        return generate

    chat_for = _chat_factory(tok)

    # Baseline: the same generate, awaited directly.
    direct = []
    generate = scripted()
    for _ in range(conversations * turns):
        t0 = time.perf_counter()
        await generate([1, 2, 3], SamplingParams())
        direct.append(time.perf_counter() - t0)

    gw = Gateway()
    await gw.start()
    jobs = [gw.open_job(f"bench-{c}", generate=scripted(), chat_for=chat_for, parser=get_tool_parser("hermes"),
                        sampling=SamplingParams(max_tokens=256)) for c in range(conversations + 1)]
    try:
        cpu0 = time.process_time()
        per_call, responses = await _in_client_process([j.base_url() for j in jobs], turns, stream)
        gateway_cpu = time.process_time() - cpu0
        continuity = [j.buffer.continuity for j in jobs[1:]]
    finally:
        await gw.close()
    floor, echo_cpu = await _echo_floor(responses[:turns], conversations, turns, stream)
    calls = (conversations + 1) * turns
    ms = [x * 1e3 for x in per_call]
    base = [x * 1e3 for x in direct]
    echo = [x * 1e3 for x in floor]
    return {"turns": turns, "stream": stream, "calls": len(ms),
            "p50_ms": _pct(ms, 0.5), "p99_ms": _pct(ms, 0.99), "p999_ms": _pct(ms, 0.999),
            "direct_p50_ms": _pct(base, 0.5),
            "added_p50_ms": _pct(ms, 0.5) - _pct(base, 0.5), "added_p99_ms": _pct(ms, 0.99) - _pct(base, 0.99),
            "added_p999_ms": _pct(ms, 0.999) - _pct(base, 0.999),
            "echo_p50_ms": _pct(echo, 0.5), "echo_p99_ms": _pct(echo, 0.99),
            # CPU per call of the serving process (all calls, warm-up included): unlike latency, it does not
            # move with what else the machine runs.
            "cpu_ms": gateway_cpu * 1e3 / calls, "echo_cpu_ms": echo_cpu * 1e3 / calls,
            "continuity": statistics.mean(continuity)}


async def bench_agents(tokenizer_dir: str, jobs: int, turns: int, agents: int, parallel: bool) -> dict[str, Any]:
    """Multi-agent jobs: ``agents`` conversations per job (interleaved sub-agents, or all in flight at once)."""
    from prorl_cli.agent.chat import ChatTokens
    from prorl_cli.agent.tools import get_tool_parser
    from prorl_cli.gateway.server import Gateway
    from prorl_cli.inference.contract import Generation
    from prorl_cli.protocol import SamplingParams

    tok = ChatTokens.from_pretrained(tokenizer_dir).tokenizer
    # Every turn is a tool call, so every conversation goes on for all its turns.
    outputs = [list(tok.encode(f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{i}+1"}}}}\n'
                               "</tool_call><|im_end|>", add_special_tokens=False)) for i in range(turns)]
    calls = {"i": 0}

    async def generate(prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        ids = outputs[calls["i"] % turns]
        calls["i"] += 1
        return Generation(ids, [-0.5] * len(ids), "stop", "bench")

    chat_for = _chat_factory(tok)

    gw = Gateway()
    await gw.start()
    opened = [gw.open_job(f"bench-{j}", generate=generate, chat_for=chat_for, parser=get_tool_parser("hermes"),
                          sampling=SamplingParams(max_tokens=256), max_concurrent=agents) for j in range(jobs + 1)]
    try:
        cpu0 = time.process_time()
        per_call = await _in_process(_agents_client, ([j.base_url() for j in opened], turns, agents, parallel))
        gateway_cpu = time.process_time() - cpu0
        per_conversation = [v for j in opened[1:] for v in j.buffer.continuity_by_conversation().values()]
        conversations = min(len(j.buffer.segments) for j in opened[1:])
    finally:
        await gw.close()
    ms = [x * 1e3 for x in per_call]
    return {"workload": f"{agents} {'parallel' if parallel else 'interleaved'}", "calls": len(ms),
            "p50_ms": _pct(ms, 0.5), "p99_ms": _pct(ms, 0.99), "p999_ms": _pct(ms, 0.999),
            "cpu_ms": gateway_cpu * 1e3 / ((jobs + 1) * turns * agents),
            "continuity_min": min(per_conversation), "conversations": conversations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the tiny model, made here)")
    args = parser.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None:
        from prorl_cli.inference.tiny_model import make_tiny_model

        tokenizer = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="prorl-gw-bench-"))))
    print(f"{'turns':>5} {'stream':>6} {'calls':>5} {'p50 ms':>7} {'p99 ms':>7} {'p999 ms':>7} {'direct p50':>10} "
          f"{'added p50':>9} {'added p99':>9} {'added p999':>10} {'echo p50':>8} {'echo p99':>8} {'cpu ms':>6} {'echo cpu':>8} {'continuity':>10}")
    for turns in (1, 30):
        for stream in (False, True):
            r = asyncio.run(bench(tokenizer, args.conversations, turns, stream))
            print(f"{r['turns']:>5} {str(r['stream']):>6} {r['calls']:>5} {r['p50_ms']:>7.3f} {r['p99_ms']:>7.3f} "
                  f"{r['p999_ms']:>7.3f} {r['direct_p50_ms']:>10.4f} {r['added_p50_ms']:>9.3f} "
                  f"{r['added_p99_ms']:>9.3f} {r['added_p999_ms']:>10.3f} {r['echo_p50_ms']:>8.3f} "
                  f"{r['echo_p99_ms']:>8.3f} {r['cpu_ms']:>6.3f} {r['echo_cpu_ms']:>8.3f} {r['continuity']:>10.2f}", flush=True)
    # Multi-agent jobs, 30 turns per conversation: a main agent with 3 sub-agents taking turns, and 8
    # conversations with a call in flight together (latency then includes waiting behind the job's other calls).
    jobs = max(2, args.conversations // 8)
    print(f"\n{'workload':>14} {'calls':>5} {'p50 ms':>7} {'p99 ms':>7} {'p999 ms':>7} {'cpu ms':>6} "
          f"{'conversations':>13} {'min continuity':>14}")
    for agents, parallel in ((4, False), (8, True)):
        r = asyncio.run(bench_agents(tokenizer, jobs, 30, agents, parallel))
        print(f"{r['workload']:>14} {r['calls']:>5} {r['p50_ms']:>7.3f} {r['p99_ms']:>7.3f} {r['p999_ms']:>7.3f} "
              f"{r['cpu_ms']:>6.3f} {r['conversations']:>13} {r['continuity_min']:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
