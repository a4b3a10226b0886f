"""A SIGTERM to ``prorl serve inference`` still waiting for its broker ends it at once.

The bridge polls for the broker's rendezvous file after its engine is up; a
signal meanwhile must leave nothing running that holds up the process's exit
(a polling thread is joined by ``asyncio.run`` until its own deadline).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from pathlib import Path

from prorl_cli.config import ProrlConfig
from prorl_cli.inference.serve import BridgeOptions, run_bridge


class _SignalWhenReady(logging.Handler):
    """Sends this process SIGTERM as the bridge logs that its engine is ready (it then waits for the broker)."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("engine ready"):
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_while_waiting_for_the_broker_leaves_nothing_running(tmp_path: Path) -> None:
    config = ProrlConfig(home=str(tmp_path))  # no broker: no rendezvous file ever appears
    before = set(threading.enumerate())
    logger = logging.getLogger("prorl_cli.inference.serve")
    handler, level = _SignalWhenReady(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    loop = asyncio.new_event_loop()
    try:
        opts = BridgeOptions(engine="sim", backend_id="b-term", broker_wait_s=30.0)
        code = loop.run_until_complete(run_bridge(opts, config))
        left = [t.name for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        loop.close()
    assert code == 0
    assert left == [], f"threads still running after the bridge stopped: {left}"
