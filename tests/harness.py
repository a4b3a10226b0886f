"""The tests' view of :mod:`prorl_cli.testing` (real local deployments), plus pytest-only helpers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
           "image_build_config", "need_module", "next_message"]


def need_module(module: str, extra: str) -> None:
    """Skip the calling test, naming the extra to install, when ``module`` is not importable."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'prorl[{extra}]'; scripts/install.sh does it)")


def image_build_config(folder: Path) -> Path:
    """A prorl.yaml in ``folder`` that builds images with :data:`TEST_BUILD_ARGS` (pass it as ``--config``)."""
    path = folder / "prorl.yaml"
    path.write_text(yaml.safe_dump({"images": {"build_args": TEST_BUILD_ARGS}}))
    return path
