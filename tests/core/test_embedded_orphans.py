"""An embedded stack whose owner is killed with SIGKILL leaves no server behind."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

OWNER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from prorl_cli.embedded import LocalStack

    stack = LocalStack(Path(sys.argv[1]), "orphans", {"log_level": "WARNING"})
    stack.start_broker()
    stack.start_node("node-0", "--handlers", sys.argv[2])
    print(json.dumps({name: p.pid for name, p in stack.procs.items()}), flush=True)
    time.sleep(600)  # killed with SIGKILL before this ends: no cleanup of its own runs
""")


@pytest.mark.timeout(300)
def test_a_killed_owner_takes_its_broker_and_node_with_it(tmp_path: Path) -> None:
    handlers = Path(__file__).resolve().parents[1] / "observe" / "handlers"
    if not handlers.is_dir():
        handlers = tmp_path / "no-handlers"
        handlers.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "home"), str(handlers)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line, f"the owner exited before its stack was up (exit {owner.wait()})"
        servers = json.loads(line)
        assert set(servers) == {"broker", "node-0"}
        # Wait on each server's pidfd: readable once that process has ended.
        fds = {name: os.pidfd_open(pid) for name, pid in servers.items()}
        os.killpg(owner.pid, signal.SIGKILL)  # the owner's group only: its servers have groups of their own
        owner.wait()
        try:
            pending = dict(fds)
            while pending:
                ready, _, _ = select.select(list(pending.values()), [], [], 120)
                assert ready, f"still running 120 s after their owner was killed: {sorted(pending)}"
                pending = {n: fd for n, fd in pending.items() if fd not in ready}
        finally:
            for fd in fds.values():
                os.close(fd)
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
