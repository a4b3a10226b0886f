"""A cache one user builds and another may only read (an admin's, shared on a cluster): its finished images are
used as they are, and a build it would need is refused naming the cache and the fix (real second user, real
``apptainer build``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.harness import TEST_BUILD_ARGS
from tests.other_user import OtherUser, other_user

from .conftest import RECIPES, needs_apptainer

pytestmark = [needs_apptainer, pytest.mark.apptainer]


@pytest.fixture
def user() -> Iterator[OtherUser]:
    yield from other_user(("prorl_cli", "sif_recipes"))  # the shipped templates' includes too


def _build(who: OtherUser | None, config: Path) -> tuple[int, dict[str, dict[str, object]], str]:
    """``build-images --json tiny`` as ``who`` (root when None): its exit code, results by name, stderr."""
    args = ["-m", "prorl_cli", "--config", str(config), "build-images", "--json", "tiny"]
    if who is not None:
        proc = who.run(*args, timeout_s=300)
    else:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=False,
                              env={**os.environ, "COLUMNS": "250"})
    results = {r["name"]: r for r in json.loads(proc.stdout)} if proc.stdout.strip().startswith("[") else {}
    return proc.returncode, results, proc.stderr


def test_a_cache_another_user_may_only_read(user: OtherUser) -> None:
    shared = user.root
    shutil.copytree(RECIPES, shared / "recipes")
    subprocess.run(["chmod", "-R", "a+rX", str(shared / "recipes")], check=True)
    (shared / "data.txt").write_text("one\n")
    (shared / "images.yaml").write_text(yaml.safe_dump(
        {"images": {"tiny": {"template": "busybox.def.j2", "base": "scratch", "files": ["data.txt:/data.txt"]}}}))
    config = shared / "prorl.yaml"
    config.write_text(yaml.safe_dump({"images": {"cache_dir": str(shared / "cache"), "recipe_dirs": [str(shared / "recipes")],
                                                 "config_file": str(shared / "images.yaml"),
                                                 "build_args": TEST_BUILD_ARGS}}))
    code, built, err = _build(None, config)  # the owner builds it (a 0755 cache: others read)
    assert code == 0 and built["tiny"]["action"] == "built", err
    subprocess.run(["chmod", "-R", "a+rX", str(shared / "cache")], check=True)
    code, used, err = _build(user, config)
    assert code == 0, err
    assert used["tiny"]["action"] == "reused" and used["tiny"]["path"] == built["tiny"]["path"]
    assert "read-only cache: used as it is" in used["tiny"]["reasons"], used
    # A change that needs a build there: refused naming the cache and how to get one of one's own.
    (shared / "data.txt").write_text("two\n")
    code, failed, err = _build(user, config)
    assert code != 0 and failed["tiny"]["action"] == "failed", (failed, err)
    error = str(failed["tiny"]["error"])
    assert f"the image cache {shared / 'cache'} is not writable by this user" in error, error
    assert "images.cache_dir" in error and "chmod 2775" in error
