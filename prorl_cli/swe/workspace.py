"""The swe domain's work inside sandboxes: the repository at ``base_commit`` (past only), and the graded test run."""

from __future__ import annotations

import asyncio
import re
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
    StepOutcome,
    plan_steps,
    read_steps,
    run_script,
    support_files,
)
from prorl_cli.swe.grading import NO_TESTS_COLLECTED, SweReport, grade_run
from prorl_cli.swe.history import bundle_base, scrub_script
from prorl_cli.swe.testplan import TestPlan, plan_tests

SCRUB_TIMEOUT_S = 900.0
#: Tried in order, as swebench's harness does: a strict apply, then GNU patch with fuzz. ``{reverse}`` is each
#: tool's own reverse flag or nothing. No ``.orig`` backups: a fuzzed apply would otherwise leave one in the work
#: tree, and the gold run's ``git add -A`` diff would carry it into the patch EVAL grades.
#: How a patch is applied (as swebench's harness does: git apply, else GNU patch with fuzz). ``--forward``: a
#: patch that looks reversed or already applied is refused; under ``--batch`` alone GNU patch would apply it the
#: other way without a word (a fix taken for a bug's patch would be applied as a fix, and graded as one).
APPLY_COMMANDS = ("git apply{reverse} --whitespace=nowarn {patch}",
                  "patch --batch --forward --fuzz=5 -p1 --no-backup-if-mismatch{reverse} -i {patch}")
REVERSE_FLAGS = (" --reverse", " -R")


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
    else:
        present = await sandbox.bash(f"git -C {repo} rev-parse --git-dir 2>&1")
        if present.exit_code != 0:
            # The image is not the instance's (none in repo_images for it, so the settings' default image ran).
            raise DomainError(
                f"swe: the sandbox image holds no git repository in {repo_dir} and instance "
                f"{instance.get('instance_id')} has no repo_path: give its image in handlers.swe.repo_images "
                f"(by instance id, '{instance.get('repo')}@{instance.get('version') or 'latest'}' or "
                f"'{instance.get('repo')}'; prorl build-images --swe writes such a map), or a repo_path "
                f"({present.output.strip()[-300:]})")
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


async def apply_patch(sandbox: Any, repo_dir: str, path: str, reverse: bool = False) -> tuple[bool, str]:
    """Apply the patch file at ``path`` (in the sandbox) to ``repo_dir`` the way EVAL applies every patch.

    Each of :data:`APPLY_COMMANDS` is tried in turn; ``reverse`` undoes the patch instead. Returns whether
    one applied, and its output (else every command's output tail).
    """
    outputs = []
    for command, flag in zip(APPLY_COMMANDS, REVERSE_FLAGS, strict=True):
        line = command.format(patch=shlex.quote(path), reverse=flag if reverse else "")
        done = await sandbox.bash(f"cd {shlex.quote(repo_dir)} && {line} 2>&1")
        if done.exit_code == 0:
            return True, done.output
        if command.startswith("patch ") and "BusyBox" in done.output:
            # BusyBox's patch takes none of GNU patch's options: its usage text would hide git apply's reason.
            outputs.append("patch: the image's `patch` is BusyBox's, which has no --batch or --fuzz; install GNU "
                           "patch in the image for the fuzzy fallback")
            continue
        outputs.append(done.output[-1000:])
    return False, "\n".join(outputs)


def _patch_paths(numstat: bytes, patch: str) -> list[str]:
    """Every path ``git apply --numstat -z`` names (both sides of a rename), else the patch's ``---``/``+++`` paths."""
    paths: list[str] = []
    tokens = numstat.split(b"\0")
    i = 0
    while i < len(tokens):
        fields = tokens[i].split(b"\t")
        i += 1
        if len(fields) != 3:
            continue
        names = [fields[2]] if fields[2] else tokens[i:i + 2]  # a rename: old and new name follow
        i += 0 if fields[2] else 2
        paths += [name.decode("utf-8", "surrogateescape") for name in names if name]
    if not paths:  # git could not read it (GNU patch may): the plain headers, unquoted names only
        for m in re.finditer(r"^(?:---|\+\+\+) [ab]/(.+?)\t?$", patch, re.MULTILINE):
            paths.append(m.group(1))
    return list(dict.fromkeys(paths))


