"""The simulated GPU engine: its outputs, its prefix cache, its accounting, and behind a real bridge."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.exceptions import InferenceError
from prorl_cli.inference.sim_engine import PrefixCache, SimEngine, SimProfile
from prorl_cli.protocol import SamplingParams
from tests.harness import Deployment
from tests.inference.conftest import HANDLERS, start_bridge


def _engine(**overrides: Any) -> SimEngine:
    return SimEngine(SimProfile.load(**{"speedup": 200.0, **overrides}))


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_same_seed_same_output_and_other_seed_differs() -> None:
    async def go() -> list[Any]:
        outs = []
        for seed in (7, 7, 8):
            eng = _engine()
            try:
                outs.append(await eng.generate(list(range(100)), SamplingParams(max_tokens=64, seed=seed)))
            finally:
                await eng.close()
        return outs

    a, b, c = _run(go())
    assert (a.output_ids, a.logprobs, a.finish_reason) == (b.output_ids, b.logprobs, b.finish_reason)
    assert a.output_ids != c.output_ids
    assert len(a.output_ids) == len(a.logprobs) <= 64
    assert all(lp <= 0 for lp in a.logprobs)


def test_ignore_eos_gives_exactly_max_tokens_and_stop_ends_with_eos() -> None:
    async def go() -> tuple[Any, Any]:
        eng = _engine(output_tokens_median=4)
        try:
            fixed = await eng.generate([1, 2, 3], SamplingParams(max_tokens=37, ignore_eos=True, seed=1))
            free = await eng.generate([1, 2, 3], SamplingParams(max_tokens=500, seed=1))
            return fixed, free
        finally:
            await eng.close()

    fixed, free = _run(go())
    assert len(fixed.output_ids) == 37 and fixed.finish_reason == "length"
    assert free.finish_reason == "stop" and free.output_ids[-1] == SimProfile.load().eos_token_id


def test_prefix_cache_hits_on_a_growing_multi_turn_prompt_and_misses_after_eviction() -> None:
    async def go() -> tuple[dict[str, float], dict[str, float], dict[str, float], int]:
        # Room for about 2,000 tokens of KV.
        eng = _engine(kv_budget_tokens=2048, block_tokens=16)
        rng = random.Random(0)
        try:
            prompt = [rng.randrange(1000) for _ in range(800)]
            for _ in range(3):  # one job's turns: each prompt extends the previous prompt + output
                gen = await eng.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True, seed=1))
                prompt = prompt + gen.output_ids + [rng.randrange(1000) for _ in range(50)]
            after_turns = eng.stats()
            # Other jobs fill the cache: the first job's blocks are evicted.
            for _ in range(3):
                other = [rng.randrange(1000) for _ in range(1500)]
                await eng.generate(other, SamplingParams(max_tokens=8, ignore_eos=True))
            before = eng.stats()
            await eng.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
            return after_turns, before, eng.stats(), len(prompt)
        finally:
            await eng.close()

    after_turns, before, after, last_prompt = _run(go())
    # Turns 2 and 3 found the previous prompt + output cached, in full 16-token blocks:
    # 832 of 882 tokens, then 912 of 964; the new observation is computed.
    assert after_turns["prompt_tokens"] == 800 + 882 + 964
    assert after_turns["cached_tokens"] == 832 + 912
    assert after_turns["prefix_hit_rate"] == pytest.approx(1744 / 2646, abs=1e-3)
    # The evicted job's next turn starts cold: no cached token at all.
    assert after["prompt_tokens"] == before["prompt_tokens"] + last_prompt
    assert after["cached_tokens"] == before["cached_tokens"]


def test_block_hashes_reuse_a_known_prefix_only_where_the_tokens_are_the_same() -> None:
    """A job's next prompt reuses its last call's hashes; any other history is hashed afresh, with the same result."""
    cache = PrefixCache(block_tokens=16, capacity_tokens=100_000)
    rng = random.Random(5)
    last = [rng.randrange(50_000) for _ in range(1000)]  # 62 full blocks and a partial one
    last_hashes = cache.block_hashes(last)
    assert len(last_hashes) == 62
    grown = last + [rng.randrange(50_000) for _ in range(300)]
    assert cache.block_hashes(grown, (last, last_hashes)) == cache.block_hashes(grown)
    # The known ids go another way at token 500: nothing of them may be reused.
    forked = [*last[:500], last[500] + 1, *last[501:], 7, 8]
    assert cache.block_hashes(forked, (last, last_hashes)) == cache.block_hashes(forked)
    assert cache.block_hashes(forked)[:31] == last_hashes[:31] and cache.block_hashes(forked)[31] != last_hashes[31]
    # A shorter prompt than the known one (a job that started over) keeps only its own full blocks.
    assert cache.block_hashes(last[:100], (last, last_hashes)) == last_hashes[:6]


def test_busy_fraction_and_tokens_per_s_add_up_on_a_scripted_load() -> None:
    profile = SimProfile.load(speedup=50.0, step_base_s=0.01, prefill_s_per_token=0.0, decode_s_per_seq=0.0,
                              kv_read_s_per_token=0.0)

    async def go() -> tuple[dict[str, float], float]:
        eng = SimEngine(profile)
        await eng.start()
        try:
            # 4 calls at once of 50 tokens: prefill step + 49 decode steps = 50 steps of 10 ms = 0.5 s GPU time.
            calls = [eng.generate([i + 1] * 10, SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(4)]
            await asyncio.gather(*calls)
            busy_s = eng.counters.busy_s
            await asyncio.sleep(0.5 / profile.speedup)  # as long again idle (GPU time)
            return eng.stats(), busy_s
        finally:
            await eng.close()

    stats, busy_s = _run(go())
    assert busy_s == pytest.approx(0.5, rel=1e-6)
    assert stats["output_tokens"] == 200
    assert stats["busy_s"] == pytest.approx(0.5, rel=1e-3)
    # The figures are consistent with each other and with the elapsed (GPU) time.
    assert stats["busy_fraction"] == pytest.approx(stats["busy_s"] / stats["elapsed_s"], abs=1e-3)
    assert stats["tokens_per_s"] == pytest.approx(200 / stats["elapsed_s"], rel=1e-2)
    assert 0.1 < stats["busy_fraction"] <= 0.5 + 1e-3


def test_cancelled_call_leaves_the_batch() -> None:
    async def go() -> dict[str, float]:
        eng = _engine(speedup=1.0)
        try:
            task = asyncio.ensure_future(eng.generate([1] * 10, SamplingParams(max_tokens=100000, ignore_eos=True)))
            while not eng.stats()["running"]:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return eng.stats()
        finally:
            await eng.close()

    stats = _run(go())
    assert stats["running"] == 0 and stats["aborted"] == 1


def test_a_weight_load_holds_the_engine_for_reload_s_and_drops_the_prefix_cache() -> None:
    """New weights: nothing served for the profile's reload_s (not busy time), and no prefix is reused."""
    import time

    async def go() -> tuple[int, dict[str, float], dict[str, float], float, float]:
        eng = SimEngine(SimProfile.load(speedup=200.0, reload_s=3.0), keep_ledger=True)
        prompt = list(range(1, 801))
        params = SamplingParams(max_tokens=8, ignore_eos=True, seed=1)
        try:
            await eng.generate(prompt, params)
            await eng.generate(prompt, params)
            warm_hits = int(eng.stats()["cached_tokens"])
            before = eng.stats()
            load_from = time.monotonic()
            await eng.reload("checkpoint", 1)
            await eng.generate(prompt, params)
            assert eng.ledger is not None and eng.ledger[-1].admitted_at is not None
            return warm_hits, before, eng.stats(), load_from, eng.ledger[-1].admitted_at
        finally:
            await eng.close()

    warm_hits, before, after, load_from, admitted_at = _run(go())
    assert warm_hits > 0  # the second call found the first one's prompt cached
    assert after["cached_tokens"] == before["cached_tokens"]  # after the load, none of it
    assert after["reloads"] == 1 and after["reload_s"] == 3.0
    # On the engine's timeline the next call starts after the load (3 GPU-s at 200x), which is not busy time.
    assert admitted_at >= load_from + 3.0 / 200
    assert after["busy_s"] - before["busy_s"] < 3.0


