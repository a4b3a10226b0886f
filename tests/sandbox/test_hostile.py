"""Hostile agent code, tried on purpose, as a job's tool calls through the real broker and node.

Each case runs two ``sandbox_bash`` jobs on one node (one deployment per
runtime, shared by the cases): a hostile one whose bash/python calls attack
the sandbox's limits and isolation, and a benign one that works alongside it
(it starts its calls once the hostile job has started its own, and makes one
more once the hostile job's sandbox is gone). Every case checks that

* the node is still up and the benign job ends ``done``;
* the hostile job ends as the docs say (contained and ``done``, or ``failed``
  with an error naming the limit), never a node crash or a hang;
* no secret of the deployment (the CURVE keys under $PRORL_HOME/<deployment>,
  the node's environment) appears in any output;
* nothing of either sandbox survives its job: no process in its pid namespace,
  its session or its cgroup, no session folder, no cgroup, no record.

The matrix runs its node as root, as in ``test_node_e2e.py`` (Apptainer with
fakeroot): the sandboxes' root is the host's uid 0, the hardest case (the kernel
does not apply RLIMIT_NPROC to it; file permissions alone do not protect the
host's sysctls from it). ``test_hostile_rootless`` runs the cases whose defence
differs for an ordinary user (processes, memory, disk, output, ``kill -9 -1``,
the user's own keys and sandboxes) with broker and node as the unprivileged
test user, as users run them: no cgroup can be made there (this machine has
cgroup v1), so RLIMIT_NPROC per user namespace bounds processes and the node's
measurement bounds a sandbox's memory. Limits are small (docs/sandbox.md,
"Limits"), and every loop in the hostile commands is bounded.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.node.registry import ENV_HANDLER_PATHS
from prorl_cli.protocol import JobResult, JobState
from prorl_cli.sandbox.cgroups import find_parents
from prorl_cli.sandbox.runtime import session_members, stat_fields
from tests.harness import Deployment
from tests.sandbox.conftest import ScenarioRunner

MAX_PROCS = 64
MEM_GB = 0.5
SCRATCH_MB = 64  # sandbox.writable_size_mb: bounded tmpfs
DISK_MB = 64
OUTPUT_LIMIT_MB = 16
MAX_OUTPUT_BYTES = 64 * 1024
SANDBOX = {
    "mem_gb": MEM_GB, "max_procs": MAX_PROCS, "writable_size_mb": SCRATCH_MB, "disk_mb": DISK_MB,
    "disk_check_s": 0.5, "memory_check_s": 0.5, "output_limit_mb": OUTPUT_LIMIT_MB, "max_output_bytes": MAX_OUTPUT_BYTES,
    "tool_timeout_s": 60.0,
}
PAIR_TIMEOUT_S = 300.0
#: A Python the unprivileged user can run with prorl's dependencies (scripts/provision/55-user-python.sh).
USER_PYTHON = Path(os.environ.get("PRORL_USER_VENV", "/opt/prorl-venv")) / "bin" / "python"


class HostileDeployment(Deployment):
    """A deployment whose servers' environment holds secrets, and Apptainer variables that would hand them on.

    ``APPTAINERENV_X`` becomes ``X`` in an Apptainer sandbox, and ``APPTAINER_BIND`` a bind: here, of $PRORL_HOME.
    """

    def __init__(self, home: Path, name: str, config: dict[str, Any]) -> None:
        super().__init__(home, name, config)
        self.secret_env = {
            "PRORL_TEST_NODE_SECRET": f"node-secret-{secrets.token_hex(8)}",
            "APPTAINERENV_PRORL_TEST_LEAK": f"apptainerenv-secret-{secrets.token_hex(8)}",
            "SINGULARITYENV_PRORL_TEST_LEAK": f"singularityenv-secret-{secrets.token_hex(8)}",
        }

    def env(self) -> dict[str, str]:
        env = super().env()
        env.update(self.secret_env)
        env["APPTAINER_BIND"] = env["SINGULARITY_BIND"] = f"{self.home}:/leak-home"
        return env


class RootlessDeployment(HostileDeployment):
    """The same, with broker and node run as an unprivileged user (``setpriv``), from a copy of the package
    that user can read (``tree``), with a Python of its own; ``home`` belongs to that user."""

    def __init__(self, home: Path, name: str, config: dict[str, Any], user: str | None, tree: Path) -> None:
        super().__init__(home, name, config)
        self.user, self.tree = user, tree

    def env(self) -> dict[str, str]:
        env = super().env()
        env[ENV_HANDLER_PATHS] = str(self.tree / "prorl_cli" / "testing" / "handlers")
        env["PYTHONPATH"] = str(self.tree)
        return env

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        argv = [str(USER_PYTHON), "-m", "prorl_cli", "-d", self.name, *args]
        if self.user is not None:
            # setpriv execs (the server keeps the pid the harness waits for); the user's own HOME and names.
            pw = pwd.getpwnam(self.user)
            argv = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups", "env",
                    f"HOME={pw.pw_dir}", f"USER={self.user}", f"LOGNAME={self.user}", *argv]
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=self.home)
        self.procs[name] = proc
        return proc


@dataclass
class Node:
    """The shared deployment of one runtime."""

    deployment: HostileDeployment
    runtime: str
    local_dir: Path
    cgroups: bool  # the node makes a cgroup per sandbox (sandbox.cgroups, and this machine lets root make them)
    serial: int = 0
    rootless: bool = False  # broker and node run as the unprivileged test user

    def secrets(self) -> list[str]:
        """Everything that must never reach a sandbox's output."""
        found = list(self.deployment.secret_env.values())
        for name in ("client.key", "server.key"):
            key = json.loads((self.deployment.deployment_dir / name).read_text())
            found.append(key["secret"])
        found.append(f"PRORL_HOME={self.deployment.home}")
        return found


