"""``swe``: SWE-bench-format instances, graded on FAIL_TO_PASS / PASS_TO_PASS the SWE-bench way.

Instance: a SWE-bench row (``instance_id``, ``repo``, ``base_commit``,
``problem_statement``, ``patch``, ``test_patch``, ``FAIL_TO_PASS``,
``PASS_TO_PASS``, ``version``), plus optionally ``repo_path`` (a git
repository on the node, cloned into the sandbox when the image does not
carry the project) and ``settings``.

The image is ``settings.repo_images`` by instance id, ``"<repo>@<version>"``
(``"<repo>@latest"`` for a row without a version, as ``build-images --swe``
keys it) or ``"<repo>"``,
else ``settings.image``; SWE-bench images keep the project in ``/testbed``.
INIT checks the repository out at ``base_commit`` and removes every commit,
ref and object later than it (``prorl_cli.swe.history``). RUN: the agent
works there with ``bash`` and ``editor``; then ``git diff`` against
``base_commit`` (new files included) is saved as ``output["model_patch"]``,
the only thing EVAL gets. EVAL starts a fresh sandbox from the same image,
applies the model patch and runs the instance's tests the way the instance,
the settings or swebench say (``prorl_cli.swe.testplan``); outcomes come
back by exact pytest node id and are graded with the ``swebench`` package
(``prorl_cli.swe.grading``): reward 1.0 only when every FAIL_TO_PASS test
passes and every PASS_TO_PASS test still passes. ``output["report"]`` holds
swebench's report fields plus ``missing`` (listed tests the run never
produced, with the closest id it did), each EVAL step's status and seconds,
and ``eval_timings``. A run that is no evidence about the patch (a setup step
that is not shell, fails or times out; no listed test collected; see
``prorl_cli.swe.grading``) is an ``infra_failure`` naming the step, its exit
status and output tail, and its reward is None (left out of training), never 0.
"""

from __future__ import annotations

import base64
import re
import shlex
from dataclasses import asdict
from typing import Any

from prorl_cli.domains.sandbox_tools import BASH, EDITOR
from prorl_cli.domains.swe_grading import test_list
from prorl_cli.exceptions import DomainError, SandboxError
from prorl_cli.node.handler import AgentHandler, HandlerSettings, JobContext
from prorl_cli.swe.images import repo_key
from prorl_cli.swe.workspace import apply_patch, prepare, run_tests

SYSTEM = (
    "You are a software engineer fixing an issue in the repository at {repo_dir}. Explore it with the bash "
    "tool, edit files with the editor tool, run the tests, and finish with a turn that calls no tool. "
    "Do not change the tests."
)


