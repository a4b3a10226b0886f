"""Runs one program on one test input inside a sandbox, under time and memory limits.

Copied into the sandbox and run with its python3 (standard library only,
Python 3.8+). Usage: ``python3 judge_runner.py SPEC.json``; writes the JSON
report ``{status, exit_code, signal, time_s, stdout, stderr, memory_error}``
to the spec's ``report_path``,
where ``status`` is ``exited``, ``timeout`` or ``signalled``. The program runs
in its own process group, which is killed whole at the time limit.
"""

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import IO

# After a time limit's SIGKILL: how long the program's output pipes may take to close.
_DRAIN_S = 5.0
# The end of stderr kept for the report (which shows its last 2000 characters).
_STDERR_KEEP_BYTES = 1 << 16


class _Capture(threading.Thread):
    """Reads a pipe to its end, keeping at most ``keep`` bytes: the first ones, or with ``tail`` the last ones."""

    def __init__(self, pipe: "IO[bytes] | None", keep: int, tail: bool) -> None:
        threading.Thread.__init__(self, daemon=True)
        assert pipe is not None
        self.fd, self.keep, self.tail = pipe.fileno(), keep, tail
        self.data = bytearray()

    def run(self) -> None:
        while True:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return
            if self.tail:
                self.data += chunk
                del self.data[: max(0, len(self.data) - self.keep)]
            elif len(self.data) < self.keep:
                self.data += chunk[: self.keep - len(self.data)]


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    mem_bytes = int(spec["mem_mb"]) * 1024 * 1024
    limit_s = float(spec["time_limit_s"])
    max_out = int(spec.get("max_output_bytes", 1 << 20))

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        cpu = int(limit_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))

    with open(spec["stdin_path"], "rb") as stdin:
        started = time.monotonic()
        proc = subprocess.Popen(spec["command"], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=limits, start_new_session=True, cwd=spec.get("cwd", "/work"))
    # Read as the program writes, keeping only what the report holds: a program printing in a loop
    # must not fill the runner's memory (gigabytes within a time limit).
    readers = [_Capture(proc.stdout, max_out, tail=False), _Capture(proc.stderr, _STDERR_KEEP_BYTES, tail=True)]
    for reader in readers:
        reader.start()
    status = "exited"
    try:
        proc.wait(timeout=limit_s)
        # Its output ends when every holder of its pipes is done (a child it left running, say), within the limit.
        for reader in readers:
            reader.join(max(0.0, started + limit_s - time.monotonic()))
        if any(reader.is_alive() for reader in readers):
            status = "timeout"
    except subprocess.TimeoutExpired:
        status = "timeout"
    elapsed = time.monotonic() - started
    if status == "timeout":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        drained_by = time.monotonic() + _DRAIN_S
        for reader in readers:
            # A descendant in a session of its own (setsid) may hold the pipes open still: the verdict is the
            # time limit all the same, with what was read so far.
            reader.join(max(0.0, drained_by - time.monotonic()))
    out, err = bytes(readers[0].data), bytes(readers[1].data)
    code = proc.returncode
    if status == "exited" and code is not None and code < 0:
        status = "timeout" if -code == signal.SIGXCPU else "signalled"
    err_text = err.decode("utf-8", "replace")
    report = {
        "status": status,
        "exit_code": code,
        "signal": -code if code is not None and code < 0 else None,
        "time_s": round(elapsed, 4),
        "stdout": out.decode("utf-8", "replace"),
        "stderr": err_text[-2000:],
        "memory_error": "MemoryError" in err_text or "Cannot allocate memory" in err_text or "std::bad_alloc" in err_text,
    }
    with open(spec["report_path"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
