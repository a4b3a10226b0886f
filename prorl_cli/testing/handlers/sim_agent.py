"""``sim_agent``: a SWE-like multi-turn rollout in raw token ids, for the simulated engine.

No tokenizer, no sandbox: each turn sends the whole context (system prompt,
every earlier output and observation) as prompt ids, waits a long-tailed
"tool" time, and appends a made-up observation, so prompts grow to tens of
thousands of tokens as in SWE agents. Everything is drawn from a generator
seeded by the instance seed and the job id, so a rerun makes the same calls.
``prorl quickstart --engine sim`` and ``benchmarks/table3.py`` run it.
Instance (all optional)::

    {"seed": 0,                                           # with the job id: each rollout's draws
     "rollout_seed": 17,                                  # instead: these draws, whatever the job id
     "draws_by_prompt": false,                            # the job id without its DAPO step (below)
     "turns": [10, 40],                                   # drawn uniformly, inclusive
     "prompt_tokens": 2000,                               # the opening prompt
     "output_tokens": {"median": 150, "sigma": 0.6, "max": 1024},
     "observation_tokens": {"median": 500, "sigma": 1.0, "max": 8000},
     "tool_s": {"median": 1.0, "sigma": 1.0, "max": 60},  # per action (log-normal)
     "action_delay_s": 0.0,                               # fixed extra per action (tmux-style polling)
     "time_scale": 1.0,                                   # tool waits are divided by this
     "absorb_hops": false,                                # see below
     "p_solve": 0.5}                                      # reward 1 with this probability

``draws_by_prompt``: a DAPO sampler's job ids are
``{run}-s{step}-p{prompt}-k{k}``; with this on, a rollout's draws (turns,
tools, reward) come from the id without its step, so a prompt's k-th
rollout is the same in every configuration of a replay, whichever step
submitted it, and configurations differ only in how they schedule it.

``absorb_hops``: the time a call spends outside its engine (node, broker
and bridge hops, ``Generation.engine_s`` subtracted from the call's
round trip) comes out of the next tool wait, so a job's next call reaches
its engine the modelled tool time after the last one ended there, however
slowly this machine's processes get a core. A replay that runs many times
faster than the GPU it simulates would otherwise multiply those hops by its
speed-up and measure the machine's CPU latency instead of the workload.
A first call's round trip is not used: it may have waited at the broker for
KV room, which is the workload's queueing, not transport. Hops longer than
the tool wait are reported as ``overrun_s`` in the output.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from typing import Any

from prorl_cli import timebase
from prorl_cli.node.handler import AgentHandler, JobContext
from prorl_cli.protocol import SamplingParams

VOCAB = 120000
_STEP = re.compile(r"-s\d+-p")  # the step in a DAPO sampler's job id


def _lognormal(rng: random.Random, spec: dict[str, Any], default_median: float) -> float:
    median = float(spec.get("median", default_median))
    value = median * math.exp(float(spec.get("sigma", 1.0)) * rng.gauss(0.0, 1.0))
    return min(value, float(spec.get("max", math.inf)))


def _token_ids(rng: random.Random, n: int) -> list[int]:
    """``n`` made-up token ids below ``VOCAB`` from one draw of ``rng`` (a ``randrange`` per token was a replay's hot spot)."""
    raw = rng.getrandbits(32 * n).to_bytes(4 * n, "little") if n > 0 else b""
    return [v % VOCAB for v in memoryview(raw).cast("I")]


class SimAgentHandler(AgentHandler):
    """A simulated agent: growing prompts, long-tailed tools, a seeded reward."""

    name = "sim_agent"

    async def init(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance if isinstance(ctx.instance, dict) else {}
        # "rollout_seed" pins one rollout's draws whatever its job id (benchmarks comparing configurations).
        key = _STEP.sub("-p", ctx.job_id) if inst.get("draws_by_prompt") else ctx.job_id
        seed = inst["rollout_seed"] if "rollout_seed" in inst else f"{inst.get('seed', 0)}:{key}"
        ctx.state["rng"] = random.Random(str(seed))

    async def run(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance if isinstance(ctx.instance, dict) else {}
        rng: random.Random = ctx.state["rng"]
        turns = inst.get("turns", [10, 40])
        n_turns = rng.randint(int(turns[0]), int(turns[1])) if isinstance(turns, list) else int(turns)
        scale = float(inst.get("time_scale", 1.0))
        delay_s = float(inst.get("action_delay_s", 0.0))
        absorb = bool(inst.get("absorb_hops", False))
        prompt = _token_ids(rng, int(inst.get("prompt_tokens", 2000)))
        backends: dict[str, int] = {}
        # Output tokens per policy version that served them: a rollout carried across a weight sync has two.
        tokens_by_version: dict[str, int] = {}
        generate_s = engine_s = tool_s = hops_s = overrun_s = 0.0
        for turn in range(n_turns):
            max_tokens = max(1, int(_lognormal(rng, inst.get("output_tokens", {}), 150)))
            started = timebase.now()
            gen = await ctx.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            round_trip_s = timebase.now() - started
            generate_s += round_trip_s
            engine_s += gen.engine_s or 0.0
            backends[str(gen.backend_id)] = backends.get(str(gen.backend_id), 0) + 1
            version = str(gen.policy_version)
            tokens_by_version[version] = tokens_by_version.get(version, 0) + len(gen.output_ids)
            if turn == n_turns - 1:
                break
            wait_s = (_lognormal(rng, inst.get("tool_s", {}), 1.0) + delay_s) / scale
            tool_s += wait_s
            if absorb and turn > 0 and gen.engine_s is not None:
                # This call's way back plus (estimated by this call's) the next call's way out.
                hop_s = max(0.0, round_trip_s - gen.engine_s)
                hops_s += hop_s
                overrun_s += max(0.0, hop_s - wait_s)
                wait_s = max(0.0, wait_s - hop_s)
            await asyncio.sleep(wait_s)
            n_obs = max(1, int(_lognormal(rng, inst.get("observation_tokens", {}), 500)))
            prompt = prompt + gen.output_ids + _token_ids(rng, n_obs)
        ctx.output.update(turns=n_turns, prompt_tokens=len(prompt), backends=backends, tokens_by_version=tokens_by_version,
                          generate_s=round(generate_s, 3), engine_s=round(engine_s, 3), tool_s=round(tool_s, 3))
        if absorb:
            ctx.output.update(hops_s=round(hops_s, 4), overrun_s=round(overrun_s, 4))

    async def eval(self, ctx: JobContext) -> None:
        inst: dict[str, Any] = ctx.instance if isinstance(ctx.instance, dict) else {}
        ctx.reward = 1.0 if ctx.state["rng"].random() < float(inst.get("p_solve", 0.5)) else 0.0
