"""``prorl submit`` and ``prorl sample`` interrupted (Ctrl-C) and run again with the same ``--id-prefix``.

Child ``prorl`` processes against a real broker and node. The node serves ``gated``, a handler written here: a job
whose instance says ``hold`` waits while a gate file exists, every RUN appends its job id to a journal, and the
reward is the rollout's number K (``...-kK`` or ``...-K``) modulo 2, so every group of two is informative. The
second run must take the jobs that ended as they are, run the cancelled ones again, and end with a complete file.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Deployment, kill_if_running, one_node_deployment

HANDLER = '''
import asyncio
import re
from pathlib import Path

from prorl_cli.node.handler import AgentHandler


class GatedHandler(AgentHandler):
    """Journals each RUN, holds while the gate exists (instances with hold), rewards K % 2."""

    name = "gated"

    async def init(self, ctx):
        return None

    async def run(self, ctx):
        with open(Path(ctx.instance["journal"]), "a") as f:
            f.write(ctx.job_id + "\\n")
        gate = Path(ctx.instance["gate"])
        while ctx.instance.get("hold") and gate.exists():
            await asyncio.sleep(0.05)

    async def eval(self, ctx):
        k = int(re.search(r"-k?(\\d+)$", ctx.job_id).group(1))
        ctx.reward = float(k % 2)
'''


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    handlers = tmp_path_factory.mktemp("handlers")
    (handlers / "gated.py").write_text(HANDLER)
    yield from one_node_deployment(tmp_path_factory, "resume", node_args=("--handlers", str(handlers)))


def _tasks(folder: Path, holds: list[bool]) -> tuple[Path, Path, Path]:
    """A TASKS file of one row per entry of ``holds``; its gate (made, closed) and journal."""
    gate, journal = folder / "gate", folder / "runs.log"
    gate.touch()
    tasks = folder / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"hold": hold, "gate": str(gate), "journal": str(journal)}) + "\n"
                             for hold in holds))
    return tasks, gate, journal


def _interrupt(deployment: Deployment, cmd: list[str], prefix: str, ended: int) -> str:
    """Run ``cmd``, Ctrl-C it once ``ended`` jobs under ``prefix`` ended done and the rest run; its stderr."""
    proc = subprocess.Popen(cmd, env=deployment.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    client = deployment.client
    try:
        deployment.wait_for(lambda st: (states := sorted(client.list_jobs(prefix=prefix).values()))
                            and states.count("done") == ended and set(states) == {"done", "run"}, 60,
                            f"{ended} job(s) done and the held ones running")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 130, err
    return err


def _prorl(deployment: Deployment, *args: str | Path) -> list[str]:
    return [sys.executable, "-m", "prorl_cli", "-d", deployment.name, *map(str, args)]


def test_submit_again_under_its_prefix_takes_the_ended_jobs_and_runs_the_cancelled_ones_again(
        deployment: Deployment, tmp_path: Path) -> None:
    tasks, gate, journal = _tasks(tmp_path, [False, True])
    out = tmp_path / "out.jsonl"
    cmd = _prorl(deployment, "submit", tasks, "--task", "gated", "-n", "2", "--id-prefix", "sub1", "--out", out)
    err = _interrupt(deployment, cmd, "sub1-", 2)
    # The interrupt names the command that resumes the submission.
    assert "--id-prefix sub1" in err and "resumes" in err, err

    gate.unlink()
    again = subprocess.run(cmd, env=deployment.env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "2 of 4 job id(s) under --id-prefix sub1 already exist at the broker" in again.stderr, again.stderr
    assert "2 it held cancelled (an interrupted run) run again" in again.stderr, again.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["job_id"], r["state"]) for r in rows) == [
        ("sub1-0-0", "done"), ("sub1-0-1", "done"), ("sub1-1-0", "done"), ("sub1-1-1", "done")]
    # The jobs that had ended ran once; the cancelled ones twice (once cancelled, once to the end).
    runs = journal.read_text().split()
    assert sorted(runs) == ["sub1-0-0", "sub1-0-1", "sub1-1-0", "sub1-1-0", "sub1-1-1", "sub1-1-1"]
    # `prorl results --prefix` then collects one result per job, each done.
    collected = subprocess.run(_prorl(deployment, "results", "--prefix", "sub1", "--out", tmp_path / "r.jsonl"),
                               env=deployment.env(), capture_output=True, text=True, timeout=120)
    assert collected.returncode == 0, collected.stderr
    states = sorted((r := json.loads(line))["job_id"] + ":" + r["state"]
                    for line in (tmp_path / "r.jsonl").read_text().splitlines())
    assert states == ["sub1-0-0:done", "sub1-0-1:done", "sub1-1-0:done", "sub1-1-1:done"]


def test_sample_again_under_its_prefix_takes_the_ended_group_and_runs_the_cancelled_one_again(
        deployment: Deployment, tmp_path: Path) -> None:
    tasks, gate, journal = _tasks(tmp_path, [False, True])
    out = tmp_path / "groups.jsonl"
    cmd = _prorl(deployment, "sample", tasks, "--task", "gated", "--group-size", "2", "--target-groups", "2",
                 "--max-groups-per-step", "2", "--id-prefix", "smp1", "--out", out)
    err = _interrupt(deployment, cmd, "smp1-", 2)
    assert "--id-prefix smp1" in err and "resumes" in err, err

    gate.unlink()
    again = subprocess.run(cmd, env=deployment.env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    rows: list[dict[str, Any]] = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["group_id"], r["job_id"], r["state"]) for r in rows) == [
        ("smp1-s0-p0", "smp1-s0-p0-k0", "done"), ("smp1-s0-p0", "smp1-s0-p0-k1", "done"),
        ("smp1-s0-p1", "smp1-s0-p1-k0", "done"), ("smp1-s0-p1", "smp1-s0-p1-k1", "done")], again.stderr
    assert "2 informative group(s) of 2; 0 filtered, 0 job(s) cancelled" in again.stdout
    assert "--id-prefix smp1 resumes an earlier run: 2 job(s) of it taken as they are" in again.stderr, again.stderr
    assert "2 it cancelled run again" in again.stderr, again.stderr
    assert "already exist at the broker" not in again.stderr, again.stderr  # said once, as a resume, not a warning
    # The group that had ended ran once; the cancelled one again.
    runs = journal.read_text().split()
    assert sorted(runs) == ["smp1-s0-p0-k0", "smp1-s0-p0-k1", "smp1-s0-p1-k0", "smp1-s0-p1-k0",
                            "smp1-s0-p1-k1", "smp1-s0-p1-k1"]


@pytest.mark.parametrize("command", [["submit"], ["sample", "--group-size", "2", "--target-groups", "1"]])
def test_an_out_that_is_the_tasks_file_is_refused_and_the_rows_stay(deployment: Deployment, tmp_path: Path,
                                                                    command: list[str]) -> None:
    tasks, _, journal = _tasks(tmp_path, [False])
    rows = tasks.read_text()
    got = subprocess.run(_prorl(deployment, *command, tasks, "--task", "gated", "--out", tmp_path / "." / tasks.name),
                         env=deployment.env(), capture_output=True, text=True, timeout=120)
    assert got.returncode == 1, got.stderr
    assert "that is the TASKS file: the results would overwrite its rows" in got.stderr, got.stderr
    assert tasks.read_text() == rows and not journal.exists()
