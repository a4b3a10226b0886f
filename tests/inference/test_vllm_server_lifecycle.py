"""A vLLM server ends with whoever started it, even a starter killed with SIGKILL.

The server runs in a process group of its own (so ``stop`` reaches its
workers), which also puts it out of reach of a signal to its starter's group.
A stand-in that only sleeps takes vLLM's place: what is tested is how
``VLLMServer.start`` spawns, not vLLM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STARTER = """
import sys, time
from prorl_cli.inference import vllm_server
vllm_server.vllm_available = lambda: True
server = vllm_server.VLLMServer(sys.argv[1])
server.command = lambda: [sys.executable, "-c", "import time; time.sleep(600)"]
server.start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_ends_when_its_starter_is_killed_with_sigkill(tmp_path: Path) -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    server_pid = 0
    try:
        assert starter.stdout is not None
        server_pid = int(starter.stdout.readline())
        assert _alive(server_pid) and os.getpgid(server_pid) == server_pid, "a process group of its own"
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the kernel's process table: there is no event to wait on for a non-child
        assert not _alive(server_pid), "the server outlived its starter"
    finally:
        starter.kill()
        starter.wait()
        if server_pid and _alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)
