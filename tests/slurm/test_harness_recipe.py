"""The harness-GRPO recipe (examples/recipes/harness_grpo_slurm) on the test Slurm, as its README says.

The recipe folder is copied as a user copies it to a shared filesystem, its
small-size override merged into deploy.yaml the README's way, and then: the
warm-up checkpoint (``--warmup-only``), ``prorl launch`` (broker, 2 node tasks
with Apptainer and the harness test image, 2 bridges on ``run/checkpoints/v0``),
``sbatch train.sbatch`` (the trainer as its own Slurm job, 2 GRPO steps of
harness rollouts running the calculator agent), and ``prorl down``.

Between the steps one bridge is requeued with ``scontrol requeue`` (the calls
in flight drained first by a pause, as a preemption's drain would): it comes
back on v0 and must load the current checkpoint before it serves. Asserted:
the broker sent it the current weights when it rejoined, it serves the
current version, both bridges report version 2 at the end, the trajectories
of step 1 and step 2 carry versions [0] and [1], rewards and token ids are
in the training samples, and nothing is left in squeue after ``down``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from prorl_cli.client import RolloutClient
from prorl_cli.config import load_config
from prorl_cli.slurm import squeue
from prorl_cli.slurm.record import LaunchRecord
from prorl_cli.testing.harness import merge_config
from tests.harness import REPO
from tests.slurm.cluster import logs_of, require_slurm, scontrol, wait_until

RECIPE = REPO / "examples" / "recipes" / "harness_grpo_slurm"
TRAINER = REPO / "examples" / "train_harness_grpo.py"
TEST_IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))
NAME = "hgrpo"  # the recipe's deployment name, unchanged



def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)


def _bridges(client: RolloutClient) -> dict[str, Any]:
    return {b.backend_id: b for b in client.list_backends() if b.kind == "bridge" and b.alive}


#: What the small-size override may change: sizes, the model path, the engine (README.md, "A small try").
OVERRIDABLE = {"count", "n_init", "n_run", "n_eval", "time", "cpus_per_task", "mem_gb", "model", "engine",
               "max_model_len"}


def test_the_recipe_files_load_and_the_override_changes_only_sizes_model_and_engine(tmp_path: Path) -> None:
    """No Slurm needed: deploy.yaml (with and without the override) and prorl.yaml load; the override stays small."""
    from prorl_cli.slurm.deploy import load_deploy

    override = yaml.safe_load((RECIPE / "ci-override.yaml").read_text())
    changed = {key for section in override.values() for key in section}
    assert changed <= OVERRIDABLE, f"the override changes more than sizes, model and engine: {changed - OVERRIDABLE}"
    full = load_deploy(RECIPE / "deploy.yaml")
    assert (full.inference.engine, full.nodes.sandbox_runtime) == ("vllm", "apptainer")
    assert full.inference.model == str(RECIPE / "run" / "checkpoints" / "v0")
    shutil.copy(RECIPE / "prorl.yaml", tmp_path / "prorl.yaml")
    small = merge_config(yaml.safe_load((RECIPE / "deploy.yaml").read_text()), override)
    (tmp_path / "deploy-small.yaml").write_text(yaml.safe_dump(small, sort_keys=False))
    assert load_deploy(tmp_path / "deploy-small.yaml").inference.count == 2
    config = load_config(RECIPE / "prorl.yaml")
    assert config.handlers["harness"]["scorer"] == "math" and config.handlers["harness"]["image"] == "harness"
    assert "train_harness_grpo.py" in (RECIPE / "train.sbatch").read_text()


@pytest.mark.slow
@pytest.mark.apptainer
@pytest.mark.timeout(1500)
def test_the_recipe_trains_and_a_requeued_bridge_rejoins_on_the_current_weights(tmp_path: Path) -> None:
    require_slurm()
    for module, extra in (("torch", "train"), ("math_verify", "domains")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install 'prorl[{extra}]'; scripts/install.sh does it)")
    if shutil.which("apptainer") is None or not (TEST_IMAGES / "harness").is_dir():
        pytest.skip("needs apptainer and the harness test image (scripts/provision/47-harness-image.sh)")
    work = shutil.copytree(RECIPE, tmp_path / "recipe")  # the user's copy on a shared filesystem
    home = tmp_path / "home"
    env = {**os.environ, "PRORL_HOME": str(home), "PRORL_REPO": str(REPO), "PYTHON": sys.executable,
           "TRAIN_ARGS": "--short --steps 2", "COLUMNS": "200"}
    env.pop("PRORL_DEPLOYMENT", None)
    env.pop("PRORL_CONFIG", None)

    # 1. The warm-up checkpoint the bridges start on. Its cache is the session's (any other test warming up
    #    --short seed 0 shares it) or PRORL_WARMUP_CACHE (repeated local runs).
    cache = os.environ.get("PRORL_WARMUP_CACHE") or str(tmp_path.parent / "harness-warmup-cache")
    warm = _run([sys.executable, str(TRAINER), "--short", "--warmup-only", "--out", "run", "--device", "cpu",
                 "--warmup-cache", cache], env, work, 900)
    assert warm.returncode == 0 and (work / "run" / "checkpoints" / "v0" / "config.json").is_file(), warm.stderr[-3000:]

    # 2. The small sizes: the README's merge of the override into deploy.yaml.
    small = merge_config(yaml.safe_load((work / "deploy.yaml").read_text()),
                         yaml.safe_load((work / "ci-override.yaml").read_text()))
    (work / "deploy-small.yaml").write_text(yaml.safe_dump(small, sort_keys=False))

    prorl = [sys.executable, "-m", "prorl_cli"]
    up = _run([*prorl, "launch", "deploy-small.yaml", "--wait-s", "400"], env, work, 500)
    record: LaunchRecord | None = None
    trainer_job = ""
    client = RolloutClient(NAME, config=load_config(overrides={"home": str(home), "deployment": NAME}))
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        record = LaunchRecord.load(home / NAME)
        assert record is not None
        assert set(_bridges(client)) == {"inference-0", "inference-1"}

        # 3. The trainer: its own Slurm job, smaller than the recipe's request.
        sub = _run(["sbatch", "--parsable", "--cpus-per-task=1", "--mem=3G", "--time=30", "train.sbatch"],
                   env, work, 60)
        assert sub.returncode == 0, sub.stderr
        trainer_job = sub.stdout.strip().split(";")[0]
        train_log = work / "run" / f"train-{trainer_job}.out"

        def trainer_says(text: str) -> bool:
            if not squeue.active([trainer_job]) and text not in _read(train_log):
                raise AssertionError(f"the trainer job ended before '{text}':\n{_read(train_log)[-4000:]}")
            return text in _read(train_log)

        wait_until(lambda: trainer_says("step 1:"), 900, "the trainer's first step", interval_s=1.0)

        # 4. Between the steps: drain (as a preemption's drain does), requeue inference-1, resume.
        bridge_job = next(m.job_id for m in record.members if m.peer_id == "inference-1")
        client.pause_generation(wait=True, timeout_s=300)
        scontrol("requeue", bridge_job)
        wait_until(lambda: "inference-1" not in _bridges(client), 120, "inference-1 to leave")
        client.resume_generation()

        def back() -> bool:
            b = _bridges(client).get("inference-1")
            if b is not None and b.loading:
                assert b.served == 0 and b.inflight == 0, "a call reached a bridge still loading the current weights"
            return b is not None and not b.loading and (b.policy_version or 0) >= 1

        wait_until(back, 300, "the requeued inference-1 to rejoin on the current weights", interval_s=0.2)
        broker_log = logs_of(home / NAME / "slurm" / "broker")
        checkpoints = work / "run" / "checkpoints"
        assert any(f"backend inference-1 joined on its start weights: it loads {checkpoints / f'v{v}'} "
                   f"(policy version {v}) before it serves" in broker_log for v in (1, 2)), broker_log[-3000:]

        # 5. Two steps trained; both bridges end on version 2.
        wait_until(lambda: not squeue.active([trainer_job]), 900, "the trainer job to end", interval_s=1.0)
        summary = json.loads((work / "run" / "summary.json").read_text())
        assert summary["policy_versions_seen"] == [[0], [1]], summary
        assert len(summary["losses"]) == 2 and all(math.isfinite(x) for x in summary["losses"]), summary
        rows = [json.loads(line) for line in (work / "run" / "samples.jsonl").read_text().splitlines()]
        assert rows and all(r["input_ids"] and isinstance(r["reward"], float) for r in rows)
        assert (checkpoints / "v2" / "config.json").is_file()
        wait_until(lambda: {k: b.policy_version for k, b in _bridges(client).items()}
                   == {"inference-0": 2, "inference-1": 2}, 300, "both bridges on policy version 2")
    finally:
        client.close()
        if trainer_job:
            squeue.cancel([trainer_job])
        down = _run([*prorl, "down", NAME], env, work, 300)
        left = [t.job_id for t in squeue.active([*(record.job_ids if record else []), *filter(None, [trainer_job])])]
        squeue.cancel(left)  # a failed test leaves nothing behind either
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-2000:]
    assert not left, f"left in squeue after down: {left}"


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
