"""Fixtures of the domain tests: the tiny tokenizer, the domain image, deployments with a scripted model.

Model turns are decided by each test (``ScriptedModel.script``) and served by
a real inference bridge (:mod:`prorl_cli.testing.scripted_engine`), so every turn
goes node -> broker -> bridge and back. Sandboxes are real Apptainer ones on
the domain test image (``scripts/provision/46-domain-images.sh``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_cli.testing.scripted import TEST_IMAGES, ScriptedStack, turn
from tests.harness import Deployment, need_module

IMAGES = TEST_IMAGES
__all__ = ["IMAGES", "ScriptedStack", "turn"]


@pytest.fixture(scope="session")
def _shared_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, domain_image: str) -> Iterator[ScriptedStack]:
    tmp_path = tmp_path_factory.mktemp("domains")
    config = {
        "sandbox": {"runtime": "apptainer", "image": domain_image, "local_dir": str(tmp_path / "sb")},
        "inference": {"tokenizer": str(tiny_model), "generate_timeout_s": 60.0},
        "jobs": {"timeout_s": 240.0},
        # A cancelled job's result is its node's when it comes within this grace (else the broker's, without
        # output): what these tests check is that the node's partial trajectory is kept, not how fast a node
        # stops its job on a 2-core machine running the Slurm tier beside it.
        "broker": {"cancel_result_grace_s": 30.0},
        "node": {"n_init": 4, "n_run": 8, "n_eval": 4,
                 "handler_paths": [str(Path(__file__).with_name("failing_handlers.py"))]},
        "handlers": {name: {"image": domain_image} for name in ("math", "code", "swe")},
    }
    d = Deployment(tmp_path / "home", "dom", config=config)
    try:
        d.start_broker()
        d.start_node("n1")
        yield ScriptedStack(d, tiny_model, tmp_path / "script.json")
    finally:
        d.close()


@pytest.fixture
def stack(_shared_stack: ScriptedStack) -> ScriptedStack:
    """Broker + node (Apptainer sandboxes on the domain image) + scripted model, shared by the tier's tests
    (starting them is most of a small test's time); script turns with ``add``, then call ``start_model``."""
    need_module("math_verify", "domains")
    return _shared_stack
