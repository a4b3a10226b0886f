"""``math_format``: ``math_agent`` with partial credit for following the tool protocol.

Same instance, agent loop, calculator and output as ``math_agent``; only the
reward differs:

* 1.0: the final answer's last number equals ``answer`` (``math_agent``'s reward);
* 0.5: wrong number, but the episode followed the protocol: a calculator call
  whose result was a number, then an answer turn that ended by itself and
  states a number;
* 0.0: anything else (no call, a malformed call, a calculator error, no answer).

Why it exists: the tiny GRPO example (``examples/train_tiny_grpo.py``) needs
a reward a 2-layer, 128-wide model can improve in a few RL steps on a CPU.
Exact answers need the model to copy digits across the tool turn, which the
tiny model learns abruptly (or not at all) during supervised warm-up, never in
a few policy-gradient steps; the protocol is what a short warm-up teaches
only partly and RL then visibly improves (``docs/training.md``).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from prorl_cli.agent import Trajectory
from prorl_cli.node.handler import JobContext


def _math_agent() -> ModuleType:
    """The sibling ``math_agent`` module, as the handler registry loaded it (or loaded here the same way)."""
    name = "prorl_handlers.math_agent"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("math_agent.py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {Path(__file__).with_name('math_agent.py')}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_MA = _math_agent()
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def protocol_followed(traj: Trajectory) -> bool:
    """A numeric calculator result, then an answer turn that stopped by itself and states a number."""
    tool_results = [m.get("content", "") for m in traj.messages if m.get("role") == "tool"]
    if not tool_results or not all(_NUMBER.fullmatch(str(r).strip()) for r in tool_results):
        return False
    return traj.stop_reason == "stop" and len(traj.calls) >= 2 and _MA.final_number(traj.calls[-1].text) is not None


class MathFormatHandler(_MA.MathAgentHandler):  # type: ignore[misc,name-defined]
    """``math_agent`` with 0.5 for a well-formed tool episode whose answer is wrong."""

    name = "math_format"

    async def eval(self, ctx: JobContext) -> None:
        await super().eval(ctx)
        if not ctx.reward and protocol_followed(Trajectory.from_dict(ctx.output["trajectory"])):
            ctx.reward = 0.5


__all__ = ["MathFormatHandler", "protocol_followed"]
