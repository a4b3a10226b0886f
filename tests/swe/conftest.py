"""Fixtures of the SWE tests."""

from __future__ import annotations

import shutil

import pytest

from prorl_cli.testing.scripted import TEST_IMAGES
from tests.harness import need_module


@pytest.fixture(scope="session")
def domain_image() -> str:
    """The domain test image (python3, pytest, git: 46-domain-images.sh), for grading in a real sandbox."""
    need_module("swebench", "swe")
    if shutil.which("apptainer") is None:
        pytest.skip("apptainer is not installed (scripts/provision/30-apptainer.sh)")
    path = TEST_IMAGES / "domains.sif"
    if not path.is_file():
        pytest.skip(f"{path} missing (run scripts/provision/46-domain-images.sh as root)")
    return str(path)
