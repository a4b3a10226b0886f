"""A second local user for tests that must not run as root: the unprivileged test user
(``scripts/provision/40-testuser.sh``) with the world-readable Python of ``scripts/provision/55-user-python.sh``,
running a copy of this tree it can read, in a folder of its own."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_USER = "prorl-test"
USER_PYTHON = Path(os.environ.get("PRORL_USER_VENV", "/opt/prorl-venv")) / "bin" / "python"


class OtherUser:
    """Runs Python as the test user, with a copy of this tree it can read (``root/tree``), in ``root``."""

    def __init__(self, root: Path, user: str) -> None:
        self.root = root
        self.user = user
        self.home = root / "home"

    def run(self, *args: str, timeout_s: float = 120, background: bool = False) -> Any:
        pw = pwd.getpwnam(self.user)
        env = [f"HOME={pw.pw_dir}", f"USER={self.user}", "PATH=/usr/local/bin:/usr/bin:/bin",
               f"PYTHONPATH={self.root / 'tree'}", f"PRORL_HOME={self.home}", "LANG=C.UTF-8", "COLUMNS=250"]
        cmd = ["runuser", "-u", self.user, "--", "env", "-i", *env, str(USER_PYTHON), *args]
        if background:
            log = (self.root / "broker.log").open("wb")
            return subprocess.Popen(cmd, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return subprocess.run(cmd, cwd=self.root, capture_output=True, text=True, timeout=timeout_s, check=False)


def other_user(tree: tuple[str, ...] = ("prorl_cli",)) -> Iterator[OtherUser]:
    """The test user, with ``tree`` (folders of this repository) copied where it can read them; for a fixture.

    Skips when this process is not root or the user or its Python is missing.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as a second local user")
    try:
        pw = pwd.getpwnam(TEST_USER)
    except KeyError:
        pytest.skip(f"test user {TEST_USER} missing (run scripts/provision/40-testuser.sh as root)")
    if not USER_PYTHON.exists():
        pytest.skip(f"{USER_PYTHON} missing: a Python the user can run (run scripts/provision/55-user-python.sh)")
    # Under /tmp, not pytest's folder: that one is root's alone.
    root = Path(tempfile.mkdtemp(prefix="prorl-users-"))
    root.chmod(0o755)
    for folder in tree:
        shutil.copytree(REPO / folder, root / "tree" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["chmod", "-R", "a+rX", str(root / "tree")], check=True)
    user = OtherUser(root, TEST_USER)
    user.home.mkdir()
    os.chown(user.home, pw.pw_uid, pw.pw_gid)
    try:
        yield user
    finally:
        shutil.rmtree(root, ignore_errors=True)
