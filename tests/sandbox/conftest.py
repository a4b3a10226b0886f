"""Fixtures for the sandbox tests: the test images, the unprivileged user, scenario runs.

Rootless behaviour is what matters on clusters, so the Apptainer and
bubblewrap scenarios (``tests/sandbox/scenarios.py``) run as the
unprivileged test user that ``scripts/provision/40-testuser.sh`` creates,
with the system python3, on images from ``45-test-images.sh``. Anything
missing makes the tests skip with the reason (a failure under
PRORL_REQUIRE_ALL=1).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))
TEST_USER = "prorl-test"
SYSTEM_PYTHON = "/usr/bin/python3"


def _image(name: str) -> str:
    path = IMAGES / name
    if not path.exists():
        pytest.skip(f"test image {path} missing (run scripts/provision/45-test-images.sh as root)")
    return str(path)


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """Paths of the cached test images."""
    return {
        "sif": _image("python.sif"),
        "dir": _image("python"),
        "rootfs": _image("python-rootfs"),
        "busybox": _image("busybox.sif"),
    }


@pytest.fixture(scope="session")
def need_apptainer() -> None:
    if shutil.which("apptainer") is None:
        pytest.skip("apptainer is not installed (scripts/provision/30-apptainer.sh)")


@pytest.fixture(scope="session")
def need_bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/provision/20-bwrap.sh)")


class ScenarioRunner:
    """Runs ``tests/sandbox/scenarios.py`` scenarios as the unprivileged user."""

    def __init__(self, root: Path, user: str | None) -> None:
        self.root = root  # a copy of the package the user can read
        self.user = user  # None: already unprivileged, run as ourselves
        self._n = 0

    def state_dir(self) -> Path:
        """A fresh node run directory owned by the scenario's user."""
        self._n += 1
        path = self.root / "state" / f"node-{self._n}"
        path.mkdir(parents=True)
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            os.chown(path, pw.pw_uid, pw.pw_gid)
        return path

    def argv(self, name: str, args: dict[str, Any]) -> list[str]:
        cmd = [SYSTEM_PYTHON, "-m", "tests.sandbox.scenarios", name, json.dumps(args)]
        if args.get("nohup"):  # hangups ignored from the start, as for a node run under nohup
            cmd = ["nohup", *cmd]
        if self.user is None:
            return cmd
        return ["runuser", "-u", self.user, "--", "env", f"PYTHONPATH={self.root}", *cmd]

    def popen(self, name: str, args: dict[str, Any]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(name, args), cwd=self.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(self.root)},
        )

    def run(self, name: str, config: dict[str, Any], timeout_s: float = 240.0, **extra: Any) -> dict[str, Any]:
        """Run a scenario to completion; return its JSON observations."""
        args = {"config": config, "state_dir": str(self.state_dir()), **extra}
        proc = self.popen(name, args)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"scenario {name} ran past {timeout_s} s; stderr:\n{err[-3000:]}") from None
        if proc.returncode != 0 or not out.strip():
            raise AssertionError(f"scenario {name} failed (exit {proc.returncode}); stderr:\n{err[-5000:]}")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result


@pytest.fixture(scope="session")
def scenarios() -> Iterator[ScenarioRunner]:
    """Scenario runner; as root it runs them as the unprivileged test user."""
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"{SYSTEM_PYTHON} is missing (the unprivileged user runs the system python)")
    user: str | None = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(TEST_USER)
        except KeyError:
            pytest.skip(f"test user {TEST_USER} missing (run scripts/provision/40-testuser.sh as root)")
        user = TEST_USER
    root = Path(tempfile.mkdtemp(prefix="prorl-sbtest-"))
    os.chmod(root, 0o755)
    # A copy the test user can read (the checkout may sit under /root).
    shutil.copytree(REPO / "prorl_cli", root / "prorl_cli", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests" / "sandbox").mkdir(parents=True)
    for rel in ("tests/__init__.py", "tests/sandbox/__init__.py", "tests/sandbox/scenarios.py"):
        shutil.copy(REPO / rel, root / rel)
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    yield ScenarioRunner(root, user)
    shutil.rmtree(root)
