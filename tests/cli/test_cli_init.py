"""``prorl init [--slurm]`` writes a commented pair of files that load and agree; ``config show`` shows both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prorl_cli.config import ProrlConfig, load_config
from prorl_cli.slurm.deploy import load_deploy
from prorl_cli.slurm.options import effective_deploy


@pytest.fixture(autouse=True)
def _no_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare the written files with the defaults: the suite's PRORL_HOME is not the file's."""
    for name in ("PRORL_HOME", "PRORL_DEPLOYMENT", "PRORL_CONFIG", "PRORL_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)


def prorl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PRORL_DEPLOYMENT", "PRORL_CONFIG", "PRORL_HOME")}
    return subprocess.run([sys.executable, "-m", "prorl_cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})


def test_init_writes_a_commented_prorl_yaml_at_the_defaults(tmp_path: Path) -> None:
    r = prorl("init", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "prorl.yaml").read_text()
    assert text.count("# ") > 10, "commented"
    assert not (tmp_path / "deploy.yaml").exists()
    assert load_config(tmp_path / "prorl.yaml").to_dict() == ProrlConfig().to_dict()
    again = prorl("init", "--out", str(tmp_path))
    assert again.returncode == 1 and "--force" in again.stderr, "an existing file is not overwritten"
    assert prorl("init", "--out", str(tmp_path), "--force").returncode == 0


def test_init_slurm_says_the_next_command_as_it_pastes(tmp_path: Path) -> None:
    """The --home given (not written into the files) goes with it; a path with a space stays one argument."""
    out, home = tmp_path / "x y", tmp_path / "a b"
    r = prorl("--home", str(home), "init", "--slurm", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"next: prorl --home '{home}' launch '{out / 'deploy.yaml'}' --dry-run" in r.stdout, r.stdout


def test_init_slurm_writes_a_pair_that_agrees(tmp_path: Path) -> None:
    r = prorl("init", "--slurm", "-d", "myrun", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    config = load_config(tmp_path / "prorl.yaml")
    expected = ProrlConfig().to_dict()
    expected["deployment"] = "myrun"
    expected["broker"]["bind_host"] = "0.0.0.0"  # peers on other hosts
    expected["sandbox"]["runtime"] = "apptainer"  # a cluster never falls back to running unisolated
    assert config.to_dict() == expected
    deploy = load_deploy(tmp_path / "deploy.yaml")
    assert deploy.deployment == "myrun" and deploy.config == str(tmp_path / "prorl.yaml")
    effective = effective_deploy(deploy)
    assert effective["broker"]["bind_host"] == config.broker.bind_host
    assert effective["nodes"]["sandbox_runtime"] == config.sandbox.runtime
    # `config show` in that folder: prorl.yaml, then deploy.yaml's effective values.
    show = prorl("config", "show", cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    ours, theirs = (yaml.safe_load(doc) for doc in show.stdout.split("\n---\n"))
    assert ours["deployment"] == "myrun" and ours["sandbox"]["runtime"] == "apptainer"
    assert theirs["broker"]["bind_host"] == "0.0.0.0" and theirs["nodes"]["sandbox_runtime"] == "apptainer"
    assert theirs["nodes"]["count"] == 1 and theirs["log_dir"].endswith("/myrun/slurm")
    # -d renames both; a deploy file that does not load is an error naming its key.
    renamed = prorl("config", "show", "-d", "other", cwd=tmp_path)
    assert [yaml.safe_load(d)["deployment"] for d in renamed.stdout.split("\n---\n")] == ["other", "other"]
    (tmp_path / "deploy.yaml").write_text("nodes: {count: many}\n")
    bad = prorl("config", "show", cwd=tmp_path)
    assert bad.returncode == 1 and "nodes.count" in bad.stderr
