"""The ``swe`` domain on a real fixture: a git repository with a real bug, built into an image from a Dockerfile."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.domains.tinyrepo import make_tinyrepo, run_git
from tests.domains.conftest import IMAGES, ScriptedStack, turn
from tests.harness import image_build_config, need_module

DOCKERFILE = """FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1
COPY tinycalc.bundle /opt/tinycalc.bundle
RUN git clone -q /opt/tinycalc.bundle /testbed && python3 -m pytest --version
WORKDIR /testbed
EXPOSE 8000
HEALTHCHECK CMD python3 -c "print(1)"
"""
FIX = ("editor", {"command": "str_replace", "path": "/testbed/tinycalc/stats.py",
                  "old_str": "(len(xs) - 1)", "new_str": "len(xs)"})
BREAK = ("editor", {"command": "str_replace", "path": "/testbed/tinycalc/calc.py",
                    "old_str": "return a + b", "new_str": "return a + b + 1"})
RUN_TESTS = ("bash", {"command": "cd /testbed && python3 -m pytest -q tests 2>&1 | tail -1"})


@pytest.fixture(scope="module")
def fixture_image(tmp_path_factory: pytest.TempPathFactory, domain_image: str) -> tuple[str, dict[str, Any], Path]:
    """tinycalc made as a git repository, bundled, and built with ``prorl build-images`` from a Dockerfile.

    The recipe lives at a fixed path and the repository is made with fixed dates, so the lock-mode
    cache under the test image cache is reused by later runs.
    """
    need_module("swebench", "swe")
    repo = make_tinyrepo(tmp_path_factory.mktemp("swe") / "tinycalc")
    recipe = IMAGES / "swe-fixture"
    recipe.mkdir(exist_ok=True)
    subprocess.run(["git", "-C", str(repo.path), "bundle", "create", str(recipe / "tinycalc.bundle"), "--all"],
                   check=True, capture_output=True)
    (recipe / "Dockerfile").write_text(DOCKERFILE)
    (recipe / "images.yaml").write_text(json.dumps({"images": {"swe-tinycalc": {
        "template": "Dockerfile", "base": f"localimage:{domain_image}"}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    built = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "--config", str(image_build_config(recipe)), "build-images",
         "-f", str(recipe / "images.yaml"), "--mode", "lock",
         "--cache-dir", str(IMAGES / "images"), "--json", "swe-tinycalc"],
        capture_output=True, text=True, timeout=900, env=env, start_new_session=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (result,) = [r for r in json.loads(built.stdout) if r["name"] == "swe-tinycalc"]
    assert result["action"] in ("built", "reused"), result
    if result["action"] == "built":  # the conversion report is printed when the recipe is rendered
        assert "not converted: line 6: EXPOSE 8000" in built.stderr and "HEALTHCHECK" in built.stderr
    dry = subprocess.run([sys.executable, "-m", "prorl_cli", "build-images", "-f", str(recipe / "images.yaml"),
                          "--cache-dir", str(IMAGES / "images"), "--dry-run", "swe-tinycalc"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert "# prorl: not converted: line 7: HEALTHCHECK" in dry.stdout, dry.stdout + dry.stderr
    assert "git clone -q /opt/tinycalc.bundle /testbed" in dry.stdout  # RUN became %post
    return result["path"], repo.instance, repo.path


def _instance(base: dict[str, object], tag: str, **extra: object) -> dict[str, object]:
    return {**base, "problem_statement": f"[{tag}] {base['problem_statement']}", **extra}


def test_swe_handler_grades_fail_to_pass_and_pass_to_pass(stack: ScriptedStack, fixture_image: tuple[str, dict[str, Any], Path],
                                                           domain_image: str) -> None:
    image, instance, repo_path = fixture_image
    stack.add("[S-fix]", turn("", RUN_TESTS), turn("", FIX), turn("", RUN_TESTS), "Fixed mean.")
    stack.add("[S-break]", turn("", FIX, BREAK), "Done.")
    stack.add("[S-nothing]", "I could not find the bug.")
    stack.add("[S-clone]", turn("", FIX), "Done.")
    stack.start_model()
    images = {"repo_images": {"prorl/tinycalc@0.1": image}}
    fixed, broken, nothing, cloned = stack.run("swe", [
        _instance(instance, "S-fix", settings=images),
        _instance(instance, "S-break", settings=images),
        _instance(instance, "S-nothing", settings=images),
        # No project in the image: the node-local repository is cloned in (what the quickstart does).
        _instance(instance, "S-clone", repo_path=str(repo_path), settings={"image": domain_image}),
    ], timeout_s=300)

    assert fixed.state == "done" and fixed.reward == 1.0, json.dumps(fixed.output, indent=1)[-3000:]
    report = fixed.output["report"]
    assert report["status"] == "RESOLVED_FULL" and sorted(report["tests_status"]["FAIL_TO_PASS"]["success"]) == sorted(instance["FAIL_TO_PASS"])
    assert report["tests"]["tests/test_stats.py::test_mean"] == "PASSED"
    assert "-    return sum(xs) / (len(xs) - 1)" in fixed.output["model_patch"]
    tools = [m["content"] for m in fixed.output["trajectory"]["messages"] if m["role"] == "tool"]
    assert "2 passed" in tools[0]  # the agent ran the repository's own tests in its sandbox
    # EVAL ran in a fresh sandbox: RUN's was stopped before EVAL, the patch was all it had.
    assert fixed.output["sandboxes"]["run"] != fixed.output["sandboxes"]["eval"]

    assert broken.reward == 0.0
    assert broken.output["report"]["tests_status"]["FAIL_TO_PASS"]["failure"] == []
    assert broken.output["report"]["tests_status"]["PASS_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]
    assert nothing.reward == 0.0 and nothing.output["model_patch"] == ""
    assert sorted(nothing.output["report"]["tests_status"]["FAIL_TO_PASS"]["failure"]) == sorted(instance["FAIL_TO_PASS"])
    assert cloned.reward == 1.0, json.dumps(cloned.output, indent=1)[-3000:]


def test_a_fix_next_to_a_latin1_line_is_applied_from_gits_exact_bytes(
        stack: ScriptedStack, domain_image: str, tmp_path: Path) -> None:
    """A file that is not UTF-8 (a Latin-1 comment beside the bug): git diffs its bytes as they are. EVAL applies
    those bytes (a decoded copy's context line would no longer match, and the fix would score 0); the patch's
    text is kept for people, with the byte replaced."""
    need_module("swebench", "swe")
    repo = make_tinyrepo(tmp_path / "tinycalc")
    stats = repo.path / "tinycalc" / "stats.py"
    buggy = b"    return sum(xs) / (len(xs) - 1)"
    stats.write_bytes(stats.read_bytes().replace(buggy, b"    # moyenne arithm\xe9tique\n" + buggy))
    run_git(repo.path, "commit", "-qam", "a Latin-1 comment")
    base = run_git(repo.path, "rev-parse", "HEAD").strip()
    stack.add("[S-latin1]", turn("", FIX), "Done.")
    stack.start_model()
    (result,) = stack.run("swe", [_instance(repo.instance, "S-latin1", base_commit=base, repo_path=str(repo.path),
                                            settings={"image": domain_image})], timeout_s=300)
    assert result.reward == 1.0, json.dumps(result.output, indent=1)[-3000:]
    assert " # moyenne arithm\ufffdtique" in result.output["model_patch"], result.output["model_patch"]
    exact = base64.b64decode(result.output["model_patch_base64"])
    assert b" # moyenne arithm\xe9tique" in exact and b"+    return sum(xs) / len(xs)" in exact
    records = stack.d.deployment_dir / "nodes" / "n1" / "sandboxes"
    assert list(records.glob("*.json")) == []
