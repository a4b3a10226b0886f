"""The ``code`` domain: hidden tests in fresh sandboxes, verdicts WA / TLE / RE / MLE, pass fraction."""

from __future__ import annotations

import json
import os
from pathlib import Path

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

