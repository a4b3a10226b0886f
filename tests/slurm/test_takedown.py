"""What a take-down, a cancelled drain, a killed broker and odd paths leave behind, on the real Slurm:
`down` cancels again a task that requeued itself after its scancel, a task cancelled while it drains on
SIGUSR2 does not requeue itself, the supervisor does not outlive a broker killed with SIGKILL, and rendered
scripts run from folders whose names have spaces, and a local broker is stopped (only it, and for good)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prorl_cli.rendezvous import rendezvous_path
from prorl_cli.slurm import launcher, squeue
from prorl_cli.slurm.deploy import deploy_from_dict, load_deploy
from prorl_cli.slurm.launcher import down
from prorl_cli.slurm.options import executor
from prorl_cli.slurm.record import LaunchRecord, Member, new_launch_id
from prorl_cli.slurm.render import render_all
from tests.slurm.cluster import ROLE_CONFIG, require_slurm, wait_until, write_yaml

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """sbatch exports this environment to the job (--export=ALL): the job imports this tree."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _sbatch(*args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, check=True, env=_env())
    return out.stdout.strip().split(";")[0]


def test_down_cancels_again_a_task_that_requeued_itself_after_the_scancel(tmp_path: Path, jobs: list[str]) -> None:
    # A node draining on SIGUSR2 requeues itself once it is out; a scancel that came meanwhile does not stop
    # Slurm from requeueing (even a cancelled job): the task would come back PENDING and start again later.
    ready = tmp_path / "ready"
    job = _sbatch("--requeue", "-t", "5", "-c", "1", "--mem=128M", "-o", str(tmp_path / "job.out"), "--wrap",
                  f"trap 'scontrol requeue $SLURM_JOB_ID; exit 0' TERM; touch {ready}; sleep 300 & wait")
    jobs.append(job)
    cfg = deploy_from_dict({"deployment": "td", "home": str(tmp_path / "home")})
    LaunchRecord(deployment="td", deploy_file=str(tmp_path / "deploy.yaml"), home=str(cfg.home_path),
                 created_at=time.time(), launch_id=new_launch_id(), members=[Member("nodes", 0, job)],
                 ).save(cfg.deployment_dir)
    wait_until(ready.exists, 60, "the job to run and set its trap")
    report = down(cfg, wait_s=30)
    assert report.cancelled == [job]
    assert report.left == [], f"still in squeue after down: {report.left}"
    assert squeue.active([job]) == []


def test_a_task_cancelled_while_it_drains_is_not_requeued(tmp_path: Path, jobs: list[str]) -> None:
    script = tmp_path / "role.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from pathlib import Path
        from prorl_cli.slurm.roles import slurm_lifecycle

        d = Path({str(tmp_path)!r})
        with slurm_lifecycle(requeue=True) as signals:
            (d / "ready").touch()
            signals.leave.wait()  # SIGUSR2: the drain begins
            (d / "draining").touch()
            while not (d / "go").exists():  # the drain's grace
                time.sleep(0.1)
        print("out of the lifecycle", flush=True)
    """))
    out = tmp_path / "job.out"
    job = _sbatch("--requeue", "-t", "5", "-c", "1", "--mem=256M", "-o", str(out), "--wrap",
                  f"exec {sys.executable} {script}")
    jobs.append(job)
    wait_until((tmp_path / "ready").exists, 60, "the role to run")
    subprocess.run(["scancel", "--batch", "--signal=USR2", job], check=True)
    wait_until((tmp_path / "draining").exists, 30, "the drain to begin")
    subprocess.run(["scancel", job], check=True)  # `prorl down` or a user, while it drains
    (tmp_path / "go").touch()
    wait_until(lambda: "out of the lifecycle" in out.read_text(), 30, "the role to finish")
    detail = squeue.job_detail(job)  # the role has done with Slurm: requeued or not, it is decided
    assert detail.get("Restarts") == "0" and detail.get("JobState") in ("COMPLETING", "CANCELLED"), (
        f"the cancelled task requeued itself: JobState={detail.get('JobState')} Restarts={detail.get('Restarts')}")


def test_the_supervisor_stops_when_its_broker_is_killed(tmp_path: Path) -> None:
    # The broker's job runs the supervisor in its own session; a broker killed outright cannot stop it.
    deployment_dir = tmp_path / "home" / "sv"
    deployment_dir.mkdir(parents=True)
    (deployment_dir / "launch.json").write_text("{}")
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, threading
            from pathlib import Path
            from prorl_cli.slurm.roles import _start_supervisor
            child = _start_supervisor(Path({str(deployment_dir)!r}))
            print(child.pid, flush=True)
            threading.Event().wait()
        """)],
        stdout=subprocess.PIPE, text=True, env={**_env(), "SLURM_JOB_ID": "999999"},
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    fd = os.pidfd_open(child)
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        gone, _, _ = select.select([fd], [], [], 30)
        if not gone:
            os.kill(child, signal.SIGKILL)
        assert gone, "the supervisor outlived its broker"
    finally:
        os.close(fd)


