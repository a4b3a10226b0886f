"""``srun -n 2 prorl serve node`` in one plain (non-array) Slurm job, on the test Slurm: each task registers under
its own name. One name for both had them take it from each other at every heartbeat, requeueing each other's jobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prorl_cli.testing.harness import Deployment
from tests.slurm.cluster import require_slurm, wait_until


def test_each_task_of_an_srun_step_registers_under_its_own_node_id(tmp_path: Path) -> None:
    require_slurm()
    with Deployment(tmp_path / "home", "srun") as stack:
        stack.start_broker()
        out = tmp_path / "job.out"
        script = (f"srun --ntasks=2 {sys.executable} -m prorl_cli -d srun serve node --wait-s 60 "
                  "--n-init 1 --n-run 1 --n-eval 1")
        job_id = subprocess.run(
            ["sbatch", "--parsable", "--ntasks=2", "--cpus-per-task=1", "--mem=0", f"--output={out}", "--wrap", script],
            capture_output=True, text=True, check=True, env=stack.env(), cwd=tmp_path,
        ).stdout.strip().split(";")[0]
        try:
            expected = {f"node-{job_id}.0", f"node-{job_id}.1"}

            def both_alive() -> bool:
                return {n.node_id for n in stack.client.status().nodes if n.alive} == expected

            wait_until(both_alive, 120, f"nodes {sorted(expected)} to register",
                       explain=lambda: (out.read_text() if out.exists() else "(no job output)") + stack.log("broker"))
            # Both are still there a few heartbeats on: neither took the other's place.
            assert stack.client.process("test", {"echo": 1}, timeout_s=60).state == "done"
            assert both_alive(), stack.log("broker")
            assert "used by two live processes" not in stack.log("broker")
        finally:
            subprocess.run(["scancel", job_id], check=False)
