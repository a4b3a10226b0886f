"""``prorl trace -o`` and ``prorl report --html`` replace their output whole: a write that fails keeps the last one."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.observe.conftest import ObservedRun

#: Bytes a process may write to one file: less than a trace or a report of the observed run.
_SMALL_FILE_BYTES = 4096


def _small_files_only() -> None:
    """In the child: a write past the limit fails with EFBIG (SIGXFSZ ignored), as on a full disk."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (_SMALL_FILE_BYTES, _SMALL_FILE_BYTES))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@pytest.mark.parametrize("args", [("trace", "-o"), ("report", "--html")], ids=["trace", "report"])
def test_a_failed_write_keeps_the_last_good_output(observed_run: ObservedRun, args: tuple[str, str],
                                                   tmp_path: Path) -> None:
    command, flag = args
    out = tmp_path / f"{command}.out"
    good = observed_run.prorl(command, str(observed_run.results_path), flag, str(out))
    assert good.returncode == 0, good.stderr
    last = out.read_bytes()
    assert len(last) > _SMALL_FILE_BYTES
    d = observed_run.deployment
    failed = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", d.name, command,
                             str(observed_run.results_path), flag, str(out)],
                            env={**d.env(), "COLUMNS": "200"}, capture_output=True, text=True, timeout=120,
                            cwd=d.home, preexec_fn=_small_files_only)
    assert failed.returncode != 0
    assert "File too large" in failed.stderr
    assert out.read_bytes() == last
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
