"""The tests' view of :mod:`prorl_cli.testing` (real local deployments), plus pytest-only helpers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from prorl_cli.testing import (
    DEFAULT_TEST_CONFIG,
    TEST_HANDLERS,
    Deployment,
    bare_dealer,
    fixed_port,
)

REPO = Path(__file__).resolve().parent.parent

__all__ = ["DEFAULT_TEST_CONFIG", "REPO", "TEST_HANDLERS", "Deployment", "bare_dealer", "fixed_port", "need_module"]


def need_module(module: str, extra: str) -> None:
    """Skip the calling test, naming the extra to install, when ``module`` is not importable."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install 'prorl[{extra}]'; scripts/install.sh does it)")
