"""The built-in agent handlers with a model client that raises on the second model call.

Each ``<task>_failing`` runs the real handler's INIT and RUN; only the
second ``generate`` of RUN raises (a non-inference error, which the agent
loop re-raises), so RUN fails in the middle of its loop. The domain tests
serve this file with ``node.handler_paths``.
"""

from __future__ import annotations

from typing import Any

from prorl_cli.handlers.code_domain import CodeHandler
from prorl_cli.handlers.math_agent import MathAgentHandler
from prorl_cli.handlers.math_domain import MathHandler
from prorl_cli.handlers.search_domain import SearchHandler
from prorl_cli.handlers.swe_domain import SweHandler
from prorl_cli.inference.contract import Generation
from prorl_cli.node.handler import JobContext, Services
from prorl_cli.protocol import SamplingParams


class _FailOnSecondCall(Services):
    def __init__(self, inner: Services) -> None:
        self.inner = inner
        self.calls = 0

    async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("the model client fell over on call 2")
        return await self.inner.generate(ctx, prompt_ids, sampling)

    async def start_sandbox(self, ctx: JobContext, **options: Any) -> Any:
        return await self.inner.start_sandbox(ctx, **options)


class _FailsInRun:
    async def run(self, ctx: JobContext) -> None:
        ctx.services = _FailOnSecondCall(ctx.services)
        await super().run(ctx)  # type: ignore[misc]


class MathFailing(_FailsInRun, MathHandler):
    name = "math_failing"


class CodeFailing(_FailsInRun, CodeHandler):
    name = "code_failing"


class SweFailing(_FailsInRun, SweHandler):
    name = "swe_failing"


class SearchFailing(_FailsInRun, SearchHandler):
    name = "search_failing"


class MathAgentFailing(_FailsInRun, MathAgentHandler):
    name = "math_agent_failing"
