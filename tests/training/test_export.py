"""Exports round-trip through pyarrow with the documented schema."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.training.export import (
    COLUMNS,
    arrow_schema,
    read_samples_jsonl,
    sample_row,
    write_samples_jsonl,
    write_samples_parquet,
)
from prorl_cli.training.samples import (
    SampleError,
    assign_advantages,
    assign_loss_weights,
    build_samples,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def samples() -> list:
    out = []
    for i, reward in enumerate([1.0, 0.0, 0.0]):
        traj = Trajectory(calls=[
            ModelCall([1, 2, 3], [10 + i, 11], [-0.25, -0.5], "stop", policy_version=4),
            ModelCall([1, 2, 3, 10 + i, 11, 20], [12], [-1.0], "stop", policy_version=5),
        ])
        ss, _ = build_samples(traj, rollout_id=f"r{i}", group_id="g", reward=reward)
        out += ss
    assign_advantages(out)
    assign_loss_weights(out)
    return out


def test_parquet_round_trip_with_the_documented_schema(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install 'prorl[parquet]')")
    ss = samples()
    path = write_samples_parquet(tmp_path / "s.parquet", ss)
    table = pq.read_table(path)
    assert table.schema.equals(arrow_schema(), check_metadata=False)
    rows = table.to_pylist()
    assert len(rows) == 3
    r = rows[0]
    assert r["input_ids"] == [1, 2, 3, 10, 11, 20, 12]
    assert r["response_mask"] == r["loss_mask"] == r["token_mask"] == [0, 0, 0, 1, 1, 0, 1]
    assert r["attention_mask"] == [1] * 7 and r["input_lengths"] == 7 and r["prompt_length"] == 3
    assert r["old_log_probs"] == r["prev_logprobs"] == r["generation_logprobs"] == [0, 0, 0, -0.25, -0.5, 0, -1.0]
    assert r["advantages"] == pytest.approx([0, 0, 0, 2 / 3, 2 / 3, 0, 2 / 3])  # reward 1 vs mean 1/3
    assert r["token_level_scores"] == [0, 0, 0, 0, 0, 0, 1.0]
    assert r["policy_versions"] == [-1, -1, -1, 4, 4, -1, 5]
    assert (r["rollout_id"], r["group_id"], r["reward"]) == ("r0", "g", 1.0)
    assert math.isclose(sum(sum(x["loss_weights"]) for x in rows), 1.0, rel_tol=1e-6)
    assert [c for c in table.column_names] == list(COLUMNS)


def test_jsonl_round_trip(tmp_path: Path) -> None:
    ss = samples()
    rows = read_samples_jsonl(write_samples_jsonl(tmp_path / "s.jsonl", ss))
    assert rows == [sample_row(s) for s in ss]
    assert set(rows[0]) == set(COLUMNS)


@pytest.mark.parametrize("writer", [write_samples_jsonl, write_samples_parquet])
def test_arguments_given_in_the_wrong_order_are_refused_saying_the_order(tmp_path: Path, writer: Any) -> None:
    out = tmp_path / "s.out"
    with pytest.raises(TypeError, match=re.escape("the writers take (path, samples)")):
        writer(samples(), str(out))
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_failed_jsonl_export_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = write_samples_jsonl(tmp_path / "s.jsonl", samples())
    before = path.read_text()

    def broken():  # the samples' source fails part way through
        yield from samples()[:1]
        raise RuntimeError("the trainer's iterator broke")

    with pytest.raises(RuntimeError, match="iterator broke"):
        write_samples_jsonl(path, broken())
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]


def test_docs_list_every_export_column() -> None:
    documented = set(re.findall(r"^\| `(\w+)` \|", DOC.read_text(), re.M))
    assert set(COLUMNS) <= documented, sorted(set(COLUMNS) - documented)


@pytest.mark.parametrize("writer", ["jsonl", "parquet"])
def test_a_sample_whose_lists_do_not_line_up_is_refused_naming_its_rollout(tmp_path: Path, writer: str) -> None:
    if writer == "parquet":
        pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install 'prorl[parquet]')")
    ss = samples()
    ss[1].policy_versions = ss[1].policy_versions[:-1]  # one version short: every column after it would shift
    write = write_samples_jsonl if writer == "jsonl" else write_samples_parquet
    with pytest.raises(SampleError, match=r"rollout 'r1' has 6 policy_versions for 7 input_ids"):
        write(tmp_path / f"s.{writer}", ss)
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_reading_back_a_bad_jsonl_export_names_the_file_and_line(tmp_path: Path) -> None:
    path = write_samples_jsonl(tmp_path / "s.jsonl", samples())
    whole = path.read_text().splitlines(keepends=True)
    path.write_text(whole[0] + "{not json\n" + whole[2])
    with pytest.raises(SampleError, match=r"s\.jsonl:2: not valid JSON"):
        read_samples_jsonl(path)
    path.write_text(whole[0] + whole[1][:30])  # a copy stopped part way
    with pytest.raises(SampleError, match=r"s\.jsonl:2: the last line is cut off .*the 1 line\(s\) before it are whole"):
        read_samples_jsonl(path)


_WRITE_ON_A_FULL_DISK = """
import resource, signal, sys
from prorl_cli.training.export import write_samples_parquet
from tests.training.test_export import samples

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
write_samples_parquet(sys.argv[1], samples() * 50)
"""


def test_a_failed_parquet_export_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install 'prorl[parquet]')")
    path = write_samples_parquet(tmp_path / "s.parquet", samples())
    before = path.read_bytes()
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _WRITE_ON_A_FULL_DISK, str(path)], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "File too large" in out.stderr, out.stderr[-2000:]
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.parquet"]


@pytest.mark.parametrize("writer", ["jsonl", "parquet"])
def test_a_sample_without_loss_weights_is_refused_not_exported_as_zeros(tmp_path: Path, writer: str) -> None:
    """build_samples alone leaves loss_weights empty; an all-zero column would train on nothing without a word."""
    if writer == "parquet":
        pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install 'prorl[parquet]')")
    ss = samples()
    traj = Trajectory(calls=[ModelCall([1, 2], [3], [-0.5], "stop")])
    unweighted, _ = build_samples(traj, rollout_id="r9", group_id="g", reward=1.0)
    write = write_samples_jsonl if writer == "jsonl" else write_samples_parquet
    with pytest.raises(SampleError, match=r"rollout 'r9' has no loss_weights: call assign_loss_weights"):
        write(tmp_path / f"s.{writer}", ss + unweighted)
    assert list(tmp_path.iterdir()) == [], "nothing written"


@pytest.mark.parametrize("writer", ["jsonl", "parquet"])
@pytest.mark.parametrize("bad", [-math.inf, math.nan])
def test_a_non_finite_log_prob_is_refused_naming_its_rollout_in_both_formats(
    tmp_path: Path, writer: str, bad: float,
) -> None:
    """JSONL used to fail with a bare 'Out of range float values' and Parquet to store the value silently."""
    if writer == "parquet":
        pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install 'prorl[parquet]')")
    ss = samples()
    ss[2].old_log_probs[4] = bad  # a sampled token's log-prob
    write = write_samples_jsonl if writer == "jsonl" else write_samples_parquet
    with pytest.raises(SampleError, match=rf"rollout 'r2': old_log_probs\[4\] is {bad!r}, not a finite number"):
        write(tmp_path / f"s.{writer}", ss)
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_a_non_finite_loss_weight_or_advantage_is_refused_naming_its_rollout(tmp_path: Path) -> None:
    ss = samples()
    ss[0].loss_weights[3] = math.inf
    with pytest.raises(SampleError, match=r"rollout 'r0': loss_weights\[3\] is inf"):
        sample_row(ss[0])
    ss[1].advantage = math.nan
    with pytest.raises(SampleError, match=r"rollout 'r1': advantage is nan"):
        sample_row(ss[1])
