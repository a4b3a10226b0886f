"""A Slurm node task waiting for its broker stops waiting when the deployment was stopped on purpose.

``prorl stop`` (or ``down``) makes the broker write the deployment's stop record; a node task still waiting
for the rendezvous file then ends (exit code 0 in the role) instead of waiting its whole ``rendezvous_wait_s``
for a broker that is not coming. A stop from before the task started is not its business: it waits.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from prorl_cli.exceptions import RendezvousError
from prorl_cli.rendezvous import record_stop, stopped_path
from prorl_cli.slurm.roles import wait_for_broker


def test_a_stop_since_the_task_started_ends_the_wait(tmp_path: Path) -> None:
    record_stop(tmp_path, "tcp://127.0.0.1:1")  # after this test process started
    assert wait_for_broker(tmp_path, 30.0, threading.Event()) is False  # without the record: RendezvousError


def test_a_stop_from_before_the_task_started_is_waited_past(tmp_path: Path) -> None:
    record = record_stop(tmp_path, "tcp://127.0.0.1:1")
    # As a record left by the stop before this launch: older than the task.
    stopped_path(tmp_path).write_text(json.dumps({**record.__dict__, "stopped_at": time.time() - 10 * 365 * 86400}))
    with pytest.raises(RendezvousError, match="no broker after 0 s"):
        wait_for_broker(tmp_path, 0.0, threading.Event())