@pytest.fixture(scope="module", params=[
    pytest.param(("apptainer", True), id="apptainer", marks=pytest.mark.apptainer),
    pytest.param(("bwrap", True), id="bwrap", marks=pytest.mark.bwrap),
    # The documented fallback where no cgroup can be made: rlimits only.
    pytest.param(("bwrap", False), id="bwrap-rlimits-only", marks=pytest.mark.bwrap),
])
def node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         images: dict[str, str]) -> Iterator[Node]:
    runtime, cgroups = request.param
    request.getfixturevalue(f"need_{runtime}")
    if os.geteuid() != 0:
        pytest.skip("the hostile matrix runs its node as root (the sandboxes' hardest case); run the tests as root")
    root = tmp_path_factory.mktemp(f"hostile-{runtime}")
    local_dir = root / "sb"
    image = images["sif"] if runtime == "apptainer" else images["rootfs"]
    d = HostileDeployment(root / "home", "hostile", {
        "sandbox": {"runtime": runtime, "image": image, "local_dir": str(local_dir), "cgroups": cgroups, **SANDBOX},
        "jobs": {"timeout_s": 240.0},
    })
    try:
        d.start_broker()
        d.start_node("n1")
        # Where root may not make cgroups (a container with a read-only cgroup tree), the fallback is tested.
        yield Node(d, runtime, local_dir, cgroups and find_parents()[0] is not None)
    finally:
        d.close()


@pytest.fixture(scope="module")
def rootless_node(request: pytest.FixtureRequest, images: dict[str, str],
                  scenarios: ScenarioRunner) -> Iterator[Node]:
    """A deployment of one runtime whose broker and node run as the unprivileged test user."""
    runtime = request.param
    request.getfixturevalue(f"need_{runtime}")
    if not USER_PYTHON.exists():
        pytest.skip(f"{USER_PYTHON} missing: a Python the test user can run (scripts/provision/55-user-python.sh)")
    # Under /tmp, not pytest's tmp_path: that sits in root's private folder, out of the user's reach.
    root = Path(tempfile.mkdtemp(prefix=f"prorl-hostile-{runtime}-"))
    root.chmod(0o755)
    home, local_dir = root / "home", root / "sb"
    home.mkdir()
    if scenarios.user is not None:
        pw = pwd.getpwnam(scenarios.user)
        os.chown(home, pw.pw_uid, pw.pw_gid)
        os.chown(root, pw.pw_uid, pw.pw_gid)
    image = images["sif"] if runtime == "apptainer" else images["rootfs"]
    d = RootlessDeployment(home, "hostile", {
        "sandbox": {"runtime": runtime, "image": image, "local_dir": str(local_dir), **SANDBOX},
        "jobs": {"timeout_s": 240.0},
    }, scenarios.user, scenarios.root)
    try:
        d.start_broker()
        d.start_node("n1")
        assert "rlimits only, no per-sandbox cgroups" in d.log("n1"), d.log("n1")
        yield Node(d, runtime, local_dir, cgroups=False, rootless=True)
    finally:
        d.close()
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Outcome:
    hostile: JobResult
    benign: JobResult
    node: Node

    def steps(self) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = self.hostile.output["steps"]
        return steps

    @property
    def cgroup(self) -> bool:
        return bool(self.hostile.output["sandbox"]["cgroups"])


