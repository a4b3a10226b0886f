"""The broker's allocator setting (``prorl_cli/broker/allocator.py``): big buffers freed go back to the system.

The same allocation pattern as the broker's under load (results of 256 KB received, retained, dropped, with
small long-lived blocks allocated in between), in a fresh interpreter, with and without the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prorl_cli.broker.allocator import ENV_OVERRIDE, fix_mmap_threshold
from tests.harness import REPO

PATTERN = """
import json, sys
from prorl_cli.broker.allocator import fix_mmap_threshold
fixed = fix_mmap_threshold() if sys.argv[1] == "fix" else False
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
big = bytearray(8 << 20); del big      # one big block freed: glibc raises its mmap threshold to 8 MiB
before = rss_mb()
results, small = [], []
for i in range(400):                   # 100 MB of 256 KB results, small blocks kept in between
    results.append(bytearray(256 * 1024))
    small.append(bytearray(1024))
del results
print(json.dumps({"fixed": fixed, "kept_mb": rss_mb() - before}))
"""


def _kept_mb(mode: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != ENV_OVERRIDE}
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True, check=True,
                         timeout=60, env={**env, "PYTHONPATH": str(REPO)})
    result: dict[str, float] = json.loads(out.stdout)
    return result


def test_freed_results_go_back_to_the_system_with_the_fixed_threshold() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the setting is for glibc on Linux")
    fixed = _kept_mb("fix")
    if not fixed["fixed"]:
        pytest.skip("this libc has no mallopt(M_MMAP_THRESHOLD) (not glibc)")
    unfixed = _kept_mb("none")
    # Without it, glibc keeps the freed 100 MB in its heap (the pattern is a real trap); with it, they are gone.
    assert unfixed["kept_mb"] > 50, unfixed
    assert fixed["kept_mb"] < 10, fixed


def test_an_operator_setting_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_OVERRIDE, "65536")
    assert fix_mmap_threshold() is False
