"""``prorl quickstart --task X -n 2`` for each domain on the real inference path (transformers engine, tiny model)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
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
        [sys.executable, "-m", "prorl_cli", "quickstart", "--out", str(home), "--task", task, "-n", "2",
         "--model", str(tiny_model), *image],
        capture_output=True, text=True, timeout=600, env=env, start_new_session=True, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runtime = "local" if task == "search" else "apptainer"
    assert f"sandbox runtime {runtime}" in proc.stdout.replace("\n", " ")
    summary = json.loads((home / "summary.json").read_text())
    assert summary["task"] == task and summary["jobs"] == 2 and summary["runtime"] == runtime
    results = [json.loads(line) for line in (home / "trajectories.jsonl").read_text().splitlines()]
    assert len(results) == 2
    for r in results:
        assert r["state"] == "done" and r["reward"] in (0.0, 1.0), r.get("error") or r["output"].get("failure")
        traj = r["output"]["trajectory"]
        assert 1 <= len(traj["calls"]) <= 2  # the quickstart's max_turns
        assert len(traj["sequence_ids"]) == len(traj["loss_mask"]) == len(traj["logprobs"])
        assert traj["violations"] == []  # token-exact: every prompt extends the previous prompt + output
        assert sum(traj["loss_mask"]) == sum(len(c["output_ids"]) for c in traj["calls"])


@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("apptainer") is None and shutil.which("bwrap") is None,
                    reason="neither Apptainer nor bubblewrap: the local runtime takes no image")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="a task domain run needs a model engine (torch)")
def test_an_image_name_is_found_where_the_users_own_configuration_finds_it(tmp_path: Path, tiny_model: Path) -> None:
    """An image name given to --image is looked up in the user's images.search_dirs (and cache), not in the
    embedded deployment's own empty cache: the job's sandbox start gets that folder's image."""
    images = tmp_path / "images"
    (images / "myimage" / "usr").mkdir(parents=True)  # a sandbox folder as images.search_dirs finds it (not a real root)
    config = tmp_path / "prorl.yaml"
    config.write_text(f"images: {{search_dirs: [{images}]}}\n")
    env = {**os.environ, "PRORL_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "--config", str(config), "quickstart", "--task", "math",
                        "--image", "myimage", "-n", "1", "--model", str(tiny_model), "--out", str(tmp_path / "qs")],
                       capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = (tmp_path / "qs" / "trajectories.jsonl").read_text().splitlines()
    error = json.loads(line).get("error") or {}
    # The folder was found (the start then fails on its empty root, or runs): never "not in the manifest".
    assert "is not in" not in str(error.get("message", "")), error
