"""A small supervisor between prorl and ``apptainer build``.

Why: Apptainer's ``--fakeroot`` re-executes itself with new credentials,
which clears a parent-death signal, and some build steps move into process
groups of their own. So if ``prorl build-images`` is killed (even with
SIGKILL) its builds would carry on as orphans. This runner:

* asks the kernel for SIGTERM when its parent (prorl) dies (it never changes
  credentials itself, so the request holds),
* becomes a child subreaper, so every orphaned descendant of the build is
  re-parented to it and can be found,
* on SIGTERM/SIGINT/SIGHUP, or when the build exits, stops the build's
  process group (SIGTERM, then SIGKILL) and SIGKILLs every remaining
  descendant.

Run: ``python -m prorl_cli.images.runner PARENT_PID GRACE_S COMMAND...``.
Output is inherited: the command writes straight into prorl's pipe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from prorl_cli.processes import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, descendants, prctl


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def stop_tree(child: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the build's group, give it ``grace_s``, then SIGKILL it and every other descendant."""
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a child we cannot wait on with a timeout otherwise while signals arrive
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    for _ in range(3):  # orphans re-parent to us while we kill their parents
        pids = descendants(os.getpid())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        _reap()


def main(argv: list[str]) -> int:
    parent, grace_s, cmd = int(argv[0]), float(argv[1]), argv[2:]
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != parent:
        return 143  # prorl died before the request took effect
    child = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)
    stopping: list[tuple[int, float]] = []  # (signal, when): set by the handler, acted on below

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only signal here: Popen.wait in the main loop holds the child's wait lock.
        if not stopping:
            stopping.append((signum, time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    while True:
        try:
            rc = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if stopping and time.monotonic() - stopping[0][1] > grace_s:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
    stop_tree(child, 0)  # the build is over: nothing it started may outlive it
    return 128 + stopping[0][0] if stopping else rc

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