async def _reset_test_files(sandbox: Any, repo_dir: str, base: str, test_patch: str) -> list[str]:
    """Put the files the test patch touches back as they are at ``base``, as swebench's eval script does.

    The model patch's changes to them are dropped (an agent's own tests in the same file would stop the test
    patch from applying; an edit beside the test patch's hunks could rig a listed test); a file the test
    patch creates is removed. Returns the paths reset.
    """
    repo = shlex.quote(repo_dir)
    listed = await sandbox.bash(f"cd {repo} && git apply --numstat -z {TEST_PATCH} > {WORK}/test-files 2>/dev/null")
    numstat = await sandbox.read_file(f"{WORK}/test-files") if listed.exit_code == 0 else b""
    paths = _patch_paths(numstat, test_patch)
    if not paths:
        return []
    rev = shlex.quote(base)
    lines = [f"cd {repo} || exit 1"]
    for path in paths:
        name = shlex.quote(path)
        lines.append(f"if git cat-file -e {shlex.quote(f'{base}:{path}')} 2>/dev/null; "
                     f"then git checkout -q {rev} -- {name} || exit 1; else rm -rf -- {name} || exit 1; fi")
    await sandbox.write_file(f"{WORK}/reset-tests.sh", ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))
    done = await sandbox.bash(f"bash {WORK}/reset-tests.sh 2>&1")
    if done.exit_code != 0:
        raise DomainError(f"swe: cannot reset the test patch's files {paths} to base_commit {base}: "
                          f"{done.output[-1000:]}")
    return paths


def listed_test_files(names: list[str]) -> list[str]:
    """The ``.py`` files the pytest node ids in ``names`` name (``tests/test_x.py::test_a``), each once.

    A doctest's id (``src/pkg/mod.py::pkg.mod.func``: a dotted name after the file) names a source module,
    which the fix may change: it is left out.
    """
    paths = []
    for name in names:
        parts = name.split("::")
        if len(parts) < 2 or not parts[0].endswith(".py") or "." in parts[1].split("[", 1)[0]:
            continue
        paths.append(parts[0])
    return list(dict.fromkeys(paths))


async def _reset_listed_files(sandbox: Any, repo_dir: str, base: str, paths: list[str]) -> list[str]:
    """Put the test files the listed ids name back as they are at ``base`` (those ``base`` holds); return them.

    A row without a test patch (SWE-smith's) runs its listed tests from the repository as the model patch
    left it: an edit to a listed test (``assert True``) would pass it, and a wrong patch would score 1.
    """
    if not paths:
        return []
    repo, rev = shlex.quote(repo_dir), shlex.quote(base)
    lines = [f"cd {repo} || exit 1"]
    for path in paths:
        name = shlex.quote(path)
        lines.append(f"if git cat-file -e {shlex.quote(f'{base}:{path}')} 2>/dev/null; "
                     f"then git checkout -q {rev} -- {name} || exit 1; printf '%s\\0' {name}; fi")
    await sandbox.write_file(f"{WORK}/reset-listed.sh", ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))
    done = await sandbox.bash(f"bash {WORK}/reset-listed.sh > {WORK}/reset-listed.out 2> {WORK}/reset-listed.err")
    if done.exit_code != 0:
        error = (await sandbox.read_file(f"{WORK}/reset-listed.err")).decode("utf-8", "replace")
        raise DomainError(f"swe: cannot reset the listed tests' files {paths} to base_commit {base}: {error[-1000:]}")
    reset = (await sandbox.read_file(f"{WORK}/reset-listed.out")).decode("utf-8", "surrogateescape")
    return [path for path in reset.split("\0") if path]


async def _apply_test_patch(sandbox: Any, instance: dict[str, Any], repo_dir: str) -> list[str]:
    """Write the instance's test patch and apply it over its files as they are at base_commit; return those files."""
    test_patch = str(instance.get("test_patch") or "")
    await sandbox.write_file(TEST_PATCH, test_patch.encode())
    if not test_patch.strip():
        return []
    reset = await _reset_test_files(sandbox, repo_dir, str(instance["base_commit"]), test_patch)
    ok, output = await apply_patch(sandbox, repo_dir, TEST_PATCH)
    if not ok:
        raise DomainError(f"swe: the instance's test_patch does not apply: {output[-1000:]}")
    return reset


