"""Apptainer without FUSE: sandboxes of one SIF share one unpacked copy, each with its own writable layer."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.sandbox.conftest import SYSTEM_PYTHON, ScenarioRunner

pytestmark = [pytest.mark.apptainer, pytest.mark.usefixtures("need_apptainer")]

# Runs as the unprivileged test user (no /dev/fuse for it here): starts two sandboxes at once.
SCRIPT = r'''
import asyncio, json, logging, sys
from pathlib import Path
from prorl_cli.sandbox import SandboxConfig, SandboxManager
from prorl_cli.sandbox.apptainer import fuse_usable, unpacked_root

async def main(args):
    cfg = SandboxConfig(runtime="apptainer", image=args["image"], local_dir=args["local_dir"])
    m = SandboxManager(cfg, Path(args["state_dir"]), logging.getLogger("t"))
    a, b = await asyncio.gather(m.start("a"), m.start("b"))
    out = {"fuse": fuse_usable()}
    await a.bash("mkdir -p /opt/layer && echo from-a > /opt/layer/mark")
    out["a_sees"] = (await a.bash("cat /opt/layer/mark")).output
    out["b_sees"] = (await b.bash("cat /opt/layer/mark 2>&1; echo rc=$?")).output
    out["runs"] = dict(m.runtime._run_image)
    out["copies"] = sorted(p.name for p in unpacked_root(cfg).iterdir() if p.is_dir())
    copy = Path(out["runs"][args["image"]])
    out["argparse_pyc"] = [str(p.relative_to(copy)) for p in copy.glob("usr/lib/python3*/__pycache__/argparse.*.pyc")]
    await a.stop(); await b.stop()
    c = await m.start("c")  # a later start reuses the copy
    out["c_sees"] = (await c.bash("cat /opt/layer/mark 2>&1; echo rc=$?")).output
    await c.stop()
    out["copies_after"] = sorted(p.name for p in unpacked_root(cfg).iterdir() if p.is_dir())
    out["copy_touched"] = any((unpacked_root(cfg) / n / "opt" / "layer").exists() for n in out["copies_after"])
    print(json.dumps(out))

asyncio.run(main(json.loads(sys.argv[1])))
'''


def test_two_sandboxes_share_one_unpacked_copy(scenarios: ScenarioRunner, images: dict[str, str]) -> None:
    local = scenarios.state_dir()
    state = scenarios.state_dir()
    script = scenarios.root / "unpacked_cache_check.py"
    script.write_text(SCRIPT)
    os.chmod(script, 0o644)
    args = json.dumps({"image": images["sif"], "local_dir": str(local), "state_dir": str(state)})
    cmd = [SYSTEM_PYTHON, str(script), args]
    if scenarios.user is not None:
        cmd = ["runuser", "-u", scenarios.user, "--", "env", f"PYTHONPATH={scenarios.root}", *cmd]
    proc = subprocess.run(cmd, cwd=scenarios.root, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(scenarios.root)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if r["fuse"]:
        pytest.skip("this user can mount SIFs with FUSE: no unpacking happens")
    # One copy on the node, made once, run by both sandboxes instead of the SIF.
    assert len(r["copies"]) == 1 and r["copies_after"] == r["copies"]
    assert list(r["runs"]) == [images["sif"]]
    assert Path(r["runs"][images["sif"]]).name == r["copies"][0]
    # Each sandbox writes to its own layer: b and the later c never see a's file, nor does the copy.
    assert r["a_sees"].strip() == "from-a"
    assert "No such file" in r["b_sees"] and "rc=1" in r["b_sees"]
    assert "No such file" in r["c_sees"]
    assert r["copy_touched"] is False
    # The tool server's standard-library imports were compiled into the copy once (the image ships no .pyc).
    assert r["argparse_pyc"], "no bytecode for the tool server's imports in the unpacked copy"
