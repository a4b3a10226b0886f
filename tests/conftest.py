"""Shared test setup.

Under ``PRORL_REQUIRE_ALL=1`` (set by CI) a skipped test is a failure: a
green CI must mean every tier (Apptainer, bubblewrap, vLLM, ...) really ran.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.testing.scripted import TEST_IMAGES
from tests.harness import need_module

REQUIRE_ALL = os.environ.get("PRORL_REQUIRE_ALL") == "1"

# A suite started in the background by a shell without job control (`cmd &` in a script, nohup) inherits SIGINT
# ignored, and so would every process it starts: the tests that press Ctrl-C on prorl need it as a terminal has it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: The CPU seconds each test used, its own and its reaped children's (``PRORL_CPU_REPORT=N``: the top N, at the end).
#: CI's lanes share the machine's cores, so CPU, not wall time, is what a test costs the others.
CPU_REPORT = int(os.environ.get("PRORL_CPU_REPORT", "0") or 0)
_cpu_s: dict[str, float] = {}


def _cpu_now() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not CPU_REPORT:
        yield
        return
    before = _cpu_now()
    yield
    _cpu_s[item.nodeid] = _cpu_now() - before


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _cpu_s:
        return
    terminalreporter.section(f"most CPU: the top {CPU_REPORT} of {sum(_cpu_s.values()):.0f} CPU s "
                             "(each test's own and its reaped children's, setup and teardown included)")
    for nodeid, cpu_s in sorted(_cpu_s.items(), key=lambda kv: -kv[1])[:CPU_REPORT]:
        terminalreporter.write_line(f"{cpu_s:8.1f} CPU s  {nodeid}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under PRORL_REQUIRE_ALL=1 (a component is missing): {reason}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2 model and BPE tokenizer, made offline once per session."""
    need_module("torch", "cpu")
    from prorl_cli.inference.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def domain_image() -> str:
    """The domain test image: python3, sympy, pytest and git (46-domain-images.sh)."""
    if shutil.which("apptainer") is None:
        pytest.skip("apptainer is not installed (scripts/provision/30-apptainer.sh)")
    path = TEST_IMAGES / "domains.sif"
    if not path.is_file():
        pytest.skip(f"{path} missing (run scripts/provision/46-domain-images.sh as root)")
    return str(path)
