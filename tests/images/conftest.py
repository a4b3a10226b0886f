"""Fixtures for the image builder tests: a workspace with its own prorl.yaml, image list and cache.

Every ``prorl`` call is a real child process (``python -m prorl_cli``) in its
own process group; tests that start one in the background stop it
themselves (SIGTERM, then SIGKILL) and only ever signal what they started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from prorl_cli.processes import stop_group
from tests.harness import TEST_BUILD_ARGS

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RECIPES = HERE / "recipes"
TOOL_SERVER = REPO / "prorl_cli" / "sandbox" / "toolserver.py"


def apptainer_missing() -> str | None:
    """Why real builds cannot run here, or None."""
    if shutil.which("apptainer") is None:
        return "apptainer is not installed (scripts/provision/30-apptainer.sh installs it)"
    if not Path("/bin/busybox").is_file():
        return "busybox-static is not installed (the scratch test images copy /bin/busybox)"
    return None


needs_apptainer = pytest.mark.skipif(apptainer_missing() is not None, reason=apptainer_missing() or "")


class Workspace:
    """A folder with prorl.yaml, images.yaml and a cache dir."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache = root / "cache"
        self.images: dict[str, Any] = {}
        self.settings: dict[str, Any] = {
            "cache_dir": str(self.cache),
            "recipe_dirs": [str(RECIPES)],
            "config_file": str(root / "images.yaml"),
            "build_args": TEST_BUILD_ARGS,
        }

    def write(self, images: dict[str, Any] | None = None, **settings: Any) -> None:
        if images is not None:
            self.images = images
        self.settings.update(settings)
        (self.root / "images.yaml").write_text(yaml.safe_dump({"images": self.images}))
        (self.root / "prorl.yaml").write_text(yaml.safe_dump({"images": self.settings}))

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "prorl_cli", "--config", str(self.root / "prorl.yaml"), *args]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
        env["COLUMNS"] = "250"  # rich wraps at 80 columns without a terminal
        return env

    def prorl(self, *args: str, check: bool = True, timeout_s: float = 240,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``prorl ARGS`` in the workspace (``env``: variables on top of the workspace's)."""
        proc = subprocess.run(self.argv(*args), cwd=self.root, env={**self.env(), **(env or {})}, capture_output=True,
                              text=True, timeout=timeout_s, start_new_session=True)
        if check and proc.returncode != 0:
            raise AssertionError(f"prorl {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def build(self, *args: str) -> dict[str, dict[str, Any]]:
        """``prorl build-images --json ARGS``: results by image name."""
        out = self.prorl("build-images", "--json", *args)
        return {r["name"]: r for r in json.loads(out.stdout)}

    def dry_run(self, *args: str) -> dict[str, dict[str, Any]]:
        out = self.prorl("build-images", "--dry-run", "--json", *args)
        return {r["name"]: r for r in json.loads(out.stdout)}

    def start(self, *args: str) -> subprocess.Popen[str]:
        """A background ``prorl`` in its own process group (stop it with :func:`stop`)."""
        return subprocess.Popen(self.argv(*args), cwd=self.root, env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def manifest(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.cache / "manifest.json").read_text())
        return data


def stop(proc: subprocess.Popen[str], grace_s: float = 10) -> None:
    """SIGTERM then SIGKILL the process group of a child this test started."""
    stop_group(proc, grace_s)


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    w = Workspace(tmp_path)
    (tmp_path / "data.txt").write_text("one\n")
    w.write({"tiny": {"template": "busybox.def.j2", "base": "scratch", "files": ["data.txt:/data.txt"]}})
    yield w
