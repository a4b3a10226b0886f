"""The sandbox watchdog's kill of a dead node's sessions catches processes forked while it kills.

Found by the chaos run with Apptainer (``scripts/chaos/chaos_run.py --runtime apptainer``): a node killed while
a sandbox was starting left its squashfuse/fuse-overlayfs helpers running, because one pass listed the session
before they were forked. Here a session keeps forking children while the watchdog's kill runs."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from prorl_cli.sandbox.runtime import kill_session, session_members
from prorl_cli.sandbox.watchdog import kill_sessions

SPAWNER = """
import os, sys, time
for _ in range(3000):
    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    if _ == 20:
        print("forking", flush=True)
    time.sleep(0.001)
"""


def _running(pids: list[int]) -> list[int]:
    """The pids that are not zombies (killed children wait for init to reap them)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def test_members_forked_during_the_kill_are_killed_too() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SPAWNER], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "forking\n"
        left = kill_sessions({proc.pid: None})
        assert left == []
        assert _running(session_members(proc.pid)) == [], "members of the session survived the watchdog's kill"
    finally:
        for _ in range(50):  # whatever the outcome, leave nothing of this test behind
            if not kill_session(proc.pid):
                break
            time.sleep(0.05)
        proc.wait(timeout=10)
