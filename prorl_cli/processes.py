"""Stopping children we started: their process group, SIGTERM first, then SIGKILL.

Every long-running child prorl starts (servers, vLLM, builds) gets its own
process group, so stopping it reaches its workers too, and nothing that
prorl did not start is ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Any


def stop_groups(procs: Iterable[subprocess.Popen[Any]], grace_s: float) -> None:
    """SIGTERM each child's process group, give them ``grace_s`` together, SIGKILL the rest.

    Returns once every child has been reaped.
    """
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in alive:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_group(proc: subprocess.Popen[Any], grace_s: float) -> int | None:
    """:func:`stop_groups` for one child; return its exit code."""
    stop_groups([proc], grace_s)
    return proc.returncode
