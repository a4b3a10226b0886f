"""The tiny GRPO example in its short configuration: a real deployment, real weight updates, real exports."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)  # capped warm-up + 3 bridge starts + 2 steps: about 2 minutes on 2 idle cores
def test_tiny_grpo_short_configuration(tmp_path: Path) -> None:
    for module, extra in (("torch", "cpu"), ("pyarrow", "parquet")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install 'prorl[{extra}]'; scripts/install.sh does it)")
    import pyarrow.parquet as pq

    from prorl_cli.training.export import arrow_schema

    out = tmp_path / "run"
    # A relative --out, as the README writes it: the bridge (started in the stack's own folder) must still find
    # the checkpoints under it.
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_tiny_grpo.py"), "--out", "run", "--short"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 2 and all(math.isfinite(x) for x in summary["losses"])
    assert all(d > 0 for d in summary["weight_deltas"]), summary["weight_deltas"]  # the update moved the weights
    # Step 1 was served by the initial checkpoint, step 2 by the same bridge after it loaded the updated one in place.
    assert summary["backends_seen"] == [["tiny"], ["tiny"]], summary["backends_seen"]
    assert summary["policy_versions_seen"] == [[0], [1]], summary["policy_versions_seen"]
    table = pq.read_table(out / "samples.parquet")
    assert table.schema.equals(arrow_schema(), check_metadata=False) and table.num_rows > 0
    for row in table.to_pylist():
        n = len(row["input_ids"])
        assert all(len(row[k]) == n for k in ("response_mask", "old_log_probs", "advantages", "loss_weights"))
        assert sum(row["response_mask"]) > 0
    assert [s for s, _ in json.loads((out / "curve.json").read_text())] == [0, 2]
    # Held-out tool use is measured at every evaluation (the decision the example's RL moves).
    assert [s for s, _ in summary["tool_use"]] == [0, 2] and all(0 <= u <= 1 for _, u in summary["tool_use"])
    assert 0 < summary["warmup_p_tool"] < 1  # the warm-up taught both ways: answer at once or call the tool
    assert (out / "samples.jsonl").read_text().count("\n") == table.num_rows


def test_the_warmup_cache_hands_back_the_warmed_up_weights(tmp_path: Path) -> None:
    """Both examples share warm-ups through ``--warmup-cache``: a second run of the same seed loads, not trains."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install 'prorl[cpu]'; scripts/install.sh does it)")
    import random

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "examples"))
    import train_tiny_grpo as tiny

    from prorl_cli.agent import ChatTokens
    from prorl_cli.handlers.math_agent import CALCULATOR_SCHEMA
    from prorl_cli.inference.tiny_model import make_tiny_model

    cfg = tiny.RunConfig(out=tmp_path, seed=3, warmup_steps=2, warmup_batch=2, warmup_cache=tmp_path / "cache")
    init_dir = make_tiny_model(tmp_path / "init", seed=cfg.seed)
    chat = ChatTokens.from_pretrained(init_dir, tools=[CALCULATOR_SCHEMA])
    train = tiny.problems(random.Random(cfg.seed))[cfg.n_eval:]

    def fresh() -> Any:
        return AutoModelForCausalLM.from_pretrained(str(init_dir), dtype=torch.float32)

    trained, steps, _, _ = tiny.warm_up_cached(fresh(), chat, train, cfg, random.Random(0))
    loaded, steps_again, _, _ = tiny.warm_up_cached(fresh(), chat, train, cfg, random.Random(0))
    assert steps == steps_again == 2
    initial = fresh().state_dict()
    for name, tensor in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name  # bit for bit the warm-up's weights
    assert any(not torch.equal(initial[n], t) for n, t in trained.state_dict().items())  # and not the initial ones
    # Other warm-up settings are another entry: nothing is loaded for them.
    assert tiny.warmup_cache_key(cfg) != tiny.warmup_cache_key(tiny.RunConfig(out=tmp_path, seed=3, warmup_steps=3))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [tiny.warmup_cache_key(cfg)]
