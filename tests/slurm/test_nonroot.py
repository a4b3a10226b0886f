"""A deployment launched, used and taken down by an unprivileged user, as on a real cluster.

Runs ``prorl launch`` -> ``prorl submit`` -> ``prorl status`` -> ``prorl down``
as the test user (``scripts/provision/40-testuser.sh``) with the world-readable
Python of ``scripts/provision/55-user-python.sh`` and a copy of this tree the
user can read, so its Slurm jobs run as that user too. PRORL_HOME is a folder
that user owns.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.cluster import ROLE_CONFIG, require_slurm, write_yaml

REPO = Path(__file__).resolve().parents[2]
TEST_USER = "prorl-test"
USER_PYTHON = Path(os.environ.get("PRORL_USER_VENV", "/opt/prorl-venv")) / "bin" / "python"
NAME = "nonroot"

pytestmark = pytest.mark.timeout(600)


class AsUser:
    """Runs the real CLI as the test user (as ourselves when the tests already run unprivileged)."""

    def __init__(self, root: Path, user: str | None) -> None:
        self.root = root
        self.user = user
        self.home = root / "home"

    def prorl(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(self.root / "tree"), "PRORL_HOME": str(self.home),
               "COLUMNS": "200", "LANG": "C.UTF-8"}
        cmd = [str(USER_PYTHON), "-m", "prorl_cli", *args]
        if self.user is not None:
            # A clean environment of the user's own (``env -i``): nothing of root's leaks into its jobs.
            pw = pwd.getpwnam(self.user)
            cmd = ["runuser", "-u", self.user, "--", "env", "-i", f"HOME={pw.pw_dir}", f"USER={self.user}",
                   *(f"{k}={v}" for k, v in env.items()), *cmd]
            env = dict(os.environ)
        else:
            env = {**os.environ, **env}
        return subprocess.run(cmd, cwd=self.root, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture
def as_user() -> Iterator[AsUser]:
    require_slurm()
    user: str | None = None
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam(TEST_USER)
        except KeyError:
            pytest.skip(f"test user {TEST_USER} missing (run scripts/provision/40-testuser.sh as root)")
        user = TEST_USER
    if not USER_PYTHON.exists():
        pytest.skip(f"{USER_PYTHON} missing: a Python the user can run (run scripts/provision/55-user-python.sh as root)")
    # Under /tmp, not pytest's tmp_path: that sits in root's private folder, out of the user's reach.
    root = Path(tempfile.mkdtemp(prefix="prorl-nonroot-"))
    root.chmod(0o755)
    for part in ("prorl_cli", "handlers"):
        shutil.copytree(REPO / part, root / "tree" / part, ignore=shutil.ignore_patterns("__pycache__"))
    runner = AsUser(root, user)
    runner.home.mkdir()
    if user is not None:
        for path in (runner.home, root):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    subprocess.run(["chmod", "-R", "a+rX", str(root / "tree")], check=True)
    try:
        yield runner
    finally:
        if (runner.home / NAME / "launch.json").exists():  # a failure before `down`: leave nothing queued
            runner.prorl("down", NAME, timeout_s=200)
        shutil.rmtree(root, ignore_errors=True)


def _squeue_users(job_ids: list[str]) -> set[str]:
    out = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%u"], capture_output=True, text=True, check=False)
    return set(out.stdout.split())


def test_an_unprivileged_user_launches_submits_and_takes_down(as_user: AsUser) -> None:
    config = write_yaml(as_user.root / "prorl.yaml", ROLE_CONFIG)
    deploy = write_yaml(as_user.root / "deploy.yaml", {
        "deployment": NAME, "config": str(config), "rendezvous_wait_s": 240,
        "broker": {"time": "15", "cpus_per_task": 1, "mem_gb": 0.5},
        "nodes": {"count": 2, "time": "15", "cpus_per_task": 1, "mem_gb": 0.5},
    })
    up = as_user.prorl("launch", str(deploy), "--wait-s", "240")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "is up" in up.stdout
    record = json.loads((as_user.home / NAME / "launch.json").read_text())
    job_ids = [m["job_id"] for m in record["members"]]
    assert len(job_ids) == 3
    if as_user.user is not None:
        assert _squeue_users(job_ids) == {as_user.user}, "the Slurm jobs run as the user, not root"

    tasks = as_user.root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"echo": i, "sleep_s": {"run": 0.2}}) + "\n" for i in range(6)))
    out = as_user.home / "results.jsonl"
    sub = as_user.prorl("-d", NAME, "submit", str(tasks), "--task", "test", "--out", str(out))
    assert sub.returncode == 0, sub.stdout + sub.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["output"]["echo"] for r in results) == list(range(6))
    assert {r["state"] for r in results} == {"done"}

    st = as_user.prorl("status", NAME, "--json")
    assert st.returncode == 0, st.stderr
    runtimes = {n["node_id"]: n["sandbox_runtime"] for n in json.loads(st.stdout)["nodes"]}
    assert runtimes == {"node-0": "apptainer", "node-1": "apptainer"}, "rootless Apptainer works for the user"

    down = as_user.prorl("down", NAME, timeout_s=200)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not _squeue_users(job_ids), "nothing of it left in squeue"
    assert not (as_user.home / NAME / "broker.json").exists()
    assert not (as_user.home / NAME / "launch.json").exists()
