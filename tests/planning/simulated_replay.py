"""A short replay on simulated time, run as its own process by ``test_simulated_time.py``.

``python simulated_replay.py HOME SEED [STEPS]``: a broker, a node and two
sim bridges on one simulated-time loop, prorl's DAPO sampler (carry-over,
the defaults) over the seeded ``sim_agent`` workload for STEPS steps (3).
Prints ``up`` once every role has registered. Writes the engines' ledgers
under ``HOME/ledgers`` and the sampler's figures to ``HOME/figures.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prorl_cli import timebase
from prorl_cli.testing.simulated import SimulatedDeployment
from prorl_cli.training.sampler import DapoSampler, SamplerConfig


def workload(seed: int) -> list[dict[str, object]]:
    """Eight task instances: groups with and without reward variance, rollouts of a few turns."""
    return [{
        "seed": seed, "turns": [3, 8], "prompt_tokens": 1000,
        "output_tokens": {"median": 100, "sigma": 0.6, "max": 600},
        "observation_tokens": {"median": 300, "sigma": 1.0, "max": 3000},
        "tool_s": {"median": 1.0, "sigma": 1.0, "max": 30.0},
        "p_solve": p, "absorb_hops": False, "draws_by_prompt": True,
    } for p in (0.0, 0.5, 1.0, 0.3, 0.6, 0.0, 0.8, 0.4)]


async def replay(home: Path, seed: int, steps: int) -> dict[str, object]:
    config = {
        "broker": {"heartbeat_interval_s": 0.5, "journal": False},
        "node": {"n_init": 8, "n_run": 32, "n_eval": 8, "handler_paths": ["prorl_cli.testing.handlers"]},
        "inference": {"capacity": 64, "sim_ledger_dir": str(home / "ledgers")},
        "log_level": "WARNING",
    }
    async with SimulatedDeployment(home / "deployment", "replay", config, bridges=2) as dep:
        sampler = DapoSampler(dep.client, "sim_agent", workload(seed),
                              SamplerConfig(group_size=4, target_groups=2, max_in_flight=16, run_id="r", carry_over=True))
        print("up", flush=True)
        done = []
        for k in range(steps):
            batch = await sampler.step(policy_version=k)
            done.append({"simulated_s": batch.stats.wall_s, "filtered": batch.stats.filtered,
                          "rewards": [g.rewards for g in batch.groups],
                          "turns": [r.output["turns"] for g in batch.groups for r in g.results]})
        await sampler.close()
        status = await dep.client.status()
        return {"steps": done, "finished_total": status.finished_total,
                "simulated_s": timebase.now() - timebase.SIMULATED_START_S}


if __name__ == "__main__":
    home, seed = Path(sys.argv[1]), int(sys.argv[2])
    figures = timebase.run_simulated(replay(home, seed, int(sys.argv[3]) if len(sys.argv) > 3 else 3))
    (home / "figures.json").write_text(json.dumps(figures, sort_keys=True))
