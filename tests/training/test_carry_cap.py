"""Carry-over's cap on groups in flight, against a real broker and node running the heavy-tailed ``dapo_sim`` handler."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.training.sampler import DapoSampler, SamplerConfig, StepStats
from tests.harness import Deployment


def prompts(n: int = 40) -> list[dict[str, Any]]:
    """Half zero-variance (always right), half mixed; short rollouts with a long tail."""
    return [{"p": (1.0, 0.5)[i % 2], "scale_s": 0.02, "alpha": 1.2, "max_s": 0.6, "seed": 11} for i in range(n)]


def run_steps(tmp_path: Path, cap_carry: bool) -> tuple[list[tuple[int, int | None]], DapoSampler]:
    """Three steps; every progress callback records (groups in the window, the cap)."""
    # With the cap: the default window.
    window = {} if cap_carry else {"carry_window_steps": 0.0}
    cfg = SamplerConfig(group_size=2, target_groups=2, max_in_flight=32, carry_over=True, max_staleness=1,
                        run_id=f"cap{int(cap_carry)}", step_timeout_s=60, **window)
    seen: list[tuple[int, int | None]] = []
    dep = Deployment(tmp_path / f"cap{int(cap_carry)}", "cap", {"node": {"n_init": 8, "n_run": 40, "n_eval": 8}})
    with dep:
        dep.start_broker()
        dep.start_node("n1")

        async def go() -> DapoSampler:
            client = AsyncRolloutClient(dep.name, address=dep.address, config=dep.load_config())
            async with client:
                sampler = DapoSampler(client, "dapo_sim", prompts(), cfg)

                def progress(_: StepStats) -> None:
                    seen.append((sampler.groups_in_window, sampler.group_cap()))

                sampler.on_progress = progress
                for v in range(3):
                    await sampler.step(policy_version=v)
                await sampler.close()
                return sampler

        sampler = asyncio.run(go())
    return seen, sampler


def test_carry_cap_keeps_the_groups_in_flight_to_what_the_staleness_window_consumes(tmp_path: Path) -> None:
    seen, sampler = run_steps(tmp_path, cap_carry=True)
    assert seen
    highest = 0
    for window, cap in seen:
        assert cap is not None
        # Only a submission grows the window, and one is made only below the cap of its moment (the cap
        # moves with the informative rate, so a window may stand above a cap that has since come down).
        highest = max(highest, cap)
        assert window <= highest, (window, cap, highest)
    # The cap follows the informative rate: the default window's steps' worth, target / rate each, rate
    # Laplace-smoothed.
    rate = (sampler._informative_groups + 1) / (sampler._finished_groups + 2)
    assert sampler.config.carry_window_steps == 1.75
    assert sampler.group_cap() == math.ceil(1.75 * 2 / rate)
    # Without it, replenishment refills the slots finished members free: far more groups than the window uses.
    uncapped, _ = run_steps(tmp_path, cap_carry=False)
    assert max(w for w, _ in uncapped) > max(c for _, c in seen if c is not None)
    assert all(c is None for _, c in uncapped)