BENIGN_STEPS: list[dict[str, Any]] = [
    {"bash": "echo benign-start; python3 -c 'print(sum(range(10 ** 6)))'"},
    # Its own listener answers (so a hostile job that cannot reach it is kept out, not facing a dead port).
    {"python": "import socket\n"
               "s = socket.create_connection(('@@peer_ip@@', @@peer_port@@), timeout=20)\n"
               "print(s.recv(100).decode().strip())"},
    {"bash": "cd /tmp && echo benign > file && cat file"},
]
BENIGN_AFTER: list[dict[str, Any]] = [{"bash": "echo still-serving"}]


def run_pair(node: Node, case: str, steps: list[dict[str, Any]], **extra: Any) -> Outcome:
    """Run the hostile ``steps`` and a benign job side by side; check what every case must hold."""
    node.serial += 1
    pair = f"{case}-{node.serial}"
    benign = {"role": "benign", "pair": pair, "steps": BENIGN_STEPS, "after": BENIGN_AFTER,
              "pair_timeout_s": PAIR_TIMEOUT_S}
    hostile = {"role": "hostile", "pair": pair, "steps": steps, "pair_timeout_s": PAIR_TIMEOUT_S, **extra}
    client = node.deployment.client
    benign_id, hostile_id = client.submit("sandbox_bash", [benign, hostile])
    benign_result, hostile_result = client.wait([benign_id, hostile_id], timeout_s=2 * PAIR_TIMEOUT_S)
    outcome = Outcome(hostile_result, benign_result, node)
    _check_node_and_benign(outcome)
    _check_no_secret(outcome)
    for result in (hostile_result, benign_result):
        _check_nothing_left(node, result)
    return outcome


def _check_node_and_benign(o: Outcome) -> None:
    proc = o.node.deployment.procs["n1"]
    assert proc.poll() is None, o.node.deployment.log("n1")
    status = o.node.deployment.client.status()
    assert any(n.node_id == "n1" and n.alive for n in status.nodes)
    b = o.benign
    assert b.state == JobState.DONE.value, (b.error, b.output)
    steps, after = b.output["steps"], b.output["after"]
    assert steps[0]["output"] == "benign-start\n499999500000\n"
    assert steps[1]["stdout"] == "peer-listener-reached\n"
    assert steps[2]["output"] == "benign\n"
    assert after[0]["output"] == "still-serving\n"
    assert b.output["stop_reason"] is None


def _check_no_secret(o: Outcome) -> None:
    dumped = json.dumps([o.hostile.output, o.hostile.error, o.benign.output])
    for secret in o.node.secrets():
        assert secret not in dumped


def _alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _in_namespaces(namespaces: set[str], before_ticks: int) -> list[int]:
    """Live processes (zombies are dead) in any of the given pid namespaces, started before ``before_ticks``.

    Any process left in a sandbox's pid namespace keeps the namespace's init alive (its exit waits for them
    all), and that init started before the sandbox was ready (``before_ticks``). Later processes in a namespace
    of that number are another's: the kernel reuses a freed namespace's number (other sandboxes start all
    the time on a shared machine).
    """
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ns = os.readlink(f"/proc/{entry}/ns/pid")
            except OSError:
                continue
            fields = stat_fields(entry)
            if ns in namespaces and _alive(int(entry)) and fields is not None and int(fields[19]) <= before_ticks:
                found.append(int(entry))
    return found


