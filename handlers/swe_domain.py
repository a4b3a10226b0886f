"""``swe``: SWE-bench-format instances, graded on FAIL_TO_PASS / PASS_TO_PASS the SWE-bench way.

Instance: a SWE-bench row (``instance_id``, ``repo``, ``base_commit``,
``problem_statement``, ``patch``, ``test_patch``, ``FAIL_TO_PASS``,
``PASS_TO_PASS``, ``version``), plus optionally ``repo_path`` (a git
repository on the node, cloned into the sandbox when the image does not
carry the project) and ``settings``.

The image is ``settings.repo_images["<repo>@<version>"]`` (or ``["<repo>"]``),
else ``settings.image``; SWE-bench images keep the project in ``/testbed``.
INIT checks the repository out at ``base_commit``. RUN: the agent works there
with ``bash`` and ``editor``; then ``git diff`` against ``base_commit`` (new
files included) is saved as ``output["model_patch"]``, the only thing EVAL
gets. EVAL starts a fresh sandbox from the same image, applies the model
patch and the test patch, runs the tests the test patch touches, parses the
log per test and grades it with the ``swebench`` package: reward 1.0 only
when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still
passes. ``output["report"]`` is the per-test report.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
from dataclasses import asdict
from typing import Any

from prorl_cli.domains.sandbox_tools import BASH, EDITOR
from prorl_cli.domains.swe_grading import grade, parse_pytest_log, test_list, test_targets
from prorl_cli.exceptions import DomainError
from prorl_cli.node.handler import AgentHandler, HandlerSettings, JobContext

SYSTEM = (
    "You are a software engineer fixing an issue in the repository at {repo_dir}. Explore it with the bash "
    "tool, edit files with the editor tool, run the tests, and finish with a turn that calls no tool. "
    "Do not change the tests."
)


def _bundle(repo_path: str) -> bytes:
    """A git bundle of every ref of the node-local repository at ``repo_path``."""
    try:
        return subprocess.run(["git", "-C", repo_path, "bundle", "create", "-", "--all"], check=True,
                              capture_output=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise DomainError(f"swe: cannot bundle repo_path {repo_path!r}: {e}") from e


class SweHandler(AgentHandler):
    """Repository-level issue fixing, graded by the repository's own tests."""

    name = "swe"
    defaults = HandlerSettings(
        max_turns=30, system_prompt=SYSTEM, tools=("bash", "editor"), image="swe",
        init_timeout_s=300.0, run_timeout_s=3600.0, eval_timeout_s=1800.0, max_tokens=2048,
        extra={"repo_dir": "/testbed", "repo_images": {}, "tool_timeout_s": 120.0, "test_timeout_s": 900.0,
               "test_command": "python3 -m pytest -rA -p no:cacheprovider"},
    )
    tools = (BASH, EDITOR)
    required_fields = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")

    def image_for(self, ctx: JobContext, settings: HandlerSettings) -> str | None:
        images: dict[str, Any] = settings.get("repo_images")
        inst = ctx.instance
        found = images.get(f"{inst['repo']}@{inst.get('version')}") or images.get(str(inst["repo"]))
        return str(found) if found else settings.image

    async def _sandbox(self, ctx: JobContext, settings: HandlerSettings) -> Any:
        """A sandbox with the repository at ``base_commit`` and a clean work tree."""
        sandbox = await ctx.start_sandbox(image=self.image_for(ctx, settings), network=False,
                                          env={"PYTHONDONTWRITEBYTECODE": "1"})
        repo_dir = shlex.quote(str(settings.get("repo_dir")))
        base = shlex.quote(str(ctx.instance["base_commit"]))
        if ctx.instance.get("repo_path"):
            bundle = await asyncio.to_thread(_bundle, str(ctx.instance["repo_path"]))
            await sandbox.write_file("/tmp/repo.bundle", bundle)
            cloned = await sandbox.bash(f"rm -rf {repo_dir} && git clone -q /tmp/repo.bundle {repo_dir} 2>&1")
            if cloned.exit_code != 0:
                raise DomainError(f"swe: cloning repo_path into the sandbox failed: {cloned.output[-1000:]}")
        ready = await sandbox.bash(
            f"cd {repo_dir} && git -c advice.detachedHead=false checkout -q -f {base} 2>&1 && git clean -fdq 2>&1"
        )
        if ready.exit_code != 0:
            raise DomainError(f"swe: cannot check out base_commit {ctx.instance['base_commit']} in "
                              f"{settings.get('repo_dir')}: {ready.output[-1000:]}")
        return sandbox

    async def init(self, ctx: JobContext) -> None:
        ctx.output["domain"] = self.name
        settings = ctx.settings
        test_list(ctx.instance["FAIL_TO_PASS"], "FAIL_TO_PASS")
        test_list(ctx.instance["PASS_TO_PASS"], "PASS_TO_PASS")
        await ctx.chat()
        ctx.state["sandbox"] = await self._sandbox(ctx, settings)
        ctx.output["sandboxes"] = {"run": ctx.state["sandbox"].sandbox_id}

    async def run(self, ctx: JobContext) -> None:
        settings = ctx.settings
        sandbox = ctx.state["sandbox"]
        system = settings.system_prompt.replace("{repo_dir}", str(settings.get("repo_dir")))
        await ctx.agent(ctx.instance["problem_statement"], system=system)
        repo_dir = shlex.quote(str(settings.get("repo_dir")))
        base = shlex.quote(str(ctx.instance["base_commit"]))
        diff = await sandbox.bash(f"cd {repo_dir} && git add -A && git diff --cached --binary {base} > /tmp/model.patch")
        if diff.exit_code != 0:
            raise DomainError(f"swe: git diff against base_commit failed: {diff.output[-1000:]}")
        ctx.output["model_patch"] = (await sandbox.read_file("/tmp/model.patch")).decode("utf-8", "replace")

    async def eval(self, ctx: JobContext) -> None:
        settings = ctx.settings
        patch = ctx.output.get("model_patch")
        if not isinstance(patch, str):
            raise DomainError("swe: RUN saved no model_patch")
        f2p = test_list(ctx.instance["FAIL_TO_PASS"], "FAIL_TO_PASS")
        p2p = test_list(ctx.instance["PASS_TO_PASS"], "PASS_TO_PASS")
        sandbox = await self._sandbox(ctx, settings)  # fresh: RUN's sandbox is gone
        ctx.output.setdefault("sandboxes", {})["eval"] = sandbox.sandbox_id
        try:
            repo_dir = shlex.quote(str(settings.get("repo_dir")))
            if patch.strip():
                await sandbox.write_file("/tmp/model.patch", patch.encode())
                applied = await sandbox.bash(f"cd {repo_dir} && git apply --whitespace=nowarn /tmp/model.patch 2>&1")
                if applied.exit_code != 0:
                    ctx.output["report"] = {"resolved": False, "status": "PATCH_APPLY_FAILED", "log": applied.output[-2000:]}
                    ctx.reward = 0.0
                    return
            await sandbox.write_file("/tmp/test.patch", str(ctx.instance["test_patch"]).encode())
            applied = await sandbox.bash(f"cd {repo_dir} && git apply --whitespace=nowarn /tmp/test.patch 2>&1")
            if applied.exit_code != 0:
                raise DomainError(f"swe: the instance's test_patch does not apply: {applied.output[-1000:]}")
            files = " ".join(shlex.quote(f) for f in test_targets(str(ctx.instance["test_patch"]), f2p, p2p))
            timeout_s = float(settings.get("test_timeout_s"))
            ran = await sandbox.bash(f"cd {repo_dir} && {settings.get('test_command')} {files} > /tmp/test.log 2>&1",
                                     timeout_s=timeout_s)
            log = (await sandbox.read_file("/tmp/test.log")).decode("utf-8", "replace")
        finally:
            await sandbox.stop()
        report = grade(parse_pytest_log(log), f2p, p2p)
        ctx.output["report"] = {**asdict(report), "tests_timed_out": ran.timed_out, "log_tail": log[-3000:]}
        ctx.reward = 1.0 if report.resolved else 0.0
