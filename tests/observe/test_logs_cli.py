"""`prorl logs` on a log larger than the memory it may use: the last lines come from the end, never the whole file."""

from __future__ import annotations

import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from prorl_cli.slurm.record import LaunchRecord, Member
from tests.observe.conftest import ObservedRun

#: The address space `prorl logs` runs in, and a log twice that size.
_LIMIT_BYTES = 1 << 30
_LOG_BYTES = 2 << 30


def _launched(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A launch record with one node task; its home and the path of the node's log (not written yet)."""
    home = tmp_path / "home"
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"deployment": name, "home": str(home), "nodes": {"count": 1}}))
    record = LaunchRecord(deployment=name, deploy_file=str(deploy), home=str(home), created_at=0.0, launch_id="L1",
                          members=[Member("broker", 0, "9"), Member("nodes", 0, "10_0")])
    record.save(home / name)
    folder = home / name / "slurm" / "nodes" / "10_0"
    folder.mkdir(parents=True)
    return home, folder / "10_0_0_log.out"


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_LIMIT_BYTES, _LIMIT_BYTES))


def test_lines_of_a_log_larger_than_memory(tmp_path: Path) -> None:
    name = "big"
    home, log = _launched(tmp_path, name)
    with log.open("wb") as f:  # a long run's log: 2 GiB (sparse here), its last lines at the end
        f.write(b"started\n")
        f.truncate(_LOG_BYTES)
        f.seek(_LOG_BYTES)
        f.write("step 1 ✓\nstep 2 ✓\nstep 3 ✓\n".encode())
    prorl = Path(sys.executable).with_name("prorl")
    out = subprocess.run([str(prorl), "--home", str(home), "logs", "-d", name, "nodes[0]", "--lines", "2"],
                         capture_output=True, text=True, preexec_fn=_limit_memory, timeout=120,
                         env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "step 2 ✓\nstep 3 ✓\n"


def _read_until(proc: subprocess.Popen[bytes], want: bytes, timeout_s: float) -> bytes:
    """What ``proc`` prints to stdout until ``want`` is among it; fails after ``timeout_s``."""
    assert proc.stdout is not None
    got = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while want not in got:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise AssertionError(f"no {want!r} from prorl logs -f; it printed {got!r}")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"prorl logs -f ended before {want!r}; it printed {got!r}")
            got += chunk
    return got


def test_follow_starts_again_when_the_log_is_truncated_or_replaced(tmp_path: Path) -> None:
    home, log = _launched(tmp_path, "follow")
    log.write_text("a long first line of the first run\n")
    prorl = Path(sys.executable).with_name("prorl")
    proc = subprocess.Popen([str(prorl), "--home", str(home), "logs", "-d", "follow", "nodes[0]", "-f"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _read_until(proc, b"first run\n", 60)
        with log.open("r+b") as f:  # cut shorter than what -f has read: its offset is past the end now
            f.truncate(0)
            f.write(b"truncated\n")
        _read_until(proc, b"truncated\n", 60)
        fresh = log.with_name("fresh")
        fresh.write_text("a new file, longer than the truncated one was\n")
        os.replace(fresh, log)
        _read_until(proc, b"longer than the truncated one was\n", 60)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert f"==> {log} was truncated: following it from its start".encode() in err
    assert f"==> {log} was replaced: following it from its start".encode() in err


def test_logs_of_a_deployment_not_started_on_slurm_says_where_its_logs_are(observed_run: ObservedRun) -> None:
    # A deployment of servers started without `prorl launch` (here an embedded stack) has no Slurm logs:
    # `prorl logs` says so and where its logs are (the stack's server logs, each job's own log on its node).
    d = observed_run.deployment
    out = observed_run.prorl("logs", "broker")
    assert out.returncode == 1
    message = " ".join(out.stderr.split())
    assert f"deployment '{d.name}' was not launched" in message
    assert f"log in {d.home / 'logs'}: " in message and "broker.log" in message and "n1.log" in message
    assert f"{d.deployment_dir / 'nodes'}/NODE/jobs/JOB/job.log (nodes here: n1;" in message
    # The job log it points to is there: the obs run's failed job logged through ctx.log.
    assert any("about to fail on purpose" in p.read_text() for p in (d.deployment_dir / "nodes" / "n1" / "jobs").glob("*/job.log"))