def _describe(pids: list[int]) -> str:
    """What the given processes are (for a failure's message)."""
    done = subprocess.run(["ps", "-o", "pid,ppid,pgid,sid,uid,stat,etimes,args", "-p", ",".join(map(str, pids))],
                          capture_output=True, text=True, check=False)
    return done.stdout


def _check_nothing_left(node: Node, result: JobResult) -> None:
    box = result.output["sandbox"]
    assert box["pid_namespaces"], box  # the sandbox had a pid namespace of its own
    left = _in_namespaces(set(box["pid_namespaces"]), box["ready_ticks"])
    assert left == [], _describe(left)
    assert [p for p in session_members(box["pid"]) if _alive(p)] == []
    assert not Path(box["session_dir"]).exists()
    for cgroup in box["cgroups"]:
        assert not Path(cgroup).exists()
    records = node.deployment.deployment_dir / "nodes" / "n1" / "sandboxes"
    assert not any(records.glob(f"{box['id']}.json"))
    assert box["id"] not in os.listdir(node.local_dir)
    assert result.output["stopped_before_eval"] is True


def _failed_naming(o: Outcome, *words: str) -> None:
    h = o.hostile
    assert h.state == JobState.FAILED.value, (h.state, h.output)
    assert h.error is not None and h.error["type"] == "SandboxError" and h.error["stage"] == "run", h.error
    for word in words:
        assert word in h.error["message"], h.error
    assert h.output["stop_reason"] and words[0] in h.output["stop_reason"]


def _done(o: Outcome) -> None:
    assert o.hostile.state == JobState.DONE.value, (o.hostile.error, o.hostile.output)
    assert o.hostile.output["stop_reason"] is None


# --------------------------------------------------------------------------------------------- the cases
def fork_bomb(node: Node) -> None:
    if not node.cgroups and not node.rootless:
        # Documented fallback: a root node's sandboxes are the host's uid 0, which the kernel exempts from
        # RLIMIT_NPROC; without a pids cgroup nothing bounds their processes, and the node says so at start.
        # (Rootless nodes: RLIMIT_NPROC holds, test_lifecycle.py::test_fork_bomb_and_memory_hog_are_contained.)
        assert "sandbox.max_procs is NOT enforced" in (node.deployment.logs / "n1.log").read_text()
        return
    # In the foreground: it grows until forks fail, and the call's timeout ends it (Ctrl-C, then SIGKILL).
    o = run_pair(node, "fork-bomb", [{"bash": "f() { f | f; }; f", "timeout_s": 5},
                                     {"bash": "echo after-bomb"}])
    _done(o)
    bomb, after = o.steps()
    assert bomb["timed_out"] is True
    assert "Resource temporarily unavailable" in bomb["output"]  # bash: fork: retry: ...
    # The shell still serves. (Bomb processes forked as the interrupt came may go on, and print, until the
    # sandbox is stopped: the same limit holds them, and the stop takes them with the rest.)
    assert after["exit_code"] == 0 and "after-bomb\n" in after["output"], after
    if node.rootless:
        # RLIMIT_NPROC, counted per (user namespace, uid): the sandbox's own uid 0 holds max_procs, and the
        # node, the same user outside, still forks (the benign job and the node's checks in run_pair).
        assert not o.cgroup and o.hostile.output["limit_events"] == {}
    else:
        assert o.cgroup and o.hostile.output["limit_events"]["pids_max"] > 0  # forks refused at pids.max


# Allocations past RLIMIT_AS at once: MemoryError, deterministically. (A process that grows slowly towards
# mem_gb may meet the sandbox's memory cgroup first, whose OOM killer ends it: spread_memory_bomb.)
MEMORY_BOMB = """python3 -c 'x = bytearray(2 << 30)' 2>&1 | tail -1
python3 -c 'x = [0] * (400 << 20)' 2>&1 | tail -1
cat /proc/self/oom_score_adj
echo bombs-done"""