async def _run(sandbox: Any, plan: TestPlan, timeout_s: float) -> tuple[str, str, list[StepOutcome], bool]:
    """Run the run script once: its log, the node-id records, each step's outcome, and whether it hit ``timeout_s``."""
    ran = await sandbox.bash(f": > {NODEIDS}; : > {STEPS}; bash {RUN} > {LOG} 2>&1", timeout_s=timeout_s)
    log = (await sandbox.read_file(LOG)).decode("utf-8", "replace")
    records = (await sandbox.read_file(NODEIDS)).decode("utf-8", "replace")
    step_records = (await sandbox.read_file(STEPS)).decode("utf-8", "replace")
    return log, records, read_steps(plan_steps(plan), step_records, log, bool(ran.timed_out)), bool(ran.timed_out)


async def run_tests(sandbox: Any, instance: dict[str, Any], settings: dict[str, Any], patch: str | bytes | None,
                    fail_to_pass: list[str], pass_to_pass: list[str], repo_dir: str,
                    timeout_s: float) -> tuple[SweReport, dict[str, Any]]:
    """Apply ``patch`` (and the test patch unless the plan's eval script does), run the steps, grade them.

    ``patch`` is text, or bytes as ``git diff`` wrote them (a diff of a file that is not UTF-8 text).

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
        await sandbox.write_file(f"{WORK}/model.patch", patch if isinstance(patch, bytes) else patch.encode())
        ok, output = await apply_patch(sandbox, repo_dir, f"{WORK}/model.patch")
        if not ok:
            extra["log_tail"] = output[-3000:]
            return SweReport(patch_exists=True, test_source=plan.source, status="PATCH_APPLY_FAILED"), extra
    listed = await _reset_listed_files(sandbox, repo_dir, str(instance["base_commit"]),
                                       listed_test_files([*fail_to_pass, *pass_to_pass]))
    if listed:
        extra["reset_listed_test_files"] = listed
    if not plan.applies_test_patch:
        extra["reset_test_files"] = await _apply_test_patch(sandbox, instance, repo_dir)
    timings["apply_s"] = round(time.monotonic() - started, 3)
    await sandbox.write_file(RUN, run_script(plan, repo_dir).encode())
    started = time.monotonic()
    log, records, steps, timed_out = await _run(sandbox, plan, timeout_s)
    timings["run_s"] = round(time.monotonic() - started, 3)
    report = grade_run(plan, instance, fail_to_pass, pass_to_pass, log, records, steps)
    extra.update(tests_timed_out=timed_out, log_tail=log[-3000:])
    if report.infra_failure_reason == NO_TESTS_COLLECTED and patch.strip():
        # None of the listed tests ran: the environment's fault, or the patch's (a broken conftest or import)?
        # The same run without the patch tells; a patch that stops the suite must not escape its 0.
        base = shlex.quote(str(instance["base_commit"]))
        reset = await sandbox.bash(f"cd {shlex.quote(repo_dir)} && git checkout -q -f {base} 2>&1 && git clean -fdq 2>&1")
        if reset.exit_code != 0:
            raise DomainError(f"swe: cannot put the repository back at base_commit for a run without the patch: "
                              f"{reset.output[-1000:]}")
        if not plan.applies_test_patch:
            await _apply_test_patch(sandbox, instance, repo_dir)
        base_log, base_records, base_steps, _ = await _run(sandbox, plan, timeout_s)
        without = grade_run(plan, instance, fail_to_pass, pass_to_pass, base_log, base_records, base_steps)
        extra["run_without_patch"] = {"infra_failure_reason": without.infra_failure_reason,
                                      "tests": len(without.tests), "log_tail": base_log[-1000:]}
        if not without.infra_failure:
            report = grade_run(plan, instance, fail_to_pass, pass_to_pass, log, records, steps,
                               patch_stopped_tests=True)
    return report, extra
