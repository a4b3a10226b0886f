"""The ``code`` domain: hidden tests in fresh sandboxes, verdicts WA / TLE / RE / MLE, pass fraction."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from prorl_cli.domains.code_judge import RUNNER
from tests.domains.conftest import ScriptedStack, turn

TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -3\n", "output": "7\n"}, {"input": "0 0\n", "output": "0\n"}]
RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"
PROGRAMS = {
    "C-wrong": "a, b = map(int, input().split())\nprint(a - b if a > 5 else a + b)\n",
    "C-loop": "import sys\nif sys.stdin.read().startswith('10'):\n    while True:\n        pass  # MARK-INFINITE-LOOP\nprint(3)\n",
    "C-crash": "raise SystemExit(3)\n",
    "C-memory": "x = bytearray(1 << 34)\nprint(len(x))\n",
}


def _running_with(marker: str) -> list[int]:
    """Pids of processes whose command line or files mention ``marker`` (none may outlive its sandbox)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd:
            found.append(int(pid))
    return found


def test_code_handler_verdicts(stack: ScriptedStack) -> None:
    # The right program is written with the editor and tried with bash; the others come as a final code block.
    stack.add("C-right", turn("", ("editor", {"command": "create", "path": "/work/solution.py", "file_text": RIGHT})),
              turn("", ("bash", {"command": "echo '4 5' | python3 /work/solution.py"}),
                   ("editor", {"command": "str_replace", "path": "/work/solution.py", "old_str": "nope", "new_str": "x"})),
              "Done.")
    for key, program in PROGRAMS.items():
        stack.add(key, f"Here it is:\n```python\n{program}```")
    stack.start_model()
    settings = {"test_time_limit_s": 1.0, "test_mem_mb": 256}
    one_test = {"C-crash", "C-memory"}  # one hidden test is enough to see these verdicts
    right, wrong, loop, crash, memory, bad = stack.run("code", [
        {"question": f"{key}: print a + b", "tests": TESTS[:1] if key in one_test else TESTS, "settings": settings}
        for key in ["C-right", *PROGRAMS]
    ] + [{"question": "x", "tests": [{"input": "1"}]}])
    assert right.reward == 1.0, right
    tools = [m["content"] for m in right.output["trajectory"]["messages"] if m["role"] == "tool"]
    assert tools[1].strip() == "9"  # bash ran the file the editor wrote
    assert "error" in tools[2] and "does not occur" in tools[2]  # a failed edit is an observation; the loop went on
    assert right.output["solution"] == RIGHT and right.output["solution_source"] == "/work/solution.py"
    judge = right.output["judge"]
    assert judge["passed"] == 3 and judge["pass_fraction"] == 1.0 and judge["first_failure"] is None

    expected = {"WA": wrong, "TLE": loop, "RE": crash, "MLE": memory}
    for verdict, result in expected.items():
        assert result.reward == 0.0, result
        first = result.output["judge"]["first_failure"]
        assert first is not None and first["verdict"] == verdict, json.dumps(result.output["judge"], indent=1)
    assert wrong.output["judge"]["passed"] == 2 and wrong.output["judge"]["first_failure"]["index"] == 1
    assert loop.output["judge"]["passed"] == 1 and loop.output["judge"]["tests"][1]["verdict"] == "TLE"
    assert crash.output["judge"]["tests"][0]["exit_code"] == 3
    # The infinite loop was killed at its limit, and its sandbox left nothing behind.
    assert _running_with("MARK-INFINITE-LOOP") == []
    records = stack.d.deployment_dir / "nodes" / "n1" / "sandboxes"
    assert list(records.glob("*.json")) == []
    # A malformed instance fails INIT with an error naming the field.
    assert bad.critical_error == "init" and bad.reward == 0.0
    assert "tests[0] must be {input: str, output: str}" in bad.output["failure"]["message"]



def test_a_program_whose_descendant_leaves_its_group_still_times_out(tmp_path: Path) -> None:
    """A descendant in a session of its own keeps the output pipes open past the group's SIGKILL: the
    runner reports the time limit rather than waiting on it (the judge would fail the job, not score it)."""
    pid_file = tmp_path / "escaped.pid"
    program = tmp_path / "solution.py"
    program.write_text(
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(300)\n"
        "    os._exit(0)\n"
        "time.sleep(300)\n"
    )
    (tmp_path / "input.txt").write_text("")
    spec = {"command": [sys.executable, str(program)], "stdin_path": str(tmp_path / "input.txt"),
            "time_limit_s": 1.0, "mem_mb": 512, "cwd": str(tmp_path), "report_path": str(tmp_path / "report.json")}
    (tmp_path / "judge.json").write_text(json.dumps(spec))
    try:
        subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "judge.json")], check=True, timeout=60)
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["status"] == "timeout", report
        escaped = int(pid_file.read_text())
        os.kill(escaped, 0)  # still running: the runner did not wait for it
    finally:
        if pid_file.is_file():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_program_printing_without_end_does_not_fill_the_runners_memory(tmp_path: Path) -> None:
    """The runner keeps only what its report holds (it read gigabytes into memory within a time limit)."""
    program = tmp_path / "solution.py"
    program.write_text("import sys\nchunk = b'x' * 65536\nwhile True:\n    sys.stdout.buffer.write(chunk)\n")
    (tmp_path / "input.txt").write_text("")
    spec = {"command": [sys.executable, str(program)], "stdin_path": str(tmp_path / "input.txt"),
            "time_limit_s": 1.0, "mem_mb": 256, "cwd": str(tmp_path), "report_path": str(tmp_path / "report.json"),
            "max_output_bytes": 1000}
    (tmp_path / "judge.json").write_text(json.dumps(spec))

    def cap_memory() -> None:  # the runner's own address space: far below what the program prints in a second
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "judge.json")], check=True, timeout=60,
                   preexec_fn=cap_memory)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "timeout" and report["stdout"] == "x" * 1000, {**report, "stdout": "..."}
