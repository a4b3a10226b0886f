"""A deployment plus a scripted model: tests and benchmarks decide every model turn.

Model turns are served by a real inference bridge
(:mod:`prorl_cli.testing.scripted_engine`), so every turn goes node -> broker
-> bridge and back through the real generate contract.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from prorl_cli.testing.harness import Deployment

#: Where scripts/provision puts the test images (domains.sif, python.sif, python-rootfs).
TEST_IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))


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
                [sys.executable, "-m", "prorl_cli.testing.scripted_engine", str(self.script_path), str(self.tiny_model),
                 "scripted", str(self.d.deployment_dir)],
                env=self.d.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.d.procs["model"] = proc  # stopped by Deployment.close with the rest
        self.d.wait_for(lambda st: any(b.backend_id == "scripted" and b.alive for b in st.backends), 180,
                        "the scripted model to register", "model")

    def run(self, task: str, instances: list[Any], timeout_s: float = 180) -> list[Any]:
        client = self.d.client
        ids = client.submit(task, instances, timeout_s=120)
        results = client.wait(ids, timeout_s=timeout_s)
        by_id = {r.job_id: r for r in results}
        return [by_id[i] for i in ids]
