"""A signal that reaches a role before its own handlers are in still makes it leave.

Slurm sends the time-limit warning (``--signal=USR2@N``) up to a minute
early, so on a short allocation it can land while a role is still starting:
after the Slurm wrapper's handlers (:func:`prorl_cli.slurm.roles.slurm_lifecycle`)
are installed but before the role's event loop has taken the signals over.
The role must still leave then, not serve on until Slurm kills it at the limit.
Each role runs here in a real process that signals itself in that window.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import Deployment

# The same prelude for every role: the Slurm wrapper's handlers are in, then the signal comes.
PRELUDE = """
import asyncio, os, signal, sys
from prorl_cli.config import load_config
from prorl_cli.observe.logs import configure_logging
from prorl_cli.slurm.roles import slurm_lifecycle

config = load_config(sys.argv[1])
configure_logging(sys.argv[2], "INFO")
with slurm_lifecycle() as signals:
    os.kill(os.getpid(), getattr(signal, sys.argv[3]))
"""

ROLES = {
    "node": """
    from prorl_cli.node.server import run_node
    run_node(config, node_id="n-early", leave_requested=signals.leave)
""",
    "inference": """
    from prorl_cli.inference.serve import BridgeOptions, run_bridge
    code = asyncio.run(run_bridge(BridgeOptions(engine="sim", backend_id="n-early"), config, leave_requested=signals.leave))
    assert code == 0, code
""",
    "broker": """
    from prorl_cli.broker.server import Broker
    Broker(config).serve_forever(leave_requested=signals.leave)
""",
}


def _run_role(d: Deployment, role: str, sig: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in d.env().items() if not k.startswith("SLURM_")}  # outside Slurm: nothing to requeue
    script = PRELUDE + ROLES[role] + 'print("left; requeue asked:", signals.requeue)\n'
    # Without the check the role serves on: the timeout is the failure.
    return subprocess.run([sys.executable, "-c", script, str(d.config_path), role, sig], env=env, cwd=d.home,
                          capture_output=True, text=True, timeout=60, start_new_session=True)


@pytest.mark.parametrize("role", ["node", "inference"])
@pytest.mark.parametrize("sig", ["SIGUSR2", "SIGTERM"])
def test_a_node_or_bridge_signalled_while_starting_leaves_without_registering(tmp_path: Path, role: str, sig: str) -> None:
    d = Deployment(tmp_path / "home", "early")
    try:
        d.start_broker()
        done = _run_role(d, role, sig)
        assert done.returncode == 0, done.stderr
        assert f"left; requeue asked: {sig == 'SIGUSR2'}" in done.stdout, done.stdout + done.stderr
        said = {"node": "not registering", "inference": "not starting it"}[role]
        assert said in done.stderr, done.stderr
        status = d.client.status()
        assert not status.nodes and not status.backends, "it never registered"
        assert "n-early" not in d.log("broker"), d.log("broker")
    finally:
        d.close()


def test_a_broker_signalled_while_starting_leaves_and_removes_its_rendezvous(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "early")
    done = _run_role(d, "broker", "SIGUSR2")
    assert done.returncode == 0, done.stderr
    assert "left; requeue asked: True" in done.stdout, done.stdout + done.stderr
    assert "leaving on a signal" in done.stderr, done.stderr
    assert not os.path.exists(d.deployment_dir / "broker.json"), "the rendezvous file is removed on the way out"
