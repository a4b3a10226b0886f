"""The DAPO sampler tests' deployment: a real broker and one node (8/16/8 stage slots), one per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import Deployment


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    dep = Deployment(tmp_path_factory.mktemp("dapo"), "dapo", {"node": {"n_init": 8, "n_run": 16, "n_eval": 8}})
    with dep:
        dep.start_broker()
        dep.start_node("n1")
        yield dep