def test_rendered_scripts_run_from_folders_with_spaces(tmp_path: Path, jobs: list[str]) -> None:
    base = tmp_path / "a folder"
    base.mkdir()
    config = write_yaml(base / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": "sp", "home": str(base / "prorl home"), "config": str(config),
        "log_dir": str(base / "slurm logs"), "broker": {"bind_host": "127.0.0.1", "time": "5", "signal_delay_s": 30},
        "nodes": {"count": 1, "cpus_per_task": 1, "mem_gb": 0.5},
    })
    cfg = load_deploy(deploy)
    render_all(cfg, base / "scripts out")
    job = _sbatch(str(base / "scripts out" / "broker.sbatch"))  # sbatch splits an unquoted directive at the space
    jobs.append(job)
    # PRORL_HOME reached the broker: it writes its rendezvous file under the home with a space.
    wait_until(rendezvous_path(cfg.deployment_dir).exists, 120, "the broker's rendezvous file")
    assert (base / "slurm logs" / f"prorl-sp-broker-{job}.out").is_file()


def test_down_kills_a_local_broker_that_ignores_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_slurm()
    monkeypatch.setattr(launcher, "LOCAL_BROKER_STOP_S", 2.0)
    pid_file = tmp_path / "pid"
    # In its own session and not our child (as `broker.where: here` starts it), deaf to SIGTERM; its command
    # line names `prorl_cli ... serve broker` as the real one does.
    sleeper = f"{sys.executable} -c 'import time; time.sleep(600)' prorl_cli serve broker"
    subprocess.run(["setsid", "-f", "sh", "-c", f"trap '' TERM; echo $$ > {pid_file}; exec {sleeper}"], check=True)
    pid = int(wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "the broker's pid"))
    fd = os.pidfd_open(pid)
    try:
        cfg = deploy_from_dict({"deployment": "here", "home": str(tmp_path / "home"), "broker": {"where": "here"}})
        LaunchRecord(deployment="here", deploy_file=str(tmp_path / "deploy.yaml"), home=str(cfg.home_path),
                     created_at=time.time(), broker_where="here", broker_pid=pid, launch_id=new_launch_id(),
                     ).save(cfg.deployment_dir)
        down(cfg, wait_s=5)
        gone, _, _ = select.select([fd], [], [], 10)
        if not gone:
            os.killpg(pid, signal.SIGKILL)
        assert gone, "the local broker outlived `down`"
    finally:
        os.close(fd)


def test_down_leaves_alone_a_process_that_took_the_local_brokers_pid(tmp_path: Path) -> None:
    require_slurm()
    pid_file = tmp_path / "pid"
    # The broker is long gone and its pid now names someone else's process (a group leader, as it was).
    subprocess.run(["setsid", "-f", "sh", "-c", f"echo $$ > {pid_file}; exec sleep 600"], check=True)
    pid = int(wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "the process's pid"))
    try:
        cfg = deploy_from_dict({"deployment": "reuse", "home": str(tmp_path / "home"), "broker": {"where": "here"}})
        LaunchRecord(deployment="reuse", deploy_file=str(tmp_path / "deploy.yaml"), home=str(cfg.home_path),
                     created_at=time.time(), broker_where="here", broker_pid=pid, launch_id=new_launch_id(),
                     ).save(cfg.deployment_dir)
        down(cfg, wait_s=5)
        assert Path(f"/proc/{pid}").exists() and b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes(), (
            "down signalled a process that is not the broker")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_the_setup_lines_environment_reaches_the_role_under_export_none(tmp_path: Path, jobs: list[str]) -> None:
    # Clusters that want a clean job environment ask for `--export=NONE`; the setup lines then make it.
    cfg = deploy_from_dict({"deployment": "ex", "home": str(tmp_path / "home"), "setup": ["export PRORL_S41_FOO=bar"],
                            "nodes": {"count": 1, "time": "5", "cpus_per_task": 1, "mem_gb": 0.25,
                                      "sbatch_options": {"export": "NONE"}}})
    job = executor(cfg, "nodes", 1).submit(os.getenv, "PRORL_S41_FOO")
    jobs.append(str(job.job_id))
    wait_until(job.done, 120, "the job to end")
    assert job.result() == "bar", "the role's step did not get the environment the setup lines exported"
