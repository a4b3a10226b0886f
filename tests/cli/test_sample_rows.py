"""``prorl sample --skip-bad-rows`` names each prompt by its row in TASKS, as ``prorl submit`` names its jobs.

A real broker and node serve the built-in ``math`` task with no tokenizer configured, so every job fails at INIT
at once: enough to see which ids ``prorl sample`` submits (a step with ``--max-groups-per-step N`` submits exactly
N groups, one per prompt here, before it stops) and what a second run under the same ``--id-prefix`` makes of
the ended jobs once the bad row is mended.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.cli.sample import ROWS_PER_WALK, row_prompt_ids, row_seed_index
from tests.harness import Deployment, one_node_deployment

GOOD = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}, {"problem": "3+3?", "answer": "6"}]
BAD = {"problem": "4+4?"}  # no answer: --skip-bad-rows leaves it out
MENDED = {"problem": "4+4?", "answer": "8"}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from one_node_deployment(tmp_path_factory, "samplerows")


def _write(tasks: Path, rows: list[dict[str, str]]) -> None:
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _sample(deployment: Deployment, tasks: Path, prefix: str, groups: int,
            *extra: str) -> subprocess.CompletedProcess[str]:
    """``prorl sample`` over ``tasks`` that submits ``groups`` groups of 2 in step 0 (every job fails) and stops."""
    return subprocess.run(
        [sys.executable, "-m", "prorl_cli", "-d", deployment.name, "sample", str(tasks), "--task", "math",
         "--skip-bad-rows", "--group-size", "2", "--target-groups", "1", "--max-groups-per-step", str(groups),
         "--max-consecutive-failures", "0", "--id-prefix", prefix, *extra],
        env=deployment.env(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("seed", [(), ("--seed", "7")], ids=["no-seed", "seed"])
def test_prompt_ids_are_rows_in_the_file_and_a_resume_after_mending_a_row_takes_the_others_jobs(
        deployment: Deployment, tmp_path: Path, seed: tuple[str, ...]) -> None:
    # With a seed, each rollout's seed follows its row too: the others' jobs hold the same work after the mend.
    prefix = f"rows{len(seed)}"
    tasks = tmp_path / "math.jsonl"
    _write(tasks, [GOOD[0], BAD, GOOD[1], GOOD[2]])
    first = _sample(deployment, tasks, prefix, 3, *seed)
    assert first.returncode == 1 and "skipped 1 bad row(s) of 4" in first.stderr, first.stderr
    assert "3 groups tried, all finished" in first.stderr, first.stderr
    # pP is the row in the file (row 1 left out), as `prorl submit` numbers the same rows.
    held = deployment.client.list_jobs(prefix=f"{prefix}-")
    assert sorted(held) == [f"{prefix}-s0-p{row}-k{k}" for row in (0, 2, 3) for k in (0, 1)], held

    # Row 1 mended, the same prefix: rows 0, 2 and 3 get their own ended jobs back; row 1 runs anew.
    _write(tasks, [GOOD[0], MENDED, GOOD[1], GOOD[2]])
    again = _sample(deployment, tasks, prefix, 4, *seed)
    assert "holds other work" not in again.stderr, again.stderr
    assert again.returncode == 1 and "4 groups tried, all finished" in again.stderr, again.stderr
    assert f"--id-prefix {prefix} resumes an earlier run" in again.stderr, again.stderr
    held = deployment.client.list_jobs(prefix=f"{prefix}-")
    assert sorted(held) == [f"{prefix}-s0-p{row}-k{k}" for row in range(4) for k in (0, 1)], held


def test_a_step_that_walks_the_file_again_marks_the_walk_in_the_id() -> None:
    # A step wrapping around the prompts submits a row again: its id must differ from the first walk's.
    prompt_id, seed_index = row_prompt_ids([0, 2, 3]), row_seed_index([0, 2, 3])
    assert [prompt_id(pos, None) for pos in range(7)] == ["0", "2", "3", "0e1", "2e1", "3e1", "0e2"]
    # Seeds follow the same rows, on a footing the file's length does not move.
    assert [seed_index(pos, None) for pos in range(4)] == [0, 2, 3, ROWS_PER_WALK]
