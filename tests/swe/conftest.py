"""Fixtures of the SWE tests."""

from __future__ import annotations

import pytest

from tests.harness import need_module


@pytest.fixture(scope="session")
def domain_image(domain_image: str) -> str:
    """The domain test image (tests/conftest.py), and swebench, which grading here needs."""
    need_module("swebench", "swe")
    return domain_image
