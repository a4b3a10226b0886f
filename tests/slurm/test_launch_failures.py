"""Launches that cannot work fail clearly and leave nothing queued."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import prorl, require_slurm, temporary_partition, write_yaml

pytestmark = pytest.mark.timeout(300)


def _queued(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if f"prorl-{name}-" in line]


@pytest.fixture
def base(tmp_path: Path) -> Path:
    require_slurm()
    return tmp_path


def test_bad_deploy_file_is_refused_before_submitting(base: Path) -> None:
    deploy = write_yaml(base / "deploy.yaml", {"deployment": "bad", "home": str(base / "home"), "nodes": {"count": "three"}})
    out = prorl(base / "home", "launch", str(deploy))
    assert out.returncode != 0
    assert str(deploy) in out.stderr and "nodes.count" in out.stderr
    assert not _queued("bad")
    assert not (base / "home" / "bad").exists(), "nothing submitted, nothing written"


def test_a_partition_the_cluster_lacks_is_refused_naming_the_key_before_submitting(base: Path) -> None:
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": "nopart", "home": str(base / "home"),
        "broker": {"time": "5", "cpus_per_task": 1, "mem_gb": 0.5},
        "nodes": {"count": 1, "time": "5", "cpus_per_task": 1, "mem_gb": 0.5, "partition": "no-such-partition"},
    })
    out = prorl(base / "home", "launch", str(deploy), "--wait-s", "60")
    assert out.returncode != 0
    (error,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert "nodes.partition" in error and "'no-such-partition'" in error and "debug" in error, out.stderr
    assert not _queued("nopart")
    # Nothing was submitted (the broker before the nodes included), so no launch went to history either.
    assert not (base / "home" / "nopart" / "history").exists(), "a broker was submitted and cancelled"


def test_more_gpus_than_any_node_fails_with_slurms_reason(base: Path) -> None:
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": "greedy", "home": str(base / "home"),
        "broker": {"time": "5", "cpus_per_task": 1, "mem_gb": 0.5},
        "nodes": {"count": 1, "time": "5", "cpus_per_task": 1, "mem_gb": 0.5},
        "inference": {"count": 1, "gpus_per_task": 3, "model": str(base), "engine": "transformers", "time": "5"},
    })
    out = prorl(base / "home", "launch", str(deploy), "--wait-s", "60")
    assert out.returncode != 0
    (error,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    # sbatch refuses it at submission: Slurm's own words, not a pending reason from squeue.
    assert "sbatch refused the inference" in error and "Requested node configuration is not available" in error, out.stderr
    # The broker and the node array went in before the refused inference array: they are cancelled too.
    assert re.search(r"cancelled what was submitted before it \(broker\[0\]=\d+, nodes\[0\]=\d+(_0)?\)", error), error
    assert "nothing left queued" in error
    assert out.stderr.count("Requested node configuration") == 1, "said once, in the error line"
    assert not _queued("greedy")
    assert not (base / "home" / "greedy" / "launch.json").exists()


@pytest.fixture
def tiny_partition() -> Iterator[str]:
    """A partition whose MaxTime (1 min) is below what the test asks (5): Slurm accepts the job (EnforcePartLimits=NO,
    the default) and leaves it pending with a partition reason. Created at run time, deleted after."""
    yield from temporary_partition("prorltiny", "Nodes=n1", "MaxTime=1", "State=UP")


def test_a_request_slurm_accepts_but_can_never_start_fails_with_squeues_reason(base: Path, tiny_partition: str) -> None:
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": "never", "home": str(base / "home"),
        "broker": {"where": "here", "bind_host": "127.0.0.1"},
        "nodes": {"count": 2, "time": "5", "cpus_per_task": 1, "mem_gb": 0.5, "partition": tiny_partition},
    })
    out = prorl(base / "home", "launch", str(deploy), "--wait-s", "240")
    assert out.returncode != 0
    (error,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    # Not a timeout: a pending reason waiting cannot cure fails the launch as soon as squeue shows it.
    # (squeue says PartitionConfig or PartitionTimeLimit, depending on what else the job asks of the partition.)
    assert re.search(r"cannot start: squeue says Partition(Config|TimeLimit)", error), out.stderr
    assert "not all registered" not in error
    assert "nothing left queued" in error
    assert not _queued("never")
    assert not (base / "home" / "never" / "launch.json").exists()


def test_a_task_that_cannot_start_in_time_is_reported_with_its_pending_reason(base: Path) -> None:
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": "later", "home": str(base / "home"),
        "broker": {"where": "here", "bind_host": "127.0.0.1"},
        "nodes": {"count": 2, "time": "5", "cpus_per_task": 1, "mem_gb": 0.5, "sbatch_options": {"begin": "now+1hour"}},
    })
    out = prorl(base / "home", "launch", str(deploy), "--wait-s", "8")
    assert out.returncode != 0
    assert "not all registered after 8 s" in out.stderr and "BeginTime" in out.stderr, out.stderr
    assert "nothing left queued" in out.stderr
    assert not _queued("later")


def test_a_task_that_dies_before_registering_fails_the_launch_with_its_log(base: Path) -> None:
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": "dies", "home": str(base / "home"),
        "broker": {"where": "here", "bind_host": "127.0.0.1"},
        "nodes": {"count": 1, "time": "5", "cpus_per_task": 1, "mem_gb": 0.5,
                  "setup": ["echo 'site setup broke: no such module'", "exit 3"]},
    })
    out = prorl(base / "home", "launch", str(deploy), "--wait-s", "120")
    assert out.returncode != 0
    assert "node-0" in out.stderr and "FAILED" in out.stderr, out.stderr
    assert "site setup broke: no such module" in out.stderr, "the tail of the task's log"
    # The tail on lines of its own (as the log has it), the error line after it, readable.
    assert any("site setup broke" in line and not line.startswith("error:") for line in out.stderr.splitlines())
    (error,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert "ended FAILED. Cancelled what was submitted; nothing left queued." in error, error
    assert not _queued("dies")


@pytest.mark.parametrize(("signame", "said", "code"), [
    ("SIGINT", "interrupted", 130),
    # A kill, a batch system's stop: the same clean-up as Ctrl-C, the signal named.
    ("SIGTERM", "terminated (SIGTERM)", 143),
    # A closed terminal, a dropped ssh session.
    ("SIGHUP", "hung up (SIGHUP)", 129),
], ids=["ctrl-c", "sigterm", "sighup"])
def test_a_signal_while_launch_waits_cancels_what_it_submitted(base: Path, signame: str, said: str, code: int) -> None:
    import os
    import signal
    import sys

    sig = getattr(signal, signame)
    name = f"intr{signame.lower()}"
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": name, "home": str(base / "home"),
        "broker": {"where": "here", "bind_host": "127.0.0.1"},
        "nodes": {"count": 1, "time": "5", "cpus_per_task": 1, "mem_gb": 0.5, "sbatch_options": {"begin": "now+1hour"}},
    })
    # The signal as a terminal's launch has it: a test run in the background (CI's Slurm tier runs beside the
    # rest) inherits SIGINT ignored, and one under nohup SIGHUP; Python then leaves them ignored.
    proc = subprocess.Popen([sys.executable, "-m", "prorl_cli", "--home", str(base / "home"), "launch", str(deploy)],
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL),
                            env={**os.environ, "COLUMNS": "200"})
    assert proc.stderr is not None
    try:
        for line in proc.stderr:  # the jobs are in once it says what it submitted
            if line.startswith(f"submitted {name}"):
                break
        assert _queued(name), "the node array waits in squeue"
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C reaches the terminal's process group
        else:
            os.kill(proc.pid, sig)  # `kill -TERM PID`, or the hangup of the session it leads
        _, rest = proc.communicate(timeout=180)
        assert proc.returncode == code, rest
        assert f"{said}: Cancelled what was submitted; nothing left queued." in rest, rest
        assert not _queued(name)
        assert (base / "home" / name / "history").is_dir(), "the launch went to history, as a failed one does"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if (base / "home" / name / "launch.json").exists():  # what a failed run left: its jobs and its broker
            prorl(base / "home", "down", "-d", name)


def test_status_of_a_deployment_whose_slurm_jobs_are_gone_says_so(base: Path) -> None:
    from prorl_cli.slurm import squeue
    from prorl_cli.slurm.record import LaunchRecord, Member

    home = base / "home"
    deploy = write_yaml(base / "deploy.yaml", {"deployment": "gone", "home": str(home)})
    job = subprocess.run(["sbatch", "--parsable", "-t", "1", "-o", "/dev/null", "--wrap", "true"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert not squeue.wait_gone([job], 60)
    LaunchRecord("gone", str(deploy), str(home), 0.0, members=[Member("nodes", 0, job)]).save(home / "gone")
    out = prorl(home, "-d", "gone", "status", timeout_s=60)
    assert out.returncode == 1
    assert "all its Slurm jobs are gone" in out.stdout.replace("\n", " ")


def test_launch_refuses_a_deployment_whose_broker_already_runs(base: Path) -> None:
    import os
    import sys

    from prorl_cli.processes import stop_group
    from tests.slurm.cluster import wait_until

    home = base / "home"
    broker = subprocess.Popen(
        [sys.executable, "-m", "prorl_cli", "--home", str(home), "-d", "busy", "serve", "broker"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env={**os.environ, "SLURM_JOB_ID": ""},
    )
    try:
        wait_until(lambda: (home / "busy" / "broker.json").exists(), 60, "the broker's rendezvous file")
        deploy = write_yaml(base / "deploy.yaml", {"deployment": "busy", "home": str(home), "nodes": {"count": 1}})
        out = prorl(home, "launch", str(deploy))
        assert out.returncode != 0 and "already running" in out.stderr, out.stderr
        assert not _queued("busy")
        assert broker.poll() is None, "the running broker is left alone"
    finally:
        stop_group(broker, 10)