def test_bad_profiles_are_named(tmp_path: Path) -> None:
    with pytest.raises(InferenceError, match="no such file or profile"):
        SimProfile.load("no-such-gpu")
    bad = tmp_path / "p.yaml"
    bad.write_text("step_base_s: fast\n")
    with pytest.raises(InferenceError, match="step_base_s must be a number"):
        SimProfile.load(bad)
    bad.write_text("gpu: h100\n")
    with pytest.raises(InferenceError, match=r"unknown key\(s\) \['gpu'\]"):
        SimProfile.load(bad)


def test_sim_bridge_serves_a_sticky_multi_turn_job_and_status_shows_its_stats(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", config={"broker": {"heartbeat_interval_s": 0.25},
                                              "inference": {"generate_timeout_s": 60.0, "sim_speedup": 100.0}})
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        for bid in ("sim-a", "sim-b"):
            start_bridge(d, bid, "--engine", "sim")
        ids = d.client.submit("simturns", [{"turns": 6, "prompt_tokens": 600, "observation_tokens": 40}], n=2)
        results = list(d.client.as_completed(ids, timeout_s=120))
        assert [r.state for r in results] == ["done", "done"], [r.error for r in results]
        for r in results:
            assert len(set(r.output["backends"])) == 1  # sticky: every turn on one backend
        # Wait for a heartbeat that has seen all 12 calls.
        d.wait_for(lambda st: sum(b.stats.get("requests", 0) for b in st.backends) == 12, 30.0,
                   "sim stats in status", "sim-a")
        stats = [b.stats for b in d.client.status().backends]
        prompt = sum(s["prompt_tokens"] for s in stats)
        cached = sum(s["cached_tokens"] for s in stats)
        # Turns 2..6 of each job find the previous turns cached: well over half the prompt tokens.
        assert cached / prompt > 0.6
        assert all(0 < s["busy_fraction"] <= 1 for s in stats if s["requests"])
        env = {**d.env(), "COLUMNS": "200"}
        out = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", d.name, "status"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "prefix hits" in out.stdout and "sim-a" in out.stdout
    finally:
        d.close()


