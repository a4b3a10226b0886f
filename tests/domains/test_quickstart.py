"""``prorl quickstart --task X -n 4`` for each domain on the real inference path (transformers engine, tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import need_module


@pytest.mark.timeout(900)
@pytest.mark.parametrize("task", ["math", "code", "swe", "search"])
def test_quickstart_domain_runs_end_to_end(task: str, tmp_path: Path, tiny_model: Path, domain_image: str) -> None:
    need_module("math_verify", "domains")
    need_module("bm25s", "domains")
    if task == "swe":
        need_module("swebench", "swe")
    home = tmp_path / "qs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    image = [] if task == "search" else ["--image", domain_image]  # search starts no sandbox: --image is refused
    proc = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "quickstart", "--out", str(home), "--task", task, "-n", "4",
         "--model", str(tiny_model), *image],
        capture_output=True, text=True, timeout=600, env=env, start_new_session=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runtime = "local" if task == "search" else "apptainer"
    assert f"sandbox runtime {runtime}" in proc.stdout.replace("\n", " ")
    summary = json.loads((home / "summary.json").read_text())
    assert summary["task"] == task and summary["jobs"] == 4 and summary["runtime"] == runtime
    results = [json.loads(line) for line in (home / "trajectories.jsonl").read_text().splitlines()]
    assert len(results) == 4
    for r in results:
        assert r["state"] == "done" and r["reward"] in (0.0, 1.0), r.get("error") or r["output"].get("failure")
        traj = r["output"]["trajectory"]
        assert 1 <= len(traj["calls"]) <= 2  # the quickstart's max_turns
        assert len(traj["sequence_ids"]) == len(traj["loss_mask"]) == len(traj["logprobs"])
        assert traj["violations"] == []  # token-exact: every prompt extends the previous prompt + output
        assert sum(traj["loss_mask"]) == sum(len(c["output_ids"]) for c in traj["calls"])