def memory_bomb(node: Node) -> None:
    o = run_pair(node, "memory-bomb", [{"bash": MEMORY_BOMB}])
    _done(o)
    lines = o.steps()[0]["output"].splitlines()
    # RLIMIT_AS: mem_gb per process; and the host's OOM killer would take the sandbox's processes first.
    assert lines == ["MemoryError", "MemoryError", "1000", "bombs-done"], lines


# Children that each stay under RLIMIT_AS (mem_gb) but together hold more than mem_gb; they hold their
# memory until all are ready (or dead), through pipes, not sleeps.
SPREAD_MEMORY_BOMB = """python3 - <<'EOF'
import os
N, MB = 4, 200
ready_r, ready_w = os.pipe()
hold_r, hold_w = os.pipe()
kids = []
for _ in range(N):
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(hold_w)
        try:
            data = b"\\1" * (MB << 20)
        except MemoryError:
            os._exit(3)
        os.write(ready_w, b"r")
        os.close(ready_w)
        os.read(hold_r, 1)  # until the parent lets go
        os._exit(0)
    kids.append(pid)
os.close(ready_w)
os.close(hold_r)
got = b""
while len(got) < N:
    chunk = os.read(ready_r, N)
    if not chunk:
        break  # every child is ready or dead
    got += chunk
import time
time.sleep(HOLD_S)  # the hostile part: hold it all (bounded)
os.close(hold_w)
codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in kids]
print("codes", sorted(codes))
EOF"""
#: How long the children of the spread bomb hold their memory once all have it, where only the node's
#: measurement (sandbox.memory_check_s, 0.5 s here) bounds their sum.
MEMORY_HOLD_S = 60


def spread_memory_bomb(node: Node) -> None:
    hold_s = 0 if node.cgroups else MEMORY_HOLD_S
    o = run_pair(node, "spread-memory-bomb", [{"bash": SPREAD_MEMORY_BOMB.replace("HOLD_S", str(hold_s)),
                                               "timeout_s": 2 * MEMORY_HOLD_S}])
    assert o.cgroup == node.cgroups
    if not o.cgroup:
        # No memory cgroup (rootless, or cgroups off): each process is bounded (RLIMIT_AS), and the node sums
        # the sandbox's processes' memory and stops it over mem_gb.
        _failed_naming(o, "sandbox.mem_gb", f"over its limit of {MEM_GB:g} GB")
        return
    # The memory cgroup bounds the sandbox as a whole: the OOM killer ends a child inside it.
    _done(o)
    line = o.steps()[0]["output"].strip().splitlines()[-1]
    codes = json.loads(line.removeprefix("codes "))
    assert -9 in codes, codes
    assert o.hostile.output["limit_events"]["oom_kill"] > 0


def fill_tmp(node: Node) -> None:
    cmd = ("for d in /tmp /dev/shm; do for i in $(seq 1 100); do "
           "head -c 1048576 /dev/zero > $d/fill$i 2>/dev/null || { echo \"$d full at $i\"; break; }; done; done; "
           "rm -f /tmp/fill* /dev/shm/fill*; echo cleaned")
    o = run_pair(node, "fill-tmp", [{"bash": cmd}, {"bash": "echo after-fill > /tmp/x && cat /tmp/x"}])
    _done(o)
    fill, after = o.steps()
    assert "/tmp full at" in fill["output"] and "/dev/shm full at" in fill["output"], fill["output"]
    assert fill["output"].endswith("cleaned\n")
    assert after["output"] == "after-fill\n"


def _fill_then_keep_writing(folder: str) -> str:
    """Fill ``folder`` past the disk limit; if no write fails, keep rewriting (bounded) until the node stops it."""
    return (f"mkdir -p {folder} && cd {folder} && for i in $(seq 1 100); do "
            "head -c 1048576 /dev/zero > fill$i 2>/dev/null || { echo \"full at $i\"; break; }; done; "
            "if [ $i -eq 100 ]; then for j in $(seq 1 100000); do head -c 1048576 /dev/zero > fill1 || break; done; "
            "echo \"still writing after $j rewrites\"; fi")


