"""The swe domain's work inside sandboxes: the repository at ``base_commit`` (past only), and the graded test run."""

from __future__ import annotations

import asyncio
import shlex
import time
from typing import Any

from prorl_cli.exceptions import DomainError
from prorl_cli.swe.evalrun import (
    LOG,
    NODEIDS,
    RUN,
    STEPS,
    TEST_PATCH,
    WORK,
    plan_steps,
    read_steps,
    run_script,
    support_files,
)
from prorl_cli.swe.grading import SweReport, grade_run
from prorl_cli.swe.history import bundle_base, scrub_script
from prorl_cli.swe.testplan import plan_tests

SCRUB_TIMEOUT_S = 900.0
#: Tried in order, as swebench's harness does: a strict apply, then GNU patch with fuzz.
APPLY_COMMANDS = ("git apply --whitespace=nowarn {patch}", "patch --batch --fuzz=5 -p1 -i {patch}")


async def prepare(sandbox: Any, instance: dict[str, Any], repo_dir: str, scrub: bool) -> None:
    """Put the repository at ``base_commit`` with a clean work tree, holding no later history when ``scrub``.

    A ``repo_path`` instance gets a bundle of ``base_commit``'s history alone;
    a repository the image carries is scrubbed in place (see :mod:`prorl_cli.swe.history`).
    """
    repo, base = shlex.quote(repo_dir), str(instance["base_commit"])
    if instance.get("repo_path"):
        bundle = await asyncio.to_thread(bundle_base, str(instance["repo_path"]), base)
        await sandbox.write_file(f"{WORK}/repo.bundle", bundle)
        cloned = await sandbox.bash(
            f"rm -rf {repo} && git clone -q -b main {WORK}/repo.bundle {repo} 2>&1 && rm -f {WORK}/repo.bundle")
        if cloned.exit_code != 0:
            raise DomainError(f"swe: cloning repo_path into the sandbox failed: {cloned.output[-1000:]}")
    ready = await sandbox.bash(
        f"cd {repo} && git -c advice.detachedHead=false checkout -q -f {shlex.quote(base)} 2>&1 && git clean -fdq 2>&1")
    if ready.exit_code != 0:
        raise DomainError(f"swe: cannot check out base_commit {base} in {repo_dir}: {ready.output[-1000:]}")
    if scrub:
        await sandbox.write_file(f"{WORK}/scrub.sh", scrub_script(repo_dir, base).encode())
        done = await sandbox.bash(f"bash {WORK}/scrub.sh 2>&1; status=$?; rm -f {WORK}/scrub.sh; exit $status",
                                  timeout_s=SCRUB_TIMEOUT_S)
        if done.exit_code != 0 or done.timed_out:
            raise DomainError(f"swe: removing history after base_commit failed: {done.output[-1000:]}")


async def _apply(sandbox: Any, repo_dir: str, path: str) -> tuple[bool, str]:
    outputs = []
    for command in APPLY_COMMANDS:
        done = await sandbox.bash(f"cd {shlex.quote(repo_dir)} && {command.format(patch=path)} 2>&1")
        if done.exit_code == 0:
            return True, done.output
        outputs.append(done.output[-1000:])
    return False, "\n".join(outputs)


async def run_tests(sandbox: Any, instance: dict[str, Any], settings: dict[str, Any], patch: str | None,
                    fail_to_pass: list[str], pass_to_pass: list[str], repo_dir: str,
                    timeout_s: float) -> tuple[SweReport, dict[str, Any]]:
    """Apply ``patch`` (and the test patch unless the plan's eval script does), run the steps, grade them.

    Returns the report and what a person debugging the run wants (command, log tail, timeout, and
    ``eval_timings``: seconds to apply the patches and to run the steps).
    """
    plan = plan_tests(instance, settings, fail_to_pass, pass_to_pass)
    extra: dict[str, Any] = {"test_command": plan.script, "log_parser_source": plan.log_parser_source}
    if patch is None:
        return SweReport(patch_is_None=True, test_source=plan.source), extra
    timings: dict[str, float] = {}
    extra["eval_timings"] = timings
    started = time.monotonic()
    for path, data in support_files().items():
        await sandbox.write_file(path, data)
    if patch.strip():
        await sandbox.write_file(f"{WORK}/model.patch", patch.encode())
        ok, output = await _apply(sandbox, repo_dir, f"{WORK}/model.patch")
        if not ok:
            extra["log_tail"] = output[-3000:]
            return SweReport(patch_exists=True, test_source=plan.source, status="PATCH_APPLY_FAILED"), extra
    if not plan.applies_test_patch:
        await sandbox.write_file(TEST_PATCH, str(instance.get("test_patch", "")).encode())
        if str(instance.get("test_patch", "")).strip():
            ok, output = await _apply(sandbox, repo_dir, TEST_PATCH)
            if not ok:
                raise DomainError(f"swe: the instance's test_patch does not apply: {output[-1000:]}")
    timings["apply_s"] = round(time.monotonic() - started, 3)
    await sandbox.write_file(RUN, run_script(plan, repo_dir).encode())
    started = time.monotonic()
    ran = await sandbox.bash(f": > {NODEIDS}; : > {STEPS}; bash {RUN} > {LOG} 2>&1", timeout_s=timeout_s)
    timings["run_s"] = round(time.monotonic() - started, 3)
    log = (await sandbox.read_file(LOG)).decode("utf-8", "replace")
    records = (await sandbox.read_file(NODEIDS)).decode("utf-8", "replace")
    step_records = (await sandbox.read_file(STEPS)).decode("utf-8", "replace")
    steps = read_steps(plan_steps(plan), step_records, log, bool(ran.timed_out))
    report = grade_run(plan, instance, fail_to_pass, pass_to_pass, log, records, steps)
    extra.update(tests_timed_out=ran.timed_out, log_tail=log[-3000:])
    return report, extra
