"""The per-node sandbox watchdog: sandboxes do not outlive their node, even after ``kill -9``.

The :class:`~prorl_cli.sandbox.manager.SandboxManager` starts this file as a
small stdlib-only process in a session of its own (so a kill of the node's
process group does not take it along) and keeps the write end of a pipe to
its stdin. It tells the watchdog ``add SID START_TICKS`` for each sandbox
session it starts and ``del SID`` for each it stops. When the pipe reaches
end of file (the node exited, however it died), the watchdog SIGKILLs every
process left in the sessions it was told about, waits until they are gone,
and exits: it outlives nothing. Records and session directories are left
for the next node on the host to clean (``RecordStore.reap_orphans``).

Only sessions it was told about are touched: a leader is checked by its
start time, and while any member of a session lives, the kernel does not
hand its id to another process.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time

WAIT_GONE_S = 30.0
KILL_PASSES = 20


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


def kill_sessions(sessions: dict[int, int | None]) -> list[int]:
    """SIGKILL every live member of the given sessions (leader checked by start time); return what is left.

    Passes repeat until a pass finds no one: a process forked while the others were killed (a sandbox that
    was still starting its FUSE helpers) is missed by the pass that listed the session before it existed.
    """
    ours = []
    for sid, ticks in sessions.items():
        leader = _stat(sid)
        if leader is not None and ticks is not None and int(leader[19]) != ticks:
            continue  # the id now names another process: not ours
        ours.append(sid)
    deadline = time.monotonic() + WAIT_GONE_S
    left: list[int] = []
    for _ in range(KILL_PASSES):
        targets = [pid for sid in ours for pid in _session_members(sid)]
        if not targets:
            return []
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        left = wait_gone(targets, max(0.0, deadline - time.monotonic()))
        if left:
            return left  # unkillable for now (e.g. stuck in the kernel): report them
    return left


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Block until the pids have exited (pidfds: no polling); return those still running."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + timeout_s
    try:
        pending = list(fds)
        while pending and (remaining := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(pending, [], [], remaining)
            pending = [fd for fd in pending if fd not in ready]
    finally:
        for fd in fds:
            os.close(fd)
    return [p for p in pids if (_stat(p) or ["X"])[0] not in ("Z", "X")]


def main() -> int:
    sessions: dict[int, int | None] = {}
    for line in sys.stdin:
        parts = line.split()
        if len(parts) == 3 and parts[0] == "add":
            sessions[int(parts[1])] = None if parts[2] == "-" else int(parts[2])
        elif len(parts) == 2 and parts[0] == "del":
            sessions.pop(int(parts[1]), None)
    # End of file: the node is gone (or stopped cleanly, and then nothing is left to kill).
    if sessions:
        left = kill_sessions(sessions)
        print(f"prorl sandbox watchdog: node gone; killed {len(sessions)} sandbox session(s)"
              + (f", processes {left} still there" if left else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the node must not end the watchdog first
    sys.exit(main())
