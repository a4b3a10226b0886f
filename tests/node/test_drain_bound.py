"""The drain's bound in a Slurm job: the configured grace, at most what the job's end leaves after a margin.

A preemption (``preempt_send_user_signal``) sets the job's end to now + the partition's GraceTime; a drain past it
is stopped by Slurm mid-way. The time-limit warning's end is the time limit, which ``prorl launch``'s grace
(``signal_delay_s`` - 30 s) fits, so that drain keeps its grace.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from pathlib import Path

import pytest

from prorl_cli.exceptions import SlurmError
from prorl_cli.node.server import (
    DRAIN_MARGIN_S,
    DrainGrace,
    _slurm_drain_grace,
    drain_grace_within,
    drain_margin_s,
)
from prorl_cli.slurm.squeue import time_left_s


def test_outside_slurm_or_without_an_end_the_configured_grace_is_kept() -> None:
    bound = drain_grace_within(90.0, None)
    assert bound == DrainGrace(90.0, 90.0, None, 0.0) and not bound.by_job_end
    assert bound.describe() == "draining with a grace of 90 s (node.drain_grace_s)"
    assert "the default, node.drain_grace_s being unset" in drain_grace_within(90.0, None, configured=False).describe()


def test_the_time_limit_drain_launch_sets_up_keeps_its_grace() -> None:
    # --signal=USR2@120 and a grace of 120 - 30 s: the job's end leaves exactly that.
    bound = drain_grace_within(90.0, 120.0)
    assert (bound.grace_s, bound.margin_s, bound.by_job_end) == (90.0, DRAIN_MARGIN_S, False)
    assert bound.describe() == "draining with a grace of 90 s (node.drain_grace_s; the Slurm job ends in 120 s)"
    assert drain_grace_within(90.0, 3600.0).grace_s == 90.0  # long before the end (a scale-down's drain)


def test_a_preemptions_grace_time_bounds_the_drain() -> None:
    # `low` here: GraceTime 20 s. Half goes to the drain, half to stopping the rest and the requeue.
    bound = drain_grace_within(90.0, 20.0)
    assert (bound.grace_s, bound.margin_s, bound.by_job_end) == (10.0, 10.0, True)
    said = bound.describe()
    assert said.startswith("draining with a grace of 10 s, not the 90 s of node.drain_grace_s: the Slurm job ends "
                           "in 20 s (its time limit, or a preemption's GraceTime), 10 s of which are kept"), said
    # A GraceTime of 2 minutes: the full margin, the rest drains.
    assert drain_grace_within(90.0, 120.0 - 1).grace_s == pytest.approx(89.0)
    assert drain_grace_within(60.0, 61.0).grace_s == pytest.approx(31.0)


@pytest.mark.parametrize("left_s", [0.0, -5.0, 0.4])
def test_nothing_left_drains_for_no_time_at_all(left_s: float) -> None:
    # Signalled at (or past) its end: hand everything back at once rather than be stopped mid-drain.
    assert drain_grace_within(90.0, left_s).grace_s == pytest.approx(max(0.0, left_s / 2))
    assert drain_grace_within(0.0, 20.0).grace_s == 0.0  # a configured 0 stays 0


def test_the_margin_scales_down_below_twice_its_full_size() -> None:
    assert [drain_margin_s(s) for s in (0.0, 10.0, 20.0, 60.0, 61.0, 600.0)] == [0.0, 5.0, 10.0, 30.0, 30.0, 30.0]
    assert drain_margin_s(-3.0) == 0.0


def _fake_scontrol(folder: Path, script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``scontrol`` first on PATH that runs ``script`` (a controller down, a job it shows)."""
    folder.mkdir()
    fake = folder / "scontrol"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


def test_in_a_slurm_job_the_end_scontrol_shows_bounds_the_drain(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    end = datetime.datetime.fromtimestamp(time.time() + 20).strftime("%Y-%m-%dT%H:%M:%S")
    _fake_scontrol(tmp_path / "bin", f"echo 'JobId=77 JobState=RUNNING EndTime={end} Partition=low'", monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    bound = _slurm_drain_grace(90.0)
    assert bound.by_job_end and 8.0 <= bound.grace_s <= 10.0 and bound.configured_s == 90.0, bound
    monkeypatch.delenv("SLURM_JOB_ID")  # outside Slurm: scontrol is not asked
    assert _slurm_drain_grace(90.0) == DrainGrace(90.0, 90.0)


def test_a_failing_scontrol_keeps_the_configured_grace_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    _fake_scontrol(tmp_path / "bin", "echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1",
                   monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    with pytest.raises(SlurmError, match="scontrol show job 77 failed: slurm_load_jobs error"):
        time_left_s("77")
    with caplog.at_level(logging.WARNING, logger="prorl_cli.node.server"):
        bound = _slurm_drain_grace(60.0)
    assert bound == DrainGrace(60.0, 60.0) and not bound.by_job_end
    assert "could not read Slurm job 77's time left" in caplog.text and "the configured 60 s" in caplog.text, \
        caplog.text
