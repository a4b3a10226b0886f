"""A short DAPO replay on simulated GPUs: every busy GPU second of the engines is accounted to a job outcome."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.exceptions import LedgerError
from prorl_cli.training.gpu_ledger import OUTCOMES, breakdown, load_ledgers
from prorl_cli.training.sampler import DapoSampler, SamplerConfig
from tests.harness import Deployment


def instances(n: int) -> list[dict[str, Any]]:
    return [{"seed": 3, "turns": [2, 6], "prompt_tokens": 400, "output_tokens": {"median": 40, "max": 200},
             "observation_tokens": {"median": 60, "max": 400}, "tool_s": {"median": 0.2, "max": 2.0},
             "time_scale": 50.0, "p_solve": (0.0, 0.5, 1.0, 0.5)[i % 4]} for i in range(n)]


def sim_deployment(tmp_path: Path, ledgers: Path, **inference: Any) -> Deployment:
    """A broker, a node and two sim bridges (``sim-a``, ``sim-b``) writing their ledgers to ``ledgers``; started."""
    d = Deployment(tmp_path / "home", config={
        "broker": {"heartbeat_interval_s": 0.25},
        "node": {"n_init": 8, "n_run": 32, "n_eval": 8, "stop_grace_s": 3.0},
        "inference": {"generate_timeout_s": 120.0, "sim_speedup": 50.0, "sim_ledger_dir": str(ledgers), **inference},
    })
    try:
        d.start_broker()
        d.start_node("n1")
        for bid in ("sim-a", "sim-b"):
            d.spawn(bid, "serve", "inference", "--engine", "sim", "--backend-id", bid)
        # Running bridges with their first stats (KV capacity) in the broker's status.
        d.wait_for(lambda st: sum(bool(b.alive and b.stats) for b in st.backends) == 2, 60.0,
                   "the sim bridges", "sim-a")
    except BaseException:
        d.close()
        raise
    return d


def test_breakdown_of_a_short_replay_adds_up_to_the_engines_busy_time(tmp_path: Path) -> None:
    ledgers = tmp_path / "ledgers"
    cfg = SamplerConfig(group_size=4, target_groups=2, max_in_flight=16, carry_over=False, run_id="led",
                        step_timeout_s=120)
    d = sim_deployment(tmp_path, ledgers)
    try:

        async def go() -> dict[str, str]:
            client = AsyncRolloutClient(d.name, address=d.address, config=d.load_config())
            async with client:
                sampler = DapoSampler(client, "sim_agent", instances(16), cfg)
                sampler.job_outcomes = {}
                for v in range(2):
                    await sampler.step(policy_version=v)
                await sampler.close()
                return sampler.job_outcomes

        outcomes = asyncio.run(go())
        d.stop()  # the bridges write their ledgers as they exit
    finally:
        d.close()
    docs = load_ledgers(ledgers)
    assert sorted(doc["backend_id"] for doc in docs) == ["sim-a", "sim-b"]
    b = breakdown(docs, outcomes)
    assert b.busy_s > 0
    # The categories add up to the engines' busy GPU seconds, and every call belongs to a job the sampler knows.
    assert sum(b.gpu_s.values()) == pytest.approx(b.busy_s, rel=1e-6)
    assert set(b.gpu_s) <= set(OUTCOMES) and "unknown" not in b.gpu_s
    # Two steps of two informative groups of 4 (a step may finish more than its target).
    assert b.gpu_s.get("informative", 0) > 0 and b.jobs["informative"] >= 16 and b.jobs["informative"] % 4 == 0
    # Early termination cancelled what was still running at the end of each step (carry-over off).
    assert b.jobs.get("cancelled", 0) + b.jobs.get("in_flight", 0) > 0
    assert b.prompt_tokens == sum(c["prompt_tokens"] for doc in docs for c in doc["calls"])
    # Sticky routing keeps every job's turns on one backend: nothing recomputed for a move.
    assert b.moved_calls == 0 and b.recomputed_tokens["moved"] == 0


def test_carried_rollouts_keep_their_backend_across_a_weight_sync(tmp_path: Path) -> None:
    """Sticky carry: a rollout carried into the next step makes its next call on the backend of its previous one."""
    ledgers = tmp_path / "ledgers"
    # No window cap: 16 jobs in flight for a step that takes one group, so some are always carried,
    # however fast the machine finishes the first group.
    cfg = SamplerConfig(group_size=4, target_groups=1, max_in_flight=16, carry_over=True, max_staleness=5,
                        carry_window_steps=0, run_id="carry", step_timeout_s=120)
    d = sim_deployment(tmp_path, ledgers)
    try:
        async def go() -> dict[str, dict[str, int]]:
            client = AsyncRolloutClient(d.name, address=d.address, config=d.load_config())
            async with client:
                sampler = DapoSampler(client, "sim_agent", instances(32), cfg)
                carried: dict[str, dict[str, int]] = {}  # job id -> its output tokens per serving version
                for v in range(3):
                    batch = await sampler.step(policy_version=v)
                    # A weight sync between steps: each bridge finishes its calls, loads, serves version v + 1.
                    (tmp_path / f"v{v + 1}").mkdir()
                    await client.update_weights(tmp_path / f"v{v + 1}", policy_version=v + 1)
                    for g in batch.groups:
                        if g.policy_version < v:
                            carried |= {r.job_id: r.output["tokens_by_version"] for r in g.results}
                await sampler.close()
                return carried

        carried = asyncio.run(go())
        d.stop()
    finally:
        d.close()
    assert carried, "no rollout was carried into a later step"
    calls: dict[str, list[tuple[float, str]]] = {}
    for doc in load_ledgers(ledgers):
        for c in doc["calls"]:
            calls.setdefault(c["job_id"], []).append((c["submitted_at"], doc["backend_id"]))
    output_tokens: dict[str, int] = {}
    for doc in load_ledgers(ledgers):
        for c in doc["calls"]:
            output_tokens[c["job_id"]] = output_tokens.get(c["job_id"], 0) + c["output_tokens"]
    for job in carried:
        backends = [b for _, b in sorted(calls[job])]
        assert len(backends) >= 2 and set(backends) == {backends[0]}, f"carried job {job} moved: {backends}"
        # Each token is counted under the version that served it; they add up to what the engine generated.
        assert sum(carried[job].values()) == output_tokens[job], (job, carried[job])
    # A rollout whose calls straddle a weight sync has tokens of two versions (the per-token off-policy share).
    assert any(len(v) >= 2 for v in carried.values()), carried


def test_kv_admission_keeps_each_backends_live_contexts_within_its_kv_cache(tmp_path: Path) -> None:
    """With a KV cache of 3,000 tokens, a backend takes a new job only while its live jobs' contexts fit."""
    ledgers = tmp_path / "ledgers"
    profile = tmp_path / "small-kv.yaml"
    profile.write_text("kv_budget_tokens: 3000\n")
    cfg = SamplerConfig(group_size=4, target_groups=2, max_in_flight=16, carry_over=False, run_id="kv",
                        step_timeout_s=120)
    d = sim_deployment(tmp_path, ledgers, sim_profile=str(profile))
    try:
        async def go() -> None:
            client = AsyncRolloutClient(d.name, address=d.address, config=d.load_config())
            async with client:
                sampler = DapoSampler(client, "sim_agent", instances(16), cfg)
                await sampler.step(policy_version=0)
                await sampler.close()

        asyncio.run(go())
        d.stop()
    finally:
        d.close()
    docs = load_ledgers(ledgers)
    most_at_once = 0
    for doc in docs:
        by_job: dict[str, list[dict[str, Any]]] = {}
        for c in doc["calls"]:
            by_job.setdefault(c["job_id"], []).append(c)
        spans = {j: (min(c["submitted_at"] for c in cs), max(c["ended_at"] or doc["closed_at"] for c in cs))
                 for j, cs in by_job.items()}
        for job, (start, _) in spans.items():
            # Jobs live on this backend when this one made its first call, and their latest context then.
            live = [j for j, (a, b) in spans.items() if j != job and a < start < b]
            load = sum(max((c for c in by_job[j] if c["submitted_at"] < start), key=lambda c: c["submitted_at"])
                       ["prompt_tokens"] for j in live)
            first = min(by_job[job], key=lambda c: c["submitted_at"])
            assert not live or load + first["prompt_tokens"] <= 3000, (job, live, load)
            most_at_once = max(most_at_once, len(live) + 1)
    # Far fewer than the 8 jobs per backend the sampler keeps in flight (16 over 2 backends).
    assert 1 <= most_at_once <= 6


