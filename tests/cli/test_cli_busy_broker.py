"""A broker that is alive on this host but slow to answer (its machine's cores held by vLLM on the CPU, a build,
a stopped process) is waited for, and said to be waited for, instead of reported as not answering after the
short ping; one that stays silent is named as running and stuck, not as maybe not running.

The broker is a real ``prorl serve broker`` process, held silent with SIGSTOP: the command's stderr line says
when it started the longer wait, and the test lets the broker go on only then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from prorl_cli.cli import cli, common
from prorl_cli.testing.harness import Deployment


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[Deployment, subprocess.Popen[bytes]]]:
    d = Deployment(tmp_path / "home", "busy")
    try:
        proc = d.start_broker()
        try:
            yield d, proc
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped broker would not hear close()'s SIGTERM
    finally:
        d.close()


@pytest.mark.parametrize("command", [["status"], ["cancel", "--all"]])
def test_a_stopped_broker_that_goes_on_is_waited_for(broker: tuple[Deployment, subprocess.Popen[bytes]],
                                                      command: list[str]) -> None:
    d, proc = broker
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        cmd = subprocess.Popen([sys.executable, "-m", "prorl_cli", *command], env=d.env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert cmd.stderr is not None
        said = ""
        for line in cmd.stderr:  # each line comes as the command says it
            said += line
            if "waiting up to" in line:
                break
        assert f"the broker (pid {proc.pid} on this host) is running but has not answered" in said, said
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    _, err = cmd.communicate(timeout=120)
    assert cmd.returncode == 0, err
    assert "does not answer" not in err


def test_a_broker_that_stays_silent_is_named_running_and_stuck(
        broker: tuple[Deployment, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    d, proc = broker
    monkeypatch.setattr(common, "PING_TIMEOUT_S", 0.5)
    monkeypatch.setattr(common, "BUSY_BROKER_WAIT_S", 0.5)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        for command in (["cancel", "--all"], ["status"]):
            r = CliRunner().invoke(cli, command, env=d.env(), catch_exceptions=False)
            text = r.output + (r.stderr if r.stderr_bytes is not None else "")
            assert "no reply within 1 s" in text, text
            assert f"its process (pid {proc.pid} on this host) is running: stuck, or starved of CPU" in text, text
            assert "is it running?" not in text
    finally:
        os.kill(proc.pid, signal.SIGCONT)
