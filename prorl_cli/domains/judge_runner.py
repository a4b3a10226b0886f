"""Runs one program on one test input inside a sandbox, under time and memory limits.

Copied into the sandbox and run with its python3 (standard library only,
Python 3.8+). Usage: ``python3 judge_runner.py SPEC.json``; writes the JSON
report ``{status, exit_code, signal, time_s, stdout, stderr, memory_error}``
to the spec's ``report_path``,
where ``status`` is ``exited``, ``timeout`` or ``signalled``. The program runs
in its own process group, which is killed whole at the time limit.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import time


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
        status = "exited"
        try:
            out, err = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            status = "timeout"
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    elapsed = time.monotonic() - started
    code = proc.returncode
    if status == "exited" and code is not None and code < 0:
        status = "timeout" if -code == signal.SIGXCPU else "signalled"
    err_text = err.decode("utf-8", "replace")
    report = {
        "status": status,
        "exit_code": code,
        "signal": -code if code is not None and code < 0 else None,
        "time_s": round(elapsed, 4),
        "stdout": out[:max_out].decode("utf-8", "replace"),
        "stderr": err_text[-2000:],
        "memory_error": "MemoryError" in err_text or "Cannot allocate memory" in err_text or "std::bad_alloc" in err_text,
    }
    with open(spec["report_path"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
