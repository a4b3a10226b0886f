"""A short DAPO replay on simulated GPUs: every busy GPU second of the engines is accounted to a job outcome."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.config import load_config
from prorl_cli.training.gpu_ledger import OUTCOMES, breakdown, load_ledgers
from prorl_cli.training.sampler import DapoSampler, SamplerConfig
from tests.harness import Deployment


def instances(n: int) -> list[dict[str, Any]]:
    return [{"seed": 3, "turns": [2, 6], "prompt_tokens": 400, "output_tokens": {"median": 40, "max": 200},
             "observation_tokens": {"median": 60, "max": 400}, "tool_s": {"median": 0.2, "max": 2.0},
             "time_scale": 50.0, "p_solve": (0.0, 0.5, 1.0, 0.5)[i % 4]} for i in range(n)]


def test_breakdown_of_a_short_replay_adds_up_to_the_engines_busy_time(tmp_path: Path) -> None:
    ledgers = tmp_path / "ledgers"
    d = Deployment(tmp_path / "home", config={
        "broker": {"heartbeat_interval_s": 0.25},
        "node": {"n_init": 8, "n_run": 32, "n_eval": 8, "stop_grace_s": 3.0},
        "inference": {"generate_timeout_s": 120.0, "sim_speedup": 50.0, "sim_ledger_dir": str(ledgers)},
    })
    cfg = SamplerConfig(group_size=4, target_groups=2, max_in_flight=16, carry_over=False, run_id="led",
                        step_timeout_s=120)
    try:
        d.start_broker()
        d.start_node("n1")
        for bid in ("sim-a", "sim-b"):
            d.spawn(bid, "serve", "inference", "--engine", "sim", "--backend-id", bid)
        d.wait_for(lambda st: sum(b["alive"] for b in st.backends) == 2, 60.0, "the sim bridges", "sim-a")

        async def go() -> dict[str, str]:
            client = AsyncRolloutClient(d.name, address=d.address, config=load_config(d.config_path))
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
