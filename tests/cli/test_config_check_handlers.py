"""``prorl config check prorl.yaml`` refuses what ``prorl serve node`` refuses at start: settings under
``handlers.<task>`` that the task's handler does not take (a misspelt key, a value of the wrong type)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _prorl_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``prorl ARGS`` run in ``folder``, none of the suite's PRORL_* set (no test handlers, no test deployment)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    return subprocess.run([sys.executable, "-m", "prorl_cli", *args], cwd=folder, capture_output=True, text=True,
                          timeout=60, env={**clean, "PRORL_HOME": str(folder / "home"), "COLUMNS": "80"})


@pytest.mark.parametrize(("setting", "blamed"), [
    ("comand: echo hi", "prorl.yaml: handlers.harness: unknown setting 'comand'; known: ['command', "),
    ("timeout_s: soon", "prorl.yaml: handlers.harness.timeout_s: "),
], ids=["misspelt-key", "wrong-type"])
def test_config_check_refuses_the_handler_settings_a_node_refuses(tmp_path: Path, setting: str, blamed: str) -> None:
    (tmp_path / "prorl.yaml").write_text(f"handlers:\n  harness:\n    {setting}\n")
    check = _prorl_in(tmp_path, "config", "check", "prorl.yaml")
    assert check.returncode == 1 and "Traceback" not in check.stderr, check.stderr
    (error,) = [line for line in check.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {blamed}"), error
    # The node's own check at start, word for word: one check, not two that could drift apart.
    node = _prorl_in(tmp_path, "serve", "node", "--address", "tcp://127.0.0.1:9")
    assert node.returncode == 1, node.stderr
    assert f"error: cannot serve: {error.removeprefix('error: ')}" in node.stderr.splitlines(), node.stderr


def test_config_check_passes_good_handler_settings(tmp_path: Path) -> None:
    (tmp_path / "prorl.yaml").write_text("handlers:\n  harness:\n    command: echo hi\n    timeout_s: 60\n")
    check = _prorl_in(tmp_path, "config", "check", "prorl.yaml")
    assert check.returncode == 0 and check.stdout == "prorl.yaml: ok\n", check.stderr


def test_a_deploy_file_is_refused_for_what_its_node_tasks_would_refuse(tmp_path: Path) -> None:
    """The prorl.yaml a deploy.yaml names gets the node's check before anything is queued: ``config check`` and
    ``launch --dry-run`` refuse a misspelt ``handlers.<task>`` key that would stop every node task at start."""
    (tmp_path / "prorl.yaml").write_text("handlers:\n  harness:\n    comand: echo hi\n")
    (tmp_path / "deploy.yaml").write_text("deployment: typo\nconfig: prorl.yaml\nnodes:\n  count: 2\n")
    check = _prorl_in(tmp_path, "config", "check", "deploy.yaml")
    assert check.returncode == 1 and "Traceback" not in check.stderr, check.stderr
    assert "error: the node tasks would refuse to start: " in check.stderr, check.stderr
    assert "handlers.harness: unknown setting 'comand'" in check.stderr, check.stderr
    if subprocess.run(["sh", "-c", "command -v sbatch"], capture_output=True).returncode == 0:
        plan = _prorl_in(tmp_path, "launch", "deploy.yaml", "--dry-run")
        assert plan.returncode == 1 and "the launch would be refused: the node tasks would refuse to start" in \
            plan.stderr, plan.stderr
    (tmp_path / "prorl.yaml").write_text("handlers:\n  harness:\n    command: echo hi\n")
    check = _prorl_in(tmp_path, "config", "check", "deploy.yaml")
    assert check.returncode == 0 and check.stdout.startswith("deploy.yaml: ok"), check.stderr
