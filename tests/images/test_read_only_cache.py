"""A cache one user builds and another may only read (an admin's, shared on a cluster): its finished images are
used as they are, and a build it would need is refused naming the cache and the fix (real second user, real
``apptainer build``)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.harness import TEST_BUILD_ARGS

from .conftest import RECIPES, REPO, needs_apptainer

pytestmark = [needs_apptainer, pytest.mark.apptainer]

TEST_USER = "prorl-test"
USER_PYTHON = Path(os.environ.get("PRORL_USER_VENV", "/opt/prorl-venv")) / "bin" / "python"


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user can read (pytest's own is root's alone), with a readable copy of this tree."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as a second local user")
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        pytest.skip(f"test user {TEST_USER} missing (run scripts/provision/40-testuser.sh as root)")
    if not USER_PYTHON.exists():
        pytest.skip(f"{USER_PYTHON} missing: a Python the user can run (run scripts/provision/55-user-python.sh)")
    root = Path(tempfile.mkdtemp(prefix="prorl-rocache-"))
    root.chmod(0o755)
    shutil.copytree(REPO / "prorl_cli", root / "tree" / "prorl_cli", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "sif_recipes", root / "tree" / "sif_recipes")  # the shipped templates' includes
    shutil.copytree(RECIPES, root / "recipes")
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _build(root: Path, config: Path, *, as_user: bool) -> tuple[int, dict[str, dict[str, object]], str]:
    args = ["-m", "prorl_cli", "--config", str(config), "build-images", "--json", "tiny"]
    if as_user:
        pw = pwd.getpwnam(TEST_USER)
        env = [f"HOME={pw.pw_dir}", f"USER={TEST_USER}", "PATH=/usr/local/bin:/usr/bin:/bin",
               f"PYTHONPATH={root / 'tree'}", "LANG=C.UTF-8", "COLUMNS=250"]
        cmd = ["runuser", "-u", TEST_USER, "--", "env", "-i", *env, str(USER_PYTHON), *args]
    else:
        cmd = [str(Path(os.sys.executable)), *args]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, check=False,
                          env=None if as_user else {**os.environ, "COLUMNS": "250"})
    results = {r["name"]: r for r in json.loads(proc.stdout)} if proc.stdout.strip().startswith("[") else {}
    return proc.returncode, results, proc.stderr


def test_a_cache_another_user_may_only_read(shared: Path) -> None:
    (shared / "data.txt").write_text("one\n")
    (shared / "images.yaml").write_text(yaml.safe_dump(
        {"images": {"tiny": {"template": "busybox.def.j2", "base": "scratch", "files": ["data.txt:/data.txt"]}}}))
    config = shared / "prorl.yaml"
    config.write_text(yaml.safe_dump({"images": {"cache_dir": str(shared / "cache"), "recipe_dirs": [str(shared / "recipes")],
                                                 "config_file": str(shared / "images.yaml"),
                                                 "build_args": TEST_BUILD_ARGS}}))
    code, built, err = _build(shared, config, as_user=False)  # the owner builds it (a 0755 cache: others read)
    assert code == 0 and built["tiny"]["action"] == "built", err
    subprocess.run(["chmod", "-R", "a+rX", str(shared / "cache")], check=True)
    code, used, err = _build(shared, config, as_user=True)
    assert code == 0, err
    assert used["tiny"]["action"] == "reused" and used["tiny"]["path"] == built["tiny"]["path"]
    assert "read-only cache: used as it is" in used["tiny"]["reasons"], used
    # A change that needs a build there: refused naming the cache and how to get one of one's own.
    (shared / "data.txt").write_text("two\n")
    code, failed, err = _build(shared, config, as_user=True)
    assert code != 0 and failed["tiny"]["action"] == "failed", (failed, err)
    error = str(failed["tiny"]["error"])
    assert f"the image cache {shared / 'cache'} is not writable by this user" in error, error
    assert "images.cache_dir" in error and "chmod 2775" in error