def test_engine_time_reaches_the_handler_and_tool_waits_absorb_the_hops(tmp_path: Path) -> None:
    """Each call's engine time (the bridge's timing) reaches the handler inside its round trip; with
    ``absorb_hops`` the rollout reports the hops it took out of its tool waits."""
    d = sim_deployment(tmp_path, tmp_path / "ledgers")
    try:
        insts = [{**instances(1)[0], "turns": [4, 4], "absorb_hops": absorb} for absorb in (True, False)]
        ids = list(d.client.submit("sim_agent", insts))
        results = {r.job_id: r for r in d.client.wait(ids, timeout_s=120)}
    finally:
        d.close()
    absorbing, plain = (results[j] for j in ids)
    for r in (absorbing, plain):
        assert r.state == "done", r.error
        # Engine time is a part of each call's round trip, never more.
        assert 0 < r.output["engine_s"] <= r.output["generate_s"], r.output
    assert 0 <= absorbing.output["overrun_s"] <= absorbing.output["hops_s"], absorbing.output
    assert "hops_s" not in plain.output


def test_a_ledger_that_is_not_one_is_named_with_its_file_and_field(tmp_path: Path) -> None:
    good_call = {"job_id": "j1", "submitted_at": 1.0, "gpu_s": 0.5, "prompt_tokens": 10, "cached_tokens": 0,
                 "output_tokens": 3}
    good = {"backend_id": "sim-a", "busy_s": 0.5, "speedup": 1.0, "idle_spans": [], "calls": [good_call]}
    (tmp_path / "a.json").write_text(json.dumps(good))
    assert breakdown(load_ledgers(tmp_path), {"j1": "informative"}).gpu_s == {"informative": 0.5}
    with pytest.raises(LedgerError, match="job j1: unknown outcome 'won'"):
        breakdown(load_ledgers(tmp_path), {"j1": "won"})
    cases = [
        ("{not json", r"b\.json: not a readable JSON document"),
        ("[]", r"b\.json: expected a JSON object, got list"),
        (json.dumps({**good, "busy_s": "1"}), r"b\.json: field 'busy_s' must be int or float, got '1'"),
        (json.dumps({k: v for k, v in good.items() if k != "calls"}), r"b\.json: missing field 'calls'"),
        (json.dumps({**good, "calls": [{**good_call, "prompt_tokens": 1.5}]}),
         r"b\.json: calls\[0\]: field 'prompt_tokens' must be int, got 1\.5"),
    ]
    for text, message in cases:
        (tmp_path / "b.json").write_text(text)
        with pytest.raises(LedgerError, match=message):
            load_ledgers(tmp_path)
