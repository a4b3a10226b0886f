"""The wheel: its contents, and prorl installed from it in a fresh virtual environment.

Built once per module from this tree. The venv is a new one with no system
site packages: prorl's wheel goes in with its declared dependencies, at the
versions the running environment holds (pip's constraints, so its wheel cache
serves them), and runs outside the checkout, so nothing can come from the
source tree or from whatever the machine's own Python happens to hold.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from prorl_cli.embedded import LocalStack
from prorl_cli.node.registry import discover
from tests.harness import REPO

BUILTIN_TASKS = {"code", "harness", "math", "math_agent", "search", "swe", "swe_no_fix", "swe_oracle"}
TEST_TASKS = {"test", "noop", "dapo_sim", "sim_agent", "sandbox_demo", "sandbox_bash"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    (path,) = out.glob("prorl-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with prorl installed from the wheel; returns its python."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "v")],
                   check=True, capture_output=True, timeout=120)
    python = root / "v" / "bin" / "python"
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                            check=True, capture_output=True, text=True, timeout=120).stdout
    constraints = root / "constraints.txt"
    constraints.write_text("".join(line + "\n" for line in frozen.splitlines()
                                   if line and not line.startswith(("prorl==", "-e ", "#"))))
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "-c", str(constraints), str(wheel)],
        capture_output=True, text=True, timeout=900,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    return python


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH and no prorl settings: what a user's shell has."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PRORL_")}


def test_wheel_ships_the_packages_and_data_folders(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "prorl_cli/handlers/__init__.py" in names and "prorl_cli/handlers/math_agent.py" in names
    assert "prorl_cli/handlers/data/math.jsonl" in names
    assert "prorl_cli/testing/handlers/testing.py" in names and "prorl_cli/testing/harness.py" in names
    assert not any(n.startswith("prorl_cli/handlers/") and n.endswith(("testing.py", "sim_agent.py")) for n in names)
    assert any(n.startswith("prorl_cli/sif_recipes/") and n.endswith(".j2") for n in names)
    assert any(n.startswith("prorl_cli/slurm_templates/") for n in names)
    assert "prorl_cli/protocol/__init__.py" in names and "prorl_cli/protocol/headers.py" in names
    assert "prorl_cli/integrations/verl_agent_loops.yaml" in names  # veRL's Ray workers register the loop from it
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_wheel_serves_one_handler_package_and_the_example_imports(venv: Path, tmp_path: Path) -> None:
    # Every prorl import of examples/train_tiny_grpo.py (module level and inside functions) resolves from the wheel.
    example = ast.parse((REPO / "examples" / "train_tiny_grpo.py").read_text())
    imports = [ast.unparse(node) for node in ast.walk(example)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prorl_cli")]
    assert any("prorl_cli.handlers" in line for line in imports), imports
    script = "\n".join([
        *imports,
        "import json, prorl_cli",
        "from prorl_cli.handlers.math_agent import MathAgentHandler",
        "from prorl_cli.node.registry import discover",
        "reg = discover()",
        "assert reg.handlers['math_agent'] is MathAgentHandler, 'two identities of one handler'",
        "print(json.dumps({'file': prorl_cli.__file__, 'tasks': reg.tasks, 'errors': reg.errors}))",
    ])
    run = subprocess.run([str(venv), "-c", script], capture_output=True, text=True, timeout=120,
                         env=_clean_env(), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    assert seen["file"].startswith(str(venv.parent.parent)), seen  # prorl from the wheel, not the checkout
    assert set(seen["tasks"]) == BUILTIN_TASKS and seen["errors"] == [], seen


def test_installed_wheel_runs_the_quickstart_without_a_model(venv: Path, tmp_path: Path) -> None:
    prorl = venv.parent / "prorl"
    usage = subprocess.run([str(prorl), "quickstart", "--help"], capture_output=True, text=True, timeout=60,
                           env=_clean_env(), cwd=tmp_path).stdout
    out_flag = "--out" if "--out" in usage else "--home"
    run = subprocess.run([str(prorl), "quickstart", "--engine", "none", out_flag, str(tmp_path / "qs")],
                         capture_output=True, text=True, timeout=300, env=_clean_env(), cwd=tmp_path,
                         start_new_session=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((tmp_path / "qs" / "summary.json").read_text())
    assert summary["task"] == "test" and summary["jobs"] > 0, summary


def test_a_production_node_serves_no_test_handler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prorl serve node`` without handler paths: the built-in domains only (the test ones must be asked for)."""
    monkeypatch.delenv("PRORL_HANDLER_PATHS", raising=False)
    assert set(discover().tasks) == BUILTIN_TASKS
    with LocalStack(tmp_path / "home", "prod", {"broker": {"journal": False}}) as stack:
        stack.start_broker()
        stack.start_node("n1")
        (node,) = stack.client.status().nodes
    assert set(node.tasks) == BUILTIN_TASKS, node.tasks
    assert set(discover(["prorl_cli.testing.handlers"]).tasks) == BUILTIN_TASKS | TEST_TASKS
