"""``prorl quickstart`` as the README and its ``--help`` describe it: options that only a task domain run or a
model engine uses are refused, before anything starts, when the run would not use them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def quickstart(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prorl_cli", "quickstart", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("args", "flags"), [
    (["--image", "my.sif"], "--image applies"),
    (["--instances", "3"], "--instances applies"),
    (["--engine", "none", "--image", "my.sif", "--instances", "1"], "--image and --instances apply"),
])
def test_options_of_a_task_domain_run_without_task_are_refused_naming_the_fix(
    tmp_path: Path, args: list[str], flags: str
) -> None:
    """``--help`` says "With --task:" for --image and --instances; without --task they were ignored silently."""
    out = tmp_path / "qs"
    r = quickstart(out, *args)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{flags} to a task domain run only: add --task math" in r.stderr
    assert not out.exists()  # refused before the output folder, a broker or a node


def test_a_model_for_an_engine_that_runs_none_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "qs"
    r = quickstart(out, "--engine", "sim", "--model", str(model))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "--engine sim runs no model" in r.stderr and "drop --model" in r.stderr
    assert not out.exists()


def _has_sandbox_images() -> bool:
    """--image matters where the quickstart runs Apptainer or bubblewrap (the local runtime takes no image)."""
    return shutil.which("apptainer") is not None or shutil.which("bwrap") is not None


@pytest.mark.skipif(not _has_sandbox_images(), reason="neither Apptainer nor bubblewrap: the local runtime takes no image")
def test_a_task_domain_image_that_is_not_there_is_refused_before_the_run(tmp_path: Path) -> None:
    """--image names a path or a built image; one that is neither failed every job in INIT after the stack came up."""
    home = tmp_path / "home"
    env = {**os.environ, "PRORL_HOME": str(home)}
    for image, says in ((str(tmp_path / "missing.sif"), "no such file or folder"),
                        ("nosuch", f"is not in {home / 'images' / 'manifest.json'}")):
        r = subprocess.run([sys.executable, "-m", "prorl_cli", "quickstart", "--task", "math", "--image", image,
                            "--out", str(tmp_path / "qs")], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"--image {image}: " in r.stderr and says in r.stderr, r.stderr
        assert "broker up" not in r.stdout


def test_an_image_for_the_search_domain_which_starts_no_sandbox_is_refused(tmp_path: Path) -> None:
    r = quickstart(tmp_path / "qs", "--task", "search", "--image", "my.sif")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "--task search starts no sandbox" in r.stderr and "drop --image" in r.stderr
    assert "broker up" not in r.stdout
