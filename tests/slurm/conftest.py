"""Fixtures of the Slurm tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prorl_cli.slurm import squeue
from tests.slurm.cluster import require_slurm


@pytest.fixture
def jobs() -> Iterator[list[str]]:
    """Slurm jobs this test submits, each cancelled at the end."""
    require_slurm()
    submitted: list[str] = []
    yield submitted
    squeue.cancel_until_gone(submitted, 60)
