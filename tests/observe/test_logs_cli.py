"""`prorl logs` on a log larger than the memory it may use: the last lines come from the end, never the whole file."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import yaml

from prorl_cli.slurm.record import LaunchRecord, Member

#: The address space `prorl logs` runs in, and a log twice that size.
_LIMIT_BYTES = 1 << 30
_LOG_BYTES = 2 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_LIMIT_BYTES, _LIMIT_BYTES))


def test_lines_of_a_log_larger_than_memory(tmp_path: Path) -> None:
    home, name = tmp_path / "home", "big"
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"deployment": name, "home": str(home), "nodes": {"count": 1}}))
    record = LaunchRecord(deployment=name, deploy_file=str(deploy), home=str(home), created_at=0.0, launch_id="L1",
                          members=[Member("broker", 0, "9"), Member("nodes", 0, "10_0")])
    record.save(home / name)
    folder = home / name / "slurm" / "nodes" / "10_0"
    folder.mkdir(parents=True)
    log = folder / "10_0_0_log.out"
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