def fill_workspace(node: Node) -> None:
    o = run_pair(node, "fill-workspace", [{"bash": _fill_then_keep_writing("/work"), "timeout_s": 60},
                                          {"bash": "echo after-fill"}])
    if node.runtime == "bwrap":
        # The writable layer is a tmpfs of writable_size_mb: the writes fail, the tools go on.
        _done(o)
        fill, after = o.steps()
        assert "full at" in fill["output"] and after["output"] == "after-fill\n"
    else:
        # Apptainer's overlay is on the node's disk: the node measures it and stops the sandbox.
        _failed_naming(o, "sandbox.disk_mb", f"over its limit of {DISK_MB} MB")
        assert len(o.steps()) == 1 and "error" in o.steps()[0]


def fill_run_dir(node: Node) -> None:
    # The run directory (the socket's, bound from the node's disk) is writable in every runtime: measured too.
    o = run_pair(node, "fill-run-dir", [{"bash": _fill_then_keep_writing("/.prorl/run/junk"), "timeout_s": 60},
                                        {"bash": "echo unreachable"}])
    _failed_naming(o, "sandbox.disk_mb", f"over its limit of {DISK_MB} MB")


def stdout_flood(node: Node) -> None:
    o = run_pair(node, "stdout-flood", [
        {"bash": "head -c 1073741824 /dev/zero | tr '\\0' x; echo never"},
        {"python": "import sys\nfor _ in range(1024):\n    sys.stdout.write('y' * (1 << 20))\n'z' * (64 << 20)"},
        {"bash": "echo after-flood"},
    ])
    _done(o)
    bash, python, after = o.steps()
    # Interrupted at the output limit, long before 1 GiB; what comes back is max_output_bytes.
    assert bash["output_limited"] is True and bash["truncated"] is True
    assert OUTPUT_LIMIT_MB << 20 < bash["output_bytes"] < 1 << 30
    assert len(bash["output"]) < MAX_OUTPUT_BYTES + 200 and "never" not in bash["output"]
    # The python tool keeps the head and tail of its streams and of the result's repr (memory stays bounded).
    assert len(python["stdout"]) < MAX_OUTPUT_BYTES + 200
    assert "output truncated: 1073741824 bytes in all" in python["stdout"]
    assert python["result"] is not None and len(python["result"]) < MAX_OUTPUT_BYTES + 200
    assert after["output"] == "after-flood\n"


def kill_everything(node: Node) -> None:
    o = run_pair(node, "kill-all", [{"bash": "kill -9 -1; echo survived"}, {"bash": "echo unreachable"}])
    # It kills the tool server (everything of its uid in its pid namespace but the namespace's init): the
    # job fails naming that, and the node stops what is left of the sandbox.
    _failed_naming(o, "its tool server died")
    assert len(o.steps()) == 1 and "error" in o.steps()[0]


READ_SECRETS = [
    {"bash": "ls -la @@home@@ @@deployment_dir@@ /leak-home 2>&1; "
             "cat @@deployment_dir@@/client.key @@deployment_dir@@/server.key /leak-home/hostile/client.key 2>&1"},
    {"bash": "find / \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -name '*.key' -print 2>/dev/null | "
             "head -20; echo find-done"},
    {"bash": "env; echo ---; cat /proc/1/environ | tr '\\0' '\\n'; echo ---; "
             "for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done 2>/dev/null | sort -u"},
    {"bash": "cat /proc/@@node_pid@@/environ 2>&1 | tr '\\0' '\\n'; ls /proc/@@node_pid@@/root/ 2>&1 | head -5"},
    {"python": "import os\nsorted(os.environ)"},
]


def read_secrets(node: Node) -> None:
    o = run_pair(node, "read-secrets", READ_SECRETS)
    _done(o)
    listing, found, env, node_env, py_env = o.steps()
    assert "No such file or directory" in listing["output"]
    assert "-rw-------" not in listing["output"]  # no key file listed
    assert found["output"] == "find-done\n"  # no key file anywhere in the sandbox
    for name in ("PRORL_HOME", "PRORL_CONFIG", "PRORL_TEST_NODE_SECRET", "PRORL_TEST_LEAK"):
        assert name not in env["output"] and name not in py_env["result"]
    assert "PRORL_LOOPBACK_IP" in py_env["result"]  # the sandbox's own variables are there
    assert "PRORL_HOME" not in node_env["output"]
    # (The secrets themselves, keys and variables, are checked absent from every output by run_pair.)