def test_quickstart_with_the_sim_engine(tmp_path: Path) -> None:
    import json

    home = tmp_path / "qs"
    out = subprocess.run([sys.executable, "-m", "prorl_cli", "quickstart", "--engine", "sim", "--out", str(home)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((home / "summary.json").read_text())
    assert summary["task"] == "sim_agent" and summary["states"] == {"done": 16}
    stats = summary["backends"]["inference-0"]
    assert stats["requests"] > 16 and stats["prefix_hit_rate"] > 0.5


def test_ledger_calls_add_up_to_busy_time_with_a_cancel_and_a_cached_turn(tmp_path: Path) -> None:
    from prorl_cli.inference.contract import CALL_JOB_ID

    ledger = tmp_path / "led" / "sim-x.json"

    async def call(job: str, prompt: list[int], max_tokens: int) -> Any:
        CALL_JOB_ID.set(job)  # what the bridge does for each call's task
        return await eng.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    async def go() -> None:
        await eng.start()
        first = [asyncio.ensure_future(call(f"j{i}", [i + 1] * 300, 40 + 7 * i)) for i in range(5)]
        doomed = asyncio.ensure_future(call("jx", [99] * 5000, 100000))
        gens = await asyncio.gather(*first)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        # A second turn of j0 extends its first: most of it is cached.
        await call("j0", [1] * 300 + gens[0].output_ids + [5] * 50, 10)
        await eng.close()

    eng = SimEngine(SimProfile.load(speedup=200.0), backend_id="sim-x", ledger_path=ledger)
    _run(go())
    doc = json.loads(ledger.read_text())
    calls = doc["calls"]
    assert [c["job_id"] for c in calls] == ["j0", "j1", "j2", "j3", "j4", "jx", "j0"]
    # Every busy GPU second is some call's: the shares add up to the engine's busy time.
    assert sum(c["gpu_s"] for c in calls) == pytest.approx(doc["busy_s"], rel=1e-6)
    assert doc["busy_s"] == pytest.approx(eng.counters.busy_s, rel=1e-6)
    assert all(c["gpu_s"] > 0 for c in calls)
    assert [c["outcome"] for c in calls] == ["done"] * 5 + ["aborted", "done"]
    assert [c["output_tokens"] for c in calls[:5]] == [40 + 7 * i for i in range(5)]
    assert calls[5]["output_tokens"] < 100000
    second = calls[6]
    assert second["cached_tokens"] >= (300 + 40) // 16 * 16 and second["prefill_tokens"] < 100
    assert sum(c["prefill_tokens"] + c["cached_tokens"] for c in calls[:5]) == 5 * 300


def test_an_engine_short_of_cpu_reports_how_far_it_ran_behind_its_timeline(tmp_path: Path) -> None:
    import time

    ledger = tmp_path / "led" / "sim-lag.json"

    async def go() -> None:
        await eng.start()
        # 2,000 decode steps at 200x: about 0.1 s of wall time planned; the loop is then blocked for 0.3 s,
        # as a process waiting for a core is, so the engine answers later than its timeline says.
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, time.sleep, 0.3)
        await eng.generate([7] * 100, SamplingParams(max_tokens=2000, ignore_eos=True))
        await eng.close()

    eng = SimEngine(SimProfile.load(speedup=200.0), backend_id="sim-lag", ledger_path=ledger)
    _run(go())
    doc = json.loads(ledger.read_text())
    assert 0 < doc["lag_mean_s"] <= doc["lag_max_s"]
    # The block outlasted the planned steps: the engine's last step ended that much behind (less its steps).
    assert doc["lag_max_s"] >= 0.1
    # Busy time stays the latency model's, whatever the lag.
    assert doc["busy_s"] == pytest.approx(sum(c["gpu_s"] for c in doc["calls"]), rel=1e-6)


def test_no_stop_id_inside_an_output_even_when_stop_ids_sit_side_by_side() -> None:
    # Stop ids next to each other (Llama 3's 128008 and 128009): a draw of the first must not step onto the second.
    async def go() -> list[Any]:
        eng = _engine(vocab_size=8, eos_token_id=7, output_tokens_median=100000)
        try:
            return [await eng.generate([1, 2, 3], SamplingParams(max_tokens=300, seed=seed, stop_token_ids=[5, 6]))
                    for seed in (1, 2)]
        finally:
            await eng.close()

    for gen in _run(go()):
        assert gen.finish_reason == "length" and len(gen.output_ids) == 300
        assert not {5, 6, 7} & set(gen.output_ids), "a stop id inside an output that did not stop"
    # Stop ids that, with the EOS, cover the whole vocabulary leave nothing to generate: named, not a hang.
    async def all_stop() -> None:
        eng = _engine(vocab_size=3, eos_token_id=2)
        try:
            await eng.generate([1], SamplingParams(stop_token_ids=[0, 1]))
        finally:
            await eng.close()

    with pytest.raises(InferenceError, match="leave no token"):
        _run(all_stop())