class SweHandler(AgentHandler):
    """Repository-level issue fixing, graded by the repository's own tests.

    A subclass (another agent on the same grading, say) gets its own task
    name, the snake-case of its class name without ``Handler``, unless it sets
    ``name``; it reads the ``handlers.swe`` settings unless it sets
    ``settings_section``.
    """

    name = "swe"
    settings_section = "swe"
    defaults = HandlerSettings(
        max_turns=30, system_prompt=SYSTEM, tools=("bash", "editor"), image="swe",
        init_timeout_s=300.0, run_timeout_s=3600.0, eval_timeout_s=1800.0, max_tokens=2048, tool_timeout_s=120.0,
        extra={"repo_dir": "/testbed", "repo_images": {}, "test_timeout_s": 900.0,
               "test_command": "", "eval_script": "", "install": "", "log_parser": "", "scrub_history": True},
    )
    tools = (BASH, EDITOR)
    required_fields = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            stem = cls.__name__.removesuffix("Handler") or cls.__name__
            cls.name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", stem).lower()

    def image_for(self, ctx: JobContext, settings: HandlerSettings) -> str | None:
        images: dict[str, Any] = settings.get("repo_images")
        inst = ctx.instance
        found = (images.get(str(inst["instance_id"])) or images.get(repo_key(inst))
                 or images.get(str(inst["repo"])))
        return str(found) if found else settings.image

    async def _sandbox(self, ctx: JobContext, settings: HandlerSettings, scrub: bool) -> Any:
        """A sandbox with the repository at ``base_commit``, a clean work tree and, when ``scrub``, no later history."""
        sandbox = await ctx.start_sandbox(image=self.image_for(ctx, settings), network=False,
                                          env={"PYTHONDONTWRITEBYTECODE": "1"})
        await prepare(sandbox, ctx.instance, str(settings.get("repo_dir")), scrub)
        return sandbox

    async def init(self, ctx: JobContext) -> None:
        ctx.output["domain"] = self.name
        settings = ctx.settings
        test_list(ctx.instance["FAIL_TO_PASS"], "FAIL_TO_PASS")
        test_list(ctx.instance["PASS_TO_PASS"], "PASS_TO_PASS")
        # The agent's sandbox (the job's first: ctx.sandbox): nothing after base_commit may reach it.
        sandbox = await self._sandbox(ctx, settings, scrub=bool(settings.get("scrub_history")))
        ctx.output["sandboxes"] = {"run": sandbox.sandbox_id}

    async def run(self, ctx: JobContext) -> None:
        settings = ctx.settings
        system = settings.system_prompt.replace("{repo_dir}", str(settings.get("repo_dir")))
        await ctx.agent(ctx.instance["problem_statement"], system=system)
        await self.save_patch(ctx, settings)

    async def save_patch(self, ctx: JobContext, settings: HandlerSettings) -> None:
        """``git diff`` of the work tree against ``base_commit`` (new files included) as ``output["model_patch"]``."""
        sandbox = ctx.sandbox
        repo_dir = shlex.quote(str(settings.get("repo_dir")))
        base = shlex.quote(str(ctx.instance["base_commit"]))
        diff = await sandbox.bash(f"cd {repo_dir} && git add -A && git diff --cached --binary {base} > /tmp/model.patch")
        if diff.exit_code != 0:
            # The sandbox's repository, not the instance: prorl swe validate counts it env-broken, not gold-fails.
            raise SandboxError(f"swe: git diff against base_commit failed: {diff.output[-1000:]}")
        raw = await sandbox.read_file("/tmp/model.patch")
        try:
            ctx.output["model_patch"] = raw.decode("utf-8")
        except UnicodeDecodeError:
            # A text file that is not UTF-8 (a Latin-1 source, a fixture): git diffs its bytes as they are. The
            # text is for people and predictions files; EVAL applies the exact bytes, which a decoded copy would
            # have lost (the patch would no longer apply and a correct fix would score 0).
            ctx.output["model_patch"] = raw.decode("utf-8", "replace")
            ctx.output["model_patch_base64"] = base64.b64encode(raw).decode("ascii")

    async def eval(self, ctx: JobContext) -> None:
        settings = ctx.settings
        patch: str | bytes | None = ctx.output.get("model_patch")
        if patch is not None and not isinstance(patch, str):
            raise DomainError("swe: RUN saved a model_patch that is not text")
        exact = ctx.output.get("model_patch_base64")
        if exact is not None:
            try:
                patch = base64.b64decode(exact, validate=True)
            except (TypeError, ValueError) as e:
                raise DomainError(f"swe: RUN saved a model_patch_base64 that is not base64: {e}") from e
        f2p = test_list(ctx.instance["FAIL_TO_PASS"], "FAIL_TO_PASS")
        p2p = test_list(ctx.instance["PASS_TO_PASS"], "PASS_TO_PASS")
        sandbox = await self._sandbox(ctx, settings, scrub=False)  # fresh: RUN's sandbox is gone, and so is the agent
        ctx.output.setdefault("sandboxes", {})["eval"] = sandbox.sandbox_id
        try:
            report, extra = await run_tests(sandbox, ctx.instance, settings.extra, patch, f2p, p2p,
                                            str(settings.get("repo_dir")), float(settings.get("test_timeout_s")))
        finally:
            await sandbox.stop()
        ctx.output["report"] = {**asdict(report), **extra}
        # A run that could not be graded is no evidence against the patch: no reward, not a 0.
        ctx.reward = None if report.infra_failure else (1.0 if report.resolved else 0.0)


class SweOracleHandler(SweHandler):
    """Task ``swe_oracle``: the gold ``patch`` in place of an agent (no model, no tokenizer).

    Validates a dataset and its images: every instance should come out
    resolved (``prorl eval --task swe_oracle DATASET``), as SWE-bench's own
    validation runs the gold patches.
    """

    uses_model = False

    async def run(self, ctx: JobContext) -> None:
        settings = ctx.settings
        gold = ctx.instance.get("patch")
        if not isinstance(gold, str) or not gold.strip():
            raise DomainError(f"{self.name}: instance {ctx.instance.get('instance_id')} has no gold 'patch'")
        sandbox = ctx.sandbox
        await sandbox.write_file("/tmp/gold.patch", gold.encode())
        # SWE-smith ships the patch that introduced the bug (patch_reverse): the fix is that patch reversed.
        # Applied as EVAL applies a patch (fuzz included): a gold patch EVAL would take is not "gold fails".
        reverse = ctx.instance.get("patch_reverse") is True
        applied, output = await apply_patch(sandbox, str(settings.get("repo_dir")), "/tmp/gold.patch",
                                            reverse=reverse)
        if not applied:
            how = (" reversed (patch_reverse: the row's patch is taken for the one that brought the bug in, as "
                   "SWE-smith's are; a row of another source read with --format swe-smith gets it too)"
                   if reverse else "")
            raise DomainError(f"{self.name}: the gold patch does not apply{how}: {output[-1000:]}")
        await sandbox.bash("rm -f /tmp/gold.patch")
        await self.save_patch(ctx, settings)
