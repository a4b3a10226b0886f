"""Stopping children we started: their process group, SIGTERM first, then SIGKILL.

Every long-running child prorl starts (servers, vLLM, builds) gets its own
process group, so stopping it reaches its workers too, and nothing that
prorl did not start is ever signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: Set by a parent for the servers it starts (``LocalStack``): the pid whose end ends them.
DIE_WITH_PARENT_ENV = "PRORL_DIE_WITH_PARENT"


def prctl(option: int, value: int) -> None:
    """Linux ``prctl(option, value)``; OSError when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def child_pids() -> dict[int, list[int]]:
    """Every live process's children, from one pass over /proc (the parent is field 4 of ``/proc/PID/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue  # it ended while we looked
        # The command name may hold spaces and parentheses: the fields after it start past the last ')'.
        fields = raw[raw.rindex(b")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every live process below ``root``, children before grandchildren (``children``: a :func:`child_pids` scan)."""
    children = child_pids() if children is None else children
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def die_with_parent() -> None:
    """Get SIGTERM when the parent named in ``$PRORL_DIE_WITH_PARENT`` ends, however it ends.

    A parent that is killed with SIGKILL cannot stop its children; the kernel
    signals them instead (``PR_SET_PDEATHSIG``), and each shuts down as on any
    SIGTERM. The variable is removed, so what this process starts in turn
    (sandboxes, engines) is stopped by this process, not by the kernel. The
    kernel follows the parent's *thread* that forked, not its process: start
    such servers from a thread that lives as long as they should (a
    ``LocalStack`` spawns from a thread of its own that lives until it closes).
    """
    raw = os.environ.pop(DIE_WITH_PARENT_ENV, None)
    if not raw or not raw.isdigit():
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(raw):  # the parent ended before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def dies_with_spawning_thread(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for a child in a process group of its own: it gets ``sig`` when its starter ends.

    A child started with ``start_new_session`` is out of reach of a signal to
    the starter's group, so a starter killed with SIGKILL would leave it running
    (a vLLM server holding gigabytes). The kernel follows the *thread* that
    forked: call ``Popen`` from the thread that will stop the child (an event
    loop's, as the engines do). libc is looked up here, before the fork, so the
    child only makes two system calls and takes no loader lock.
    """
    libc_prctl = ctypes.CDLL(None, use_errno=True).prctl
    starter = os.getpid()

    def preexec() -> None:
        libc_prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != starter:  # the starter ended before the request took effect
            os.kill(os.getpid(), int(sig))

    return preexec


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


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def is_local_broker(pid: int | None) -> bool:
    """Whether ``pid`` is a prorl broker on this host (a pid recorded long ago may be another process's now)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process: cannot tell more
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc to ask: take it for the broker
    # `python -m prorl_cli ... serve broker`, or the `prorl` console script: `python .../bin/prorl serve broker`.
    prorl = any(arg == b"prorl_cli" or os.path.basename(arg) == b"prorl" for arg in argv)
    return prorl and b"serve" in argv and b"broker" in argv
