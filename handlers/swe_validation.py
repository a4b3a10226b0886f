"""``swe_no_fix``: an SWE instance's tests with its test patch alone, the baseline ``prorl swe validate`` runs.

``swe_oracle`` (in ``swe_domain.py``) tests the gold patch; this task tests
the repository at ``base_commit`` as it is: RUN changes nothing, so the
model patch is empty and EVAL applies the instance's ``test_patch`` alone
and runs the tests. Every FAIL_TO_PASS test must fail here, or the instance
does not test its fix (``prorl_cli/swe/validation.py`` classifies the runs).
"""

from __future__ import annotations

from prorl_cli.handlers.swe_domain import SweHandler
from prorl_cli.node.handler import JobContext


class SweNoFixHandler(SweHandler):
    """Task ``swe_no_fix``: no agent and no gold patch; the empty diff of the untouched repository is graded."""

    uses_model = False

    async def run(self, ctx: JobContext) -> None:
        # The diff of the work tree INIT checked out is the empty patch; saved the way any RUN saves its patch.
        await self.save_patch(ctx, ctx.settings)
