"""``prorl config check FILE`` tells a deploy.yaml from a prorl.yaml by all its keys, nested ones included, so a
typo in one is reported as that typo, not as the other file's schema refusing every valid key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _check(folder: Path, name: str, text: str) -> subprocess.CompletedProcess[str]:
    (folder / name).write_text(text)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    return subprocess.run([sys.executable, "-m", "prorl_cli", "config", "check", name], cwd=folder,
                          capture_output=True, text=True, timeout=60,
                          env={**clean, "PRORL_HOME": str(folder / "home"), "COLUMNS": "80"})


def _init(folder: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "init", "--slurm", "-d", "myrun"], cwd=folder,
                       capture_output=True, text=True, timeout=60,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("PRORL_")},
                            "PRORL_HOME": str(folder / "home")})
    assert r.returncode == 0, r.stderr
    return (folder / "deploy.yaml").read_text()


def test_a_misspelt_section_of_a_deploy_file_is_the_error_not_its_valid_keys(tmp_path: Path) -> None:
    text = _init(tmp_path)
    assert "\nnodes:\n" in text
    r = _check(tmp_path, "d3.yaml", text.replace("\nnodes:\n", "\nnode:\n"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (error,) = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: d3.yaml: top level: unknown key(s) ['node']"), error
    # It says what it took the file for, and why, with the key it most likely meant.
    (note,) = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert note.startswith("note: d3.yaml was checked as a deploy.yaml (deploy.yaml-only keys: config, python, "
                           "setup"), note
    assert "prorl.yaml-only keys: node (1)" in note and "node: did you mean nodes?" in note, note


@pytest.mark.parametrize(("text", "ok"), [
    # Only sections both files have (inference, broker): their keys are deploy.yaml's.
    ("deployment: x\ninference:\n  count: 1\n  model: ./tiny\n", True),
    ("deployment: x\nbroker:\n  where: slurm\n", True),
    ("deployment: x\nbroker:\n  wher: slurm\n  time: '10'\n", False),
], ids=["inference-count-model", "broker-where", "broker-typo"])
def test_a_deploy_file_of_shared_sections_is_checked_as_one(tmp_path: Path, text: str, ok: bool) -> None:
    r = _check(tmp_path, "d.yaml", text)
    if ok:
        assert r.returncode == 0, r.stderr
        assert "d.yaml: ok (a deploy file;" in r.stdout, r.stdout
        return
    (error,) = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: d.yaml: broker: unknown key(s) ['wher']; known keys: ['account', "), error
    assert "checked as a deploy.yaml" in r.stderr and "broker.wher: did you mean where?" in r.stderr, r.stderr


def test_a_prorl_yaml_stays_one() -> None:
    from prorl_cli.slurm.deploy import file_kind

    # Shared sections with prorl.yaml's keys, typos in a section only prorl.yaml has, nothing at all.
    for data in [{"broker": {"port": 5555, "heartbeat_interval_s": 1.0}, "inference": {"engine": "vllm"}},
                 {"node": {"n_runn": 3, "a": 1, "b": 2}, "inference": {"tokenizer": "x"}},
                 {"deployment": "x"}, {}, None]:
        assert not file_kind(data).deploy, data
    kind = file_kind({"inference": {"count": 1, "tokenizer": "x"}, "jobs": {"timeout_s": 5}})
    assert not kind.deploy and kind.unknown == (("inference.count", ""),), kind
