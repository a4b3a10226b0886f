"""Judging a program against hidden stdin/stdout tests, each in a fresh sandbox.

Every test starts its own sandbox (network off), writes the program and the
input, runs :mod:`prorl_cli.domains.judge_runner` there under the per-test
time and memory limits, and stops the sandbox, so nothing a test leaves
running survives it. Output is compared with whitespace-normalised matching,
token by token; where the expected token is a real number (``0.333333``)
any value within 1e-6 (absolute or relative) is accepted.
Verdicts: ``AC`` accepted, ``WA`` wrong answer, ``TLE`` time limit, ``MLE``
memory limit, ``RE`` runtime error.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import DomainError
from prorl_cli.node.handler import JobContext

RUNNER = Path(__file__).with_name("judge_runner.py")
VERDICT_NAMES = {
    "AC": "accepted", "WA": "wrong answer", "TLE": "time limit exceeded",
    "MLE": "memory limit exceeded", "RE": "runtime error",
}


@dataclass(frozen=True)
class TestCase:
    input: str
    output: str


@dataclass
class TestVerdict:
    """The outcome of one hidden test."""

    index: int
    verdict: str  # a key of VERDICT_NAMES
    time_s: float
    exit_code: int | None
    detail: str  # stderr tail, or the first differing line


def normalise_output(text: str) -> list[list[str]]:
    """Lines of whitespace-separated tokens, trailing blank lines dropped."""
    lines = [line.split() for line in text.strip().splitlines()]
    return [line for line in lines if line] if lines else []


# A real number in the expected output ("0.333333", "1.5e-3"): the problem's checker accepts any value within
# FLOAT_TOLERANCE (absolute or relative), as Codeforces-style checkers of real outputs do; integers and words
# must match exactly.
_DECIMAL = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?\d+[eE][-+]?\d+")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
FLOAT_TOLERANCE = 1e-6


def same_token(got: str, want: str) -> bool:
    """Does the output token ``got`` match the expected ``want`` (real numbers within ``FLOAT_TOLERANCE``)?"""
    if got == want:
        return True
    if not (_DECIMAL.fullmatch(want) and _NUMBER.fullmatch(got)):
        return False
    g, w = float(got), float(want)
    return math.isfinite(g) and abs(g - w) <= FLOAT_TOLERANCE * max(1.0, abs(w))


def same_line(got: list[str], want: list[str]) -> bool:
    """Token by token (:func:`same_token`)."""
    return len(got) == len(want) and all(same_token(g, w) for g, w in zip(got, want, strict=True))


def classify(report: dict[str, Any], expected: str) -> tuple[str, str]:
    """``(verdict, detail)`` from the runner's report."""
    stderr = str(report.get("stderr", ""))
    if report["status"] == "timeout":
        return "TLE", f"killed after {report['time_s']:.2f} s"
    if report.get("memory_error"):
        return "MLE", stderr[-500:]
    if report["status"] == "signalled":
        # A program at its address-space limit often dies of SIGSEGV/SIGABRT instead of a MemoryError.
        return ("MLE" if report.get("signal") in (6, 11) and "Error" not in stderr else "RE"), f"signal {report.get('signal')}: {stderr[-500:]}"
    if report["exit_code"] != 0:
        return "RE", f"exit {report['exit_code']}: {stderr[-500:]}"
    got, want = normalise_output(str(report["stdout"])), normalise_output(expected)
    if len(got) == len(want) and all(same_line(g, w) for g, w in zip(got, want, strict=True)):
        return "AC", ""
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if not same_line(g, w):
            return "WA", f"line {i + 1}: expected {' '.join(w)!r}, got {' '.join(g)!r}"
    return "WA", f"expected {len(want)} line(s), got {len(got)}"


def parse_tests(instance: dict[str, Any]) -> list[TestCase]:
    """Hidden tests from ``tests: [{input, output}]`` (the loaders turn public shapes into this)."""
    tests = instance.get("tests")
    if not isinstance(tests, list) or not tests:
        raise DomainError("code: instance needs 'tests', a non-empty list of {input, output}")
    out = []
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
            raise DomainError(f"code: tests[{i}] must be {{input: str, output: str}}, got {t!r}")
        out.append(TestCase(t["input"], t["output"]))
    return out


def runner_spec(test: TestCase, *, time_limit_s: float, mem_mb: int, workdir: str = "/work",
                command: list[str] | None = None) -> dict[str, Any]:
    """The :mod:`judge_runner` spec of one test, its files in ``workdir``.

    The runner keeps the first ``max_output_bytes`` of the program's output: room for twice the expected
    output (at least 1 MiB), so a right answer longer than 1 MiB is read whole, not cut to a wrong one.
    """
    return {"command": command or ["python3", f"{workdir}/solution.py"], "stdin_path": f"{workdir}/input.txt",
            "time_limit_s": time_limit_s, "mem_mb": mem_mb, "cwd": workdir, "report_path": f"{workdir}/report.json",
            "max_output_bytes": max(1 << 20, 2 * len(test.output.encode()) + 4096)}


async def run_test(
    ctx: JobContext, index: int, program: str, test: TestCase, *, image: str | None, time_limit_s: float, mem_mb: int
) -> TestVerdict:
    """One test in a fresh sandbox with no network; the sandbox is stopped before this returns."""
    options: dict[str, Any] = {"network": False}
    if image:
        options["image"] = image
    sandbox = await ctx.start_sandbox(**options)
    try:
        await sandbox.write_file("/work/solution.py", program.encode())
        await sandbox.write_file("/work/input.txt", test.input.encode())
        await sandbox.write_file("/work/judge_runner.py", RUNNER.read_bytes())
        spec = runner_spec(test, time_limit_s=time_limit_s, mem_mb=mem_mb)
        await sandbox.write_file("/work/judge.json", json.dumps(spec).encode())
        ran = await sandbox.bash("python3 /work/judge_runner.py /work/judge.json", timeout_s=time_limit_s + 30)
        if ran.timed_out or ran.exit_code != 0:
            raise DomainError(f"code: the judge runner failed on test {index}: {ran.output[-1000:]}")
        report = json.loads(await sandbox.read_file("/work/report.json"))
    finally:
        await sandbox.stop()
    verdict, detail = classify(report, test.output)
    return TestVerdict(index, verdict, float(report["time_s"]), report["exit_code"], detail)


def summarise(verdicts: list[TestVerdict]) -> dict[str, Any]:
    """Pass fraction, the first failing test's verdict, and every test's verdict."""
    passed = sum(v.verdict == "AC" for v in verdicts)
    first = next((v for v in verdicts if v.verdict != "AC"), None)
    return {
        "passed": passed,
        "total": len(verdicts),
        "pass_fraction": passed / len(verdicts) if verdicts else 0.0,
        "first_failure": None if first is None else {**asdict(first), "name": VERDICT_NAMES[first.verdict]},
        "tests": [asdict(v) for v in verdicts],
    }
