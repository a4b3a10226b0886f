"""The tests' view of :mod:`prorl_cli.testing` (real local deployments), plus pytest-only helpers."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from prorl_cli.testing import (
    DEFAULT_TEST_CONFIG,
    TEST_HANDLERS,
    Deployment,
    bare_dealer,
    fixed_port,
    next_message,
)

REPO = Path(__file__).resolve().parent.parent
#: ``images.build_args`` for the images tests build: squashing a ~130 MB tree with apptainer's default gzip
#: costs ~25 CPU-seconds, with lz4 under one (the image is ~1.5x larger, which a throwaway test image can afford).
TEST_BUILD_ARGS = ["--mksquashfs-args", "-comp lz4"]

__all__ = ["DEFAULT_TEST_CONFIG", "REPO", "TEST_BUILD_ARGS", "TEST_HANDLERS", "Deployment", "bare_dealer", "fixed_port",
           "image_build_config", "need_module", "next_message", "one_node_deployment", "kill_if_running"]


def kill_if_running(proc: subprocess.Popen[Any]) -> None:
    """A test's ``finally`` for a child it started in a session of its own (``start_new_session=True``): whatever
    the test's path, nothing of it is left running (its process group killed, the child reaped)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def one_node_deployment(tmp_path_factory: pytest.TempPathFactory, name: str, config: dict[str, Any] | None = None,
                        node_args: tuple[str, ...] = ()) -> Iterator[Deployment]:
    """A module fixture's body: a broker and one node ``n1`` (started with ``node_args``) of a deployment ``name``
    under a fresh folder, closed after the module: ``yield from one_node_deployment(tmp_path_factory, "x")``."""
    d = Deployment(tmp_path_factory.mktemp(name) / "home", name, config)
    try:
        d.start_broker()
        d.start_node("n1", *node_args)
        yield d
    finally:
        d.close()


def need_module(module: str, extra: str) -> None:
    """Skip the calling test, naming the extra to install, when ``module`` is not importable."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'prorl[{extra}]'; scripts/install.sh does it)")


def image_build_config(folder: Path) -> Path:
    """A prorl.yaml in ``folder`` that builds images with :data:`TEST_BUILD_ARGS` (pass it as ``--config``)."""
    path = folder / "prorl.yaml"
    path.write_text(yaml.safe_dump({"images": {"build_args": TEST_BUILD_ARGS}}))
    return path
