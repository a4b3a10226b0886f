"""The ``swe`` domain on datasets that are not tinycalc: exact node ids, instance test commands, no future, prorl eval.

Runs on the shared domain stack (broker, node, Apptainer sandboxes on the
domain image). The repositories reach the sandbox through ``repo_path``;
``swe_oracle`` applies the gold patch instead of an agent (no model).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.domains.conftest import ScriptedStack, turn
from tests.harness import need_module
from tests.swe.spacey import FAIL_TO_PASS, FILE, Spacey, make_spacey


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> tuple[Spacey, Spacey]:
    need_module("swebench", "swe")
    root = tmp_path_factory.mktemp("spacey")
    return make_spacey(root / "flat"), make_spacey(root / "src", src_layout=True)


def _with_repo(repo: Spacey, **extra: Any) -> dict[str, Any]:
    return {**repo.instance, "repo_path": str(repo.path), **extra}


def test_oracle_resolves_exact_ids_and_the_instance_test_command_inside_the_sandbox(
        stack: ScriptedStack, repos: tuple[Spacey, Spacey]) -> None:
    flat, src = repos
    command = f"PYTHONPATH=src python3 -m pytest -rA -p no:cacheprovider {FILE} tests/test_basic.py"
    ghost = f"{FILE}::test_parse_pair[a = c]"
    gold, own_command, with_ghost = stack.run("swe_oracle", [
        _with_repo(flat, tokenizer="/nonexistent/tokenizer"),  # no model call: the tokenizer is never loaded
        _with_repo(src, test_command=command),
        _with_repo(flat, instance_id="prorl__spacey-ghost", PASS_TO_PASS=[*flat.instance["PASS_TO_PASS"], ghost]),
    ], timeout_s=300)

    assert gold.state == "done" and gold.reward == 1.0, json.dumps(gold.output, indent=1)[-3000:]
    report = gold.output["report"]
    assert report["grading"] == "nodeids" and report["status"] == "RESOLVED_FULL"
    assert sorted(report["tests_status"]["FAIL_TO_PASS"]["success"]) == sorted(FAIL_TO_PASS)
    assert report["tests"][f"{FILE}::test_parse_pair[\\xfcn\\xefcode \\u2603]"] == "PASSED"
    assert gold.output["model_patch"] == flat.instance["patch"]

    assert own_command.reward == 1.0, json.dumps(own_command.output, indent=1)[-3000:]
    assert own_command.output["report"]["test_source"] == "instance test_command"
    assert own_command.output["report"]["test_command"] == command  # used as given, each file once

    assert with_ghost.reward == 0.0
    assert with_ghost.output["report"]["tests_status"]["PASS_TO_PASS"]["missing"] == [ghost]
    assert with_ghost.output["report"]["missing"] == {ghost: f"{FILE}::test_parse_pair[a = b]"}


def test_the_agent_cannot_reach_the_fix_commit_from_its_sandbox(stack: ScriptedStack,
                                                                  repos: tuple[Spacey, Spacey]) -> None:
    flat, _ = repos
    fix = flat.fix_commit
    probe = (f"cd /testbed && echo commits=$(git log --all --format=%H | wc -l); "
             f"git cat-file -t {fix} >/dev/null 2>&1; echo cat-file=$?; git fsck --lost-found 2>&1; "
             f"echo lost=$(ls .git/lost-found 2>/dev/null | wc -l); echo remotes=$(git remote | wc -l); "
             f"echo tags=$(git tag | wc -l); git log --all --format=%H | grep -c {fix}")
    stack.add("[H-probe]", turn("", ("bash", {"command": probe})), "Nothing to fix.")
    stack.start_model()
    (probed,) = stack.run("swe", [_with_repo(flat, problem_statement=f"[H-probe] {flat.instance['problem_statement']}")],
                          timeout_s=300)
    tools = [m["content"] for m in probed.output["trajectory"]["messages"] if m["role"] == "tool"]
    out = tools[0]
    assert "commits=2" in out and "cat-file=1" in out, out  # base and its parent only; the fix object is absent
    assert "lost=0" in out and "remotes=0" in out and "tags=0" in out and "dangling" not in out, out
    assert probed.reward == 0.0 and probed.output["model_patch"] == ""


def test_prorl_eval_writes_swebench_predictions_and_reports(stack: ScriptedStack, repos: tuple[Spacey, Spacey],
                                                            tmp_path: Path) -> None:
    flat, src = repos
    command = f"PYTHONPATH=src python3 -m pytest -rA -p no:cacheprovider {FILE} tests/test_basic.py"
    rows = [_with_repo(flat), _with_repo(src, test_command=command),
            _with_repo(flat, instance_id="prorl__spacey-flat-2")]
    dataset = tmp_path / "dataset.json"
    dataset.write_text(json.dumps(rows, indent=2))  # a pretty-printed JSON array, not JSONL
    out = tmp_path / "out"
    ran = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "-d", stack.d.name, "eval", "--task", "swe_oracle", str(dataset),
         "--n", "2", "--out", str(out), "--run-id", "ev1", "--model-name", "gold/oracle"],
        env=stack.d.env(), capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr[-3000:]
    assert "resolved 3/3" in ran.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resolved_ids"] == sorted(r["instance_id"] for r in rows)
    assert summary["pass_at_k"] == {"1": 1.0, "2": 1.0} and summary["resolved_rate"] == 1.0
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [p["instance_id"] for p in predictions] == [r["instance_id"] for r in rows]
    assert all(p["model_name_or_path"] == "gold/oracle" and p["model_patch"] for p in predictions)
    report = json.loads((out / "reports" / "prorl__spacey-src-1.json").read_text())["prorl__spacey-src-1"]
    assert report["resolved"] and report["patch_successfully_applied"]
    assert sorted(report["tests_status"]["FAIL_TO_PASS"]["success"]) == sorted(FAIL_TO_PASS)


def test_no_silent_zero_inside_the_sandbox(stack: ScriptedStack, repos: tuple[Spacey, Spacey], tmp_path: Path) -> None:
    """A prose install as shipped, and a test command that runs nothing: no reward, the step and why in the report."""
    flat, _ = repos
    prose = "Install the package in editable mode (pip install -e .) and make sure numpy is available."
    # SWE-smith's shape: the patch introduces the bug (here: the fix reversed), and the oracle reverses it.
    bug = subprocess.run(["git", "-C", str(flat.path), "diff", flat.fix_commit, flat.instance["base_commit"], "--",
                          "spacey"], capture_output=True, text=True, check=True).stdout
    as_shipped, nothing_ran, smith = stack.run("swe_oracle", [
        _with_repo(flat, instance_id="prorl__spacey-prose", install=[prose]),  # submitted as is: EVAL's guard
        _with_repo(flat, instance_id="prorl__spacey-notests", test_command="echo no tests here"),
        _with_repo(flat, instance_id="prorl__spacey-smith", patch=bug, patch_reverse=True),
    ], timeout_s=300)
    assert smith.reward == 1.0, json.dumps(smith.output, indent=1)[-3000:]
    assert as_shipped.state == "done" and as_shipped.reward is None, json.dumps(as_shipped.output, indent=1)[-3000:]
    report = as_shipped.output["report"]
    assert report["infra_failure"] and report["infra_failure_reason"] == "step_syntax_error"
    assert report["infra_step"]["name"] == "install[0]" and report["infra_step"]["exit"] == 2
    assert "syntax error" in report["infra_step"]["log_tail"]
    assert [s["status"] for s in report["steps"]] == ["syntax", "not_run"]
    assert nothing_ran.reward is None and nothing_ran.output["report"]["infra_failure_reason"] == "no_tests_collected"

    # Through the loader (prorl eval): the prose never reaches a shell, the warning names the field, and the
    # gold patch resolves; the instance whose tests never ran is left ungraded, with its details on disk.
    rows = [{**_with_repo(flat, instance_id="prorl__spacey-prose"), "install": prose, "hints_text": "",
             "created_at": "2024-01-01T00:00:00Z"},
            _with_repo(flat, instance_id="prorl__spacey-notests", test_command="echo no tests here")]
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    ran = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "-d", stack.d.name, "eval", "--task", "swe_oracle", str(dataset),
         "--out", str(out)], env=stack.d.env(), capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout + ran.stderr[-3000:]
    assert "field 'install'" in ran.stderr and "never run" in ran.stderr
    assert "1 sample(s) not graded (infra_failure: no_tests_collected" in ran.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resolved_ids"] == ["prorl__spacey-prose"] and summary["infra_failure_ids"] == ["prorl__spacey-notests"]
    (sample,) = json.loads((out / "details" / "prorl__spacey-notests.json").read_text())["samples"]
    assert sample["reward"] is None and set(sample["stage_s"]) >= {"init", "run", "eval"}
    assert sample["infra_step"]["name"] == "tests" and "no tests here" in sample["log_tail"]
    assert sorted(sample["missing"]) == sorted(flat.instance["FAIL_TO_PASS"] + flat.instance["PASS_TO_PASS"])
