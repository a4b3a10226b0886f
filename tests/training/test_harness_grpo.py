"""GRPO through the gateway in its short configuration: an unmodified OpenAI-SDK agent program in a
sandbox, a real deployment, token-exact samples, real weight updates reaching the bridge in place."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))


@pytest.mark.timeout(1500)  # capped warm-up, a bridge, 2 steps of one group of 4 rollouts, 2 evaluations of 4
def test_harness_grpo_short_configuration(tmp_path: Path) -> None:
    for module, extra in (("torch", "cpu"), ("openai", "http"), ("aiohttp", "http"), ("math_verify", "domains")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install 'prorl[{extra}]'; scripts/install.sh does it)")
    out = tmp_path / "run"
    argv = [sys.executable, str(REPO / "examples" / "train_harness_grpo.py"), "--out", str(out), "--short"]
    if not (IMAGES / "harness").is_dir() or not (shutil.which("apptainer") or shutil.which("bwrap")):
        # No sandbox image with the openai SDK here: the agent runs unisolated with this interpreter.
        argv += ["--sandbox-runtime", "local"]
    proc = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 2 and all(math.isfinite(x) for x in summary["losses"])
    assert all(d > 0 for d in summary["weight_deltas"]), summary["weight_deltas"]  # the update moved the weights
    # Step 1 was served by the warm-up's weights, step 2 by the same bridge after it loaded step 1's in place.
    assert summary["policy_versions_seen"] == [[0], [1]], summary["policy_versions_seen"]
    assert summary["backends_seen"] == [["tiny"], ["tiny"]], summary["backends_seen"]
    assert summary["bridge_versions"] == {"tiny": 2}, summary["bridge_versions"]
    # Token-exact: every call extended its conversation, none re-rendered, and the gateway's first
    # prompt of every rollout is the one the warm-up trained on.
    assert summary["continuity"] == 1.0 and summary["retokenized_calls"] == 0
    assert summary["warmup_prompt_match"] is True
    assert [s for s, _ in summary["curve"]] == [0, 2] and all(0 <= r <= 1 for _, r in summary["curve"])
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert rows and all(sum(r["response_mask"]) > 0 and len(r["input_ids"]) == len(r["old_log_probs"]) for r in rows)
    # Some rollout called the tool: its calls (tool call, then the answer; the agent takes at most 3 turns)
    # merged into one sample, the tool's results between them off the mask. The last step's samples are
    # exported: a sample there has one sampled span per call it merged.
    spans = [_spans(r["response_mask"]) for r in rows]
    assert sum(summary["merged_samples"]) > 0, summary["merged_samples"]
    assert all(1 <= n <= 3 for n in spans) and sum(n > 1 for n in spans) == summary["merged_samples"][-1], spans
    assert (out / "checkpoints" / "v2" / "config.json").is_file()


def _spans(mask: list[int]) -> int:
    """Runs of 1 in ``mask``: the model's turns merged into one sample."""
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
