"""Fixtures of the domain tests: the tiny tokenizer, the domain image, deployments with a scripted model.

Model turns are decided by each test (``ScriptedModel.script``) and served by
a real inference bridge (``tests/domains/scripted_engine.py``), so every turn
goes node -> broker -> bridge and back. Sandboxes are real Apptainer ones on
the domain test image (``scripts/provision/46-domain-images.sh``).
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

from tests.harness import REPO, Deployment, need_module

IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))


@pytest.fixture(scope="session")
def domain_image() -> str:
    """The domain test image: python3, sympy, pytest and git (46-domain-images.sh)."""
    if shutil.which("apptainer") is None:
        pytest.skip("apptainer is not installed (scripts/provision/30-apptainer.sh)")
    path = IMAGES / "domains.sif"
    if not path.is_file():
        pytest.skip(f"{path} missing (run scripts/provision/46-domain-images.sh as root)")
    return str(path)


def turn(text: str = "", *calls: tuple[str, dict[str, Any]]) -> str:
    """An assistant turn: ``text`` then Hermes tool calls."""
    parts = [text] if text else []
    parts += [f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls]
    return "\n".join(parts)


class ScriptedStack:
    """A deployment (broker, one node) plus a scripted model bridge."""

    def __init__(self, d: Deployment, tiny_model: Path, script_path: Path) -> None:
        self.d = d
        self.tiny_model = tiny_model
        self.script_path = script_path
        self.script: list[dict[str, Any]] = []

    def add(self, match: str, *turns: str) -> None:
        """Script the turns of every job whose prompt contains ``match`` (call ``start_model`` after)."""
        self.script.append({"match": match, "turns": list(turns)})

    def start_model(self) -> None:
        """Publish the script; start the model bridge unless it already runs (the stack is shared)."""
        tmp = self.script_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.script))
        tmp.replace(self.script_path)  # the engine re-reads it whole
        if "model" in self.d.procs:
            return
        with open(self.d.logs / "model.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.domains.scripted_engine", str(self.script_path), str(self.tiny_model),
                 "scripted", str(self.d.deployment_dir)],
                env={**self.d.env(), "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=REPO,
            )
        self.d.procs["model"] = proc  # stopped by Deployment.close with the rest
        self.d.wait_for(lambda st: any(b["backend_id"] == "scripted" and b["alive"] for b in st.backends), 60,
                        "the scripted model to register", "model")

    def run(self, task: str, instances: list[Any], timeout_s: float = 180) -> list[Any]:
        client = self.d.client
        ids = client.submit(task, instances, timeout_s=120)
        results = client.wait(ids, timeout_s=timeout_s)
        by_id = {r.job_id: r for r in results}
        return [by_id[i] for i in ids]


@pytest.fixture(scope="session")
def _shared_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, domain_image: str) -> Iterator[ScriptedStack]:
    tmp_path = tmp_path_factory.mktemp("domains")
    config = {
        "sandbox": {"runtime": "apptainer", "image": domain_image, "local_dir": str(tmp_path / "sb")},
        "inference": {"tokenizer": str(tiny_model), "generate_timeout_s": 60.0},
        "jobs": {"timeout_s": 240.0},
        "node": {"n_init": 4, "n_run": 8, "n_eval": 4},
        "domains": {name: {"image": domain_image} for name in ("math", "code", "swe")},
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
