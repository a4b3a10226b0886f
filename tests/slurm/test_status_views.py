"""What ``prorl status`` says of a launched deployment that is not whole: taken down, its broker ``here`` gone,
tasks ended that nothing replaces. Each launch is written as ``prorl launch`` writes it, around real Slurm jobs
held pending, so no role has to start."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.slurm import squeue
from prorl_cli.slurm.record import LaunchRecord, Member, archive_launch
from tests.slurm.cluster import prorl, require_slurm, write_yaml

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def held() -> Iterator[list[str]]:
    """Submit jobs held pending for an hour (``submit()``), each cancelled at the end: stand-ins for role tasks."""
    require_slurm()
    jobs: list[str] = []
    yield jobs
    squeue.cancel(jobs)


def _hold(jobs: list[str]) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-t", "5", "--begin", "now+1hour", "-o", "/dev/null",
                          "--wrap", "true"], capture_output=True, text=True, check=True).stdout
    jobs.append(out.strip().split(";")[0])
    return jobs[-1]


def test_status_of_a_deployment_taken_down_says_so_and_when(tmp_path: Path) -> None:
    """The words scale, down and logs use, not "no rendezvous file; is the broker running?"."""
    home, name = tmp_path / "home", "gonedown"
    deploy = write_yaml(tmp_path / "deploy.yaml", {"deployment": name, "home": str(home)})
    LaunchRecord(name, str(deploy), str(home), 0.0, launch_id="20250101T120000Z-abc123",
                 members=[Member("nodes", 0, "41_0")]).save(home / name)
    archive_launch(home / name)  # what `down` does once squeue is empty
    out = prorl(home, "status", name, timeout_s=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no rendezvous file" not in out.stderr, out.stderr
    said = f"deployment '{name}' is not launched now: its last launch (20250101T120000Z-abc123) was taken down"
    assert said in out.stderr and "(ended 20" in out.stderr, out.stderr
    assert f"`prorl launch {deploy}` starts it again" in out.stderr, out.stderr
    scale = prorl(home, "scale", name, "--nodes", "2", timeout_s=60)
    assert scale.returncode == 1 and said in scale.stderr, "status and scale say the same"
    # down again (a cleanup script's second run): nothing to do, said so, exit 0, by name or by its deploy.yaml.
    for target in (name, str(deploy)):
        again = prorl(home, "down", target, timeout_s=60)
        assert again.returncode == 0 and f"nothing to take down: {said}" in again.stdout, again.stdout + again.stderr
    # --json: gone (exit 1), the reason on stderr.
    out = prorl(home, "status", name, "--json", timeout_s=60)
    assert out.returncode == 1 and '"broker": "gone"' in out.stdout and said in out.stderr, out.stdout + out.stderr


def test_status_says_a_local_broker_that_is_gone_is_not_running_and_how_to_recover(tmp_path: Path,
                                                                                    held: list[str]) -> None:
    import socket

    home, name = tmp_path / "home", "deadhere"
    deploy = write_yaml(tmp_path / "deploy.yaml", {"deployment": name, "home": str(home),
                                                   "broker": {"where": "here"}})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid: a broker process that is no longer there
    LaunchRecord(name, str(deploy), str(home), 0.0, broker_where="here", broker_pid=dead.pid,
                 broker_host=socket.gethostname(), launch_id="L1",
                 members=[Member("nodes", 0, _hold(held))]).save(home / name)
    out = prorl(home, "status", "-d", name, timeout_s=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"the local broker (pid {dead.pid}, broker.where: here) is not running" in out.stderr, out.stderr
    assert f"down -d {name}" in out.stderr and f"launch {deploy} -d {name}" in out.stderr, out.stderr
    row = next(line for line in out.stdout.splitlines() if "broker" in line and f"pid {dead.pid}" in line)
    assert "not running" in row, out.stdout
    out = prorl(home, "status", "-d", name, "--json", timeout_s=60)
    assert out.returncode == 1 and '"broker": "ended"' in out.stdout and "is not running" in out.stdout, out.stdout


def test_status_says_tasks_left_alone_are_not_replaced_and_how_to_restore_the_count(tmp_path: Path,
                                                                                   held: list[str]) -> None:
    from prorl_cli.slurm.supervisor import NameState, Supervision

    home, name = tmp_path / "home", "leftalone"
    deploy = write_yaml(tmp_path / "deploy.yaml", {"deployment": name, "home": str(home), "nodes": {"count": 3}})
    broker, cancelled, serving = _hold(held), _hold(held), _hold(held)
    aged_out = str(int(serving) + 100000)  # an id squeue does not list, as one that aged out (MinJobAge)
    squeue.cancel([cancelled])  # a scancel by hand: CANCELLED in squeue until it ages out
    LaunchRecord(name, str(deploy), str(home), 0.0, launch_id="L2", members=[
        Member("broker", 0, broker), Member("nodes", 0, aged_out), Member("nodes", 1, cancelled),
        Member("nodes", 2, serving)]).save(home / name)
    # What the supervisor keeps once it read the aged-out task's log and found the scancel there.
    Supervision({"node-0": NameState(left_alone=aged_out)}, "L2").save(home / name)
    out = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", str(home), "status", "-d", name],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "300"})
    assert out.returncode == 0, out.stdout + out.stderr  # the broker's job is queued: restarting, not gone
    assert "gone (aged out of squeue)" in out.stdout, out.stdout
    (hint,) = [line for line in out.stdout.splitlines() if "will not be replaced" in line]
    assert f"node-0 (Slurm job {aged_out}, gone from squeue)" in hint, hint
    assert f"node-1 (Slurm job {cancelled}, CANCELLED)" in hint, hint
    assert "node-2" not in hint, "a queued task is no part of it"
    assert f"scale -d {name} --nodes 3` restores the count" in hint, hint
