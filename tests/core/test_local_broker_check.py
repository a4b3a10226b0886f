"""Which local process is a prorl broker: a pid in a rendezvous file may be a broker still running, or another
process that took the pid after the broker died (real processes, their real command lines)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.processes import is_local_broker

#: Sleeps until killed: stands in for a server process with the command line it was given.
SLEEPER = "import sys, time; sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(600)\n"


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def _run(started: list[subprocess.Popen[str]], argv: list[str], cwd: Path | None = None) -> int:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=cwd)
    started.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"  # its command line is in place
    return proc.pid


def test_a_broker_started_by_the_console_script_or_as_a_module_is_one(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "prorl"  # what `prorl serve broker` runs: python .../bin/prorl serve broker
    script.write_text(SLEEPER)
    assert is_local_broker(_run(started, [sys.executable, str(script), "serve", "broker"]))
    (tmp_path / "prorl_cli").mkdir()
    (tmp_path / "prorl_cli" / "__main__.py").write_text(SLEEPER)
    (tmp_path / "prorl_cli" / "__init__.py").write_text("")
    # `python -m prorl_cli -d x serve broker` (a stand-in package of that name, found first from its folder).
    assert is_local_broker(_run(started, [sys.executable, "-m", "prorl_cli", "-d", "x", "serve", "broker"], cwd=tmp_path))
    # A node of prorl, and another program that took a dead broker's pid, are not.
    assert not is_local_broker(_run(started, [sys.executable, str(script), "serve", "node"]))
    other = tmp_path / "bin" / "prorl-like"
    other.write_text(SLEEPER)
    assert not is_local_broker(_run(started, [sys.executable, str(other), "serve", "broker"]))
