"""``code``: a programming problem with hidden stdin/stdout tests.

Instance (the loader turns Codeforces / Eurus / LiveCodeBench rows into this)::

    {"question": "Read two integers and print their sum.",
     "tests": [{"input": "1 2\\n", "output": "3\\n"}, ...],
     "settings": {"test_time_limit_s": 2.0}}      # optional overrides

The agent writes and runs code with ``bash`` and ``editor`` in a sandbox;
the solution is ``/work/solution.py`` (or, when the file is missing, the last
fenced Python block of the final turn). RUN saves it as the artifact
``output["solution"]``. EVAL runs the hidden tests (the first ``max_tests``,
50 by default), each in a fresh sandbox with no network under the per-test
time and memory limits (:mod:`prorl_cli.domains.code_judge`); reward 1.0
only when all of those pass.
``output["judge"]`` has the pass fraction, the first failing test's verdict
(WA, TLE, RE, MLE) and every test's verdict. Solutions are Python 3.
"""

from __future__ import annotations

import re

from prorl_cli.domains.code_judge import parse_tests, run_test, summarise
from prorl_cli.domains.sandbox_tools import BASH, EDITOR
from prorl_cli.exceptions import SandboxError
from prorl_cli.node.handler import AgentHandler, HandlerSettings, JobContext, final_text

SYSTEM = (
    "You solve programming problems in Python 3. Your program reads standard input and writes standard "
    "output. Write it to /work/solution.py (editor tool), test it with the bash tool, and finish with a turn "
    "that calls no tool."
)
# Fenced blocks, each from an opening fence line to the next closing one, so that the closing fence of a
# ```bash block is never read as the opening of a bare one.
FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)```", re.DOTALL | re.MULTILINE)
PYTHON_FENCES = ("", "python", "python3", "py", "py3")


def last_python_block(text: str) -> str | None:
    """The code of the last fenced block marked Python (``python``, ``py``, ``python3``, any case) or unmarked."""
    blocks = [code for lang, code in FENCE.findall(text) if lang.lower() in PYTHON_FENCES]
    return blocks[-1] if blocks else None


class CodeHandler(AgentHandler):
    """Programs judged on hidden tests, each in a fresh sandbox."""

    name = "code"
    defaults = HandlerSettings(
        max_turns=8, system_prompt=SYSTEM, tools=("bash", "editor"), image="python",
        init_timeout_s=120.0, run_timeout_s=900.0, eval_timeout_s=600.0, max_tokens=2048, tool_timeout_s=30.0,
        extra={"test_time_limit_s": 4.0, "test_mem_mb": 512, "max_tests": 50,
               "solution_path": "/work/solution.py"},
    )
    tools = (BASH, EDITOR)
    required_fields = ("question", "tests")

    async def init(self, ctx: JobContext) -> None:
        ctx.output["domain"] = self.name
        parse_tests(ctx.instance)  # bad tests fail INIT, not EVAL
        sandbox = await ctx.start_sandbox(network=False)
        await sandbox.bash("mkdir -p /work && cd /work")

    async def run(self, ctx: JobContext) -> None:
        traj = await ctx.agent(ctx.instance["question"])
        path = str(ctx.settings.get("solution_path"))
        try:
            ctx.output["solution"] = (await ctx.sandbox.read_file(path)).decode("utf-8", "replace")
            ctx.output["solution_source"] = path
        except SandboxError:
            block = last_python_block(final_text(traj))
            ctx.output["solution"] = block
            ctx.output["solution_source"] = "final message" if block is not None else None

    async def eval(self, ctx: JobContext) -> None:
        settings = ctx.settings
        program = ctx.output.get("solution")
        tests = parse_tests(ctx.instance)[: int(settings.get("max_tests"))]
        if not program:
            ctx.output["judge"] = {"passed": 0, "total": len(tests), "pass_fraction": 0.0,
                                   "first_failure": None, "tests": [], "note": "no solution"}
            ctx.reward = 0.0
            return
        verdicts = []
        for i, test in enumerate(tests):
            verdicts.append(await run_test(
                ctx, i, program, test, image=settings.image,
                time_limit_s=float(settings.get("test_time_limit_s")), mem_mb=int(settings.get("test_mem_mb")),
            ))
        ctx.output["judge"] = summarise(verdicts)
        ctx.reward = 1.0 if ctx.output["judge"]["passed"] == len(tests) else 0.0