def reach_other_jobs(node: Node) -> None:
    o = run_pair(node, "other-jobs", [
        {"bash": "ls -la @@peer_session_dir@@ @@peer_session_dir@@/run @@local_dir@@ 2>&1; "
                 "cat @@peer_session_dir@@/sandbox.log 2>&1; ls -a /.prorl/run"},
    ])
    _done(o)
    out = o.steps()[0]["output"]
    assert out.count("No such file or directory") == 4, out
    assert "gw.sock" not in out  # only its own run directory (the tool server's socket) is there


NETWORK = """python3 - <<'EOF'
import socket
targets = [("broker", socket.AF_INET, ("@@broker_host@@", int("@@broker_port@@"))),
           ("peer-listener", socket.AF_INET, ("@@peer_ip@@", int("@@peer_port@@"))),
           ("peer-gateway-socket", socket.AF_UNIX, "@@peer_gateway@@")]
for name, family, address in targets:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(address)
        print(name, "CONNECTED", s.recv(100))
    except OSError as e:
        print(name, "refused:", e)
    finally:
        s.close()
EOF"""


def reach_network(node: Node) -> None:
    o = run_pair(node, "network", [{"bash": NETWORK}])
    _done(o)
    out = o.steps()[0]["output"]
    assert out.count("refused:") == 3, out
    assert "CONNECTED" not in out and "peer-listener-reached" not in out


HOST_KERNEL = """v=$(cat /proc/sys/kernel/panic); (echo "$v" > /proc/sys/kernel/panic) 2>/dev/null && echo SYSCTL-WRITTEN
for f in /proc/sysrq-trigger /sys/kernel/mm/transparent_hugepage/enabled /etc/localtime /etc/hosts /etc/resolv.conf; do
  [ -e "$f" ] && [ -w "$f" ] && echo "WRITABLE $f"
done
ls /sys/fs/cgroup 2>/dev/null | head -3
(echo $$ > /sys/fs/cgroup/pids/cgroup.procs) 2>/dev/null && echo CGROUP-LEFT
echo checked"""


def host_kernel(node: Node) -> None:
    o = run_pair(node, "host-kernel", [{"bash": HOST_KERNEL}])
    _done(o)
    # Root's sandboxes are the host's uid 0: /proc/sys, /sys, /etc binds and the cgroup tree are read-only or hidden.
    assert o.steps()[0]["output"] == "checked\n", o.steps()[0]["output"]


CASES: dict[str, Callable[[Node], None]] = {
    fn.__name__: fn for fn in (
        fork_bomb, memory_bomb, spread_memory_bomb, fill_tmp, fill_workspace, fill_run_dir, stdout_flood,
        kill_everything, read_secrets, reach_other_jobs, reach_network, host_kernel,
    )
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile(case: str, node: Node) -> None:
    CASES[case](node)


#: The cases whose defence differs for a node run by an ordinary user without cgroups (processes, memory,
#: disk measured through a user namespace, output, kill -1 as that user, the user's own keys and sandboxes).
ROOTLESS_CASES = ("fork_bomb", "memory_bomb", "spread_memory_bomb", "fill_workspace", "fill_run_dir",
                  "stdout_flood", "kill_everything", "read_secrets", "reach_other_jobs")


#: (runtime, case): filling the workspace differs only for Apptainer (its overlay is on the node's disk);
#: bubblewrap's workspace is its tmpfs root, tried in the root matrix.
ROOTLESS_MATRIX = [
    pytest.param(runtime, case, marks=getattr(pytest.mark, runtime), id=f"{runtime}-{case}")
    for runtime in ("apptainer", "bwrap") for case in ROOTLESS_CASES
    if not (runtime == "bwrap" and case == "fill_workspace")
]


@pytest.mark.slow
@pytest.mark.parametrize(("rootless_node", "case"), ROOTLESS_MATRIX, indirect=["rootless_node"])
def test_hostile_rootless(case: str, rootless_node: Node) -> None:
    CASES[case](rootless_node)
