"""``scripted_swe``: a subclass of swe (so ``prorl eval`` takes it) that runs no sandbox and no model.

Its instance's ``script`` says, by sample number (the ``K`` of ``RUN-DIGEST-K``, attempts ``-aN`` aside)::

    {"resolved": [0, 1],      # samples whose EVAL reports resolved
     "raise": [1],            # samples whose RUN raises
     "hold": [1],             # samples whose RUN waits while the file "gate" exists
     "gate": "/path/gate",
     "journal": "/path/dir"}  # RUN appends its job id to journal/runs.log
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

from prorl_cli.handlers.swe_domain import SweHandler
from prorl_cli.node.handler import JobContext


def _script(ctx: JobContext) -> tuple[int, dict[str, Any]]:
    """The sample number of this job and its instance's script."""
    match = re.search(r"-(\d+)(?:-a\d+)?$", ctx.job_id)
    if match is None:
        raise ValueError(f"job id {ctx.job_id!r} is not RUN-DIGEST-K")
    return int(match.group(1)), dict(ctx.instance.get("script") or {})


class ScriptedSweHandler(SweHandler):
    """Grades by its instance's script; INIT does nothing."""

    name = "scripted_swe"
    uses_model = False

    async def init(self, ctx: JobContext) -> None:
        return None

    async def run(self, ctx: JobContext) -> None:
        k, script = _script(ctx)
        if script.get("journal"):
            with open(Path(script["journal"]) / "runs.log", "a") as f:
                f.write(ctx.job_id + "\n")
        if k in script.get("hold", []):
            gate = Path(script["gate"])
            # A file, not an event: the test process that opens the gate is not this node's.
            while gate.exists():
                await asyncio.sleep(0.05)
        if k in script.get("raise", []):
            raise RuntimeError("scripted failure")
        ctx.output["model_patch"] = "diff --git a/x b/x\n"

    async def eval(self, ctx: JobContext) -> None:
        k, script = _script(ctx)
        ok = k in script.get("resolved", [])
        ctx.output["report"] = {"patch_is_None": False, "patch_exists": True, "patch_successfully_applied": True,
                                "resolved": ok, "infra_failure": False}
        ctx.reward = 1.0 if ok else 0.0
