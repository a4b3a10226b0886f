"""One deployment launched on a real Slurm and exercised end to end.

1 broker job, a 3-task node array (one per Slurm node), a 2-task inference
array with one fake GPU each (transformers engine, tiny model); 100 math
rollouts; status with both views; scancel of a node task mid-run; the
supervisor killed and started again by its broker; requeue of
the broker (journal replay), made eligible again by its nodes and bridges
without waiting out Slurm's requeue delay; status while the broker restarts;
a node requeued on SIGUSR2, released by the supervisor and not counted as a
failure; scale up, and down: a pending task first, then the least loaded one,
drained with its running jobs delivered once; the broker killed mid-run,
replaced by its peers, its journal replayed; down leaves nothing, and only
the tasks that were killed were replaced.
The tests share the deployment and run in file order.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from prorl_cli.client import RolloutClient
from prorl_cli.config import load_config
from prorl_cli.exceptions import BrokerUnavailable
from prorl_cli.slurm import squeue
from prorl_cli.slurm.record import HISTORY_NAME, SUPERVISION_NAME, LaunchRecord
from tests.slurm.cluster import (
    ROLE_CONFIG,
    logs_of,
    node_memory_gb,
    prorl,
    require_slurm,
    scontrol,
    wait_until,
    write_yaml,
)

NAME = "slurmtest"
pytestmark = pytest.mark.timeout(600)


class Launched:
    def __init__(self, home: Path, deploy_file: Path, model: Path, gate: Path) -> None:
        self.home = home
        self.deploy_file = deploy_file
        self.model = model
        #: While this file exists, a broker job that starts waits in its setup line (running, no broker yet).
        self.gate = gate
        self.dir = home / NAME
        self._client: RolloutClient | None = None

    @property
    def record(self) -> LaunchRecord:
        record = LaunchRecord.load(self.dir)
        assert record is not None
        return record

    @property
    def client(self) -> RolloutClient:
        if self._client is None:
            self._client = RolloutClient(NAME, config=load_config(overrides={"home": str(self.home), "deployment": NAME}))
        return self._client

    def alive_nodes(self) -> set[str]:
        return {n.node_id for n in self.client.status().nodes if n.alive}

    def member(self, peer_id: str) -> Any:
        return next(m for m in self.record.members if m.peer_id == peer_id)

    def node_pid(self, node_id: str) -> int | None:
        return next((n.pid for n in self.client.status().nodes if n.node_id == node_id and n.alive), None)

    def supervised(self) -> dict[str, Any]:
        """supervision.json's names: what the supervisor counted as failures (and replaced)."""
        path = self.dir / SUPERVISION_NAME
        return json.loads(path.read_text())["names"] if path.exists() else {}

    def run_load(self, n: int, sleep_s: float, during: Any) -> None:
        """Submit ``n`` jobs, call ``during()`` while they run; every job finishes once, done."""
        ids = self.client.submit("test", [{"echo": i, "sleep_s": {"run": sleep_s}} for i in range(n)], timeout_s=120)
        during()
        results = self.client.wait(ids, timeout_s=240)
        assert sorted(r.job_id for r in results) == sorted(ids), "every job answered once"
        assert collections.Counter(r.state for r in results) == {"done": n}
        assert sorted(r.output["echo"] for r in results) == list(range(n)), "no job lost or doubled"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    require_slurm()
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install 'prorl[cpu]'; scripts/install.sh does it)")
    from prorl_cli.inference.tiny_model import make_tiny_model

    base = tmp_path_factory.mktemp("slurm")
    model = make_tiny_model(base / "model")
    home = base / "home"
    gate = base / "broker-gate"
    config = write_yaml(base / "prorl.yaml", {**ROLE_CONFIG, "inference": {"tokenizer": str(model)}})
    deploy = write_yaml(base / "deploy.yaml", {
        "deployment": NAME, "home": str(home), "config": str(config), "rendezvous_wait_s": 300,
        "broker": {"time": "30", "cpus_per_task": 1, "mem_gb": 0.5,
                   "setup": [f"while [ -e {gate} ]; do sleep 0.2; done"]},
        # 60% of a node's memory each: no two node tasks share a Slurm node.
        "nodes": {"count": 3, "time": "30", "cpus_per_task": 1, "mem_gb": round(node_memory_gb() * 0.6, 1)},
        "inference": {"count": 2, "time": "30", "cpus_per_task": 1, "mem_gb": 0.5, "gpus_per_task": 1,
                      "engine": "transformers", "model": str(model)},
    })
    up = prorl(home, "launch", str(deploy), "--wait-s", "300", timeout_s=400)
    launched = Launched(home, deploy, model, gate)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "is up" in up.stdout
        yield launched
    finally:
        if launched._client is not None:
            launched._client.close()
        record = LaunchRecord.load(home / NAME)
        if record is not None:  # a test failed before `down`: leave nothing behind
            prorl(home, "down", NAME, timeout_s=200)
            squeue.cancel(t.job_id for t in squeue.active(record.job_ids))


def test_launch_places_every_role(launched: Launched) -> None:
    record = launched.record
    assert [m.role for m in record.members].count("broker") == 1
    rows = {t.job_id: t for t in squeue.query(record.job_ids)}
    node_hosts = {rows[m.job_id].nodes for m in record.of("nodes")}
    assert node_hosts == {"n1", "n2", "n3"}, "one node server per Slurm node"
    status = launched.client.status()
    assert {n.node_id for n in status.nodes if n.alive} == {"node-0", "node-1", "node-2"}
    assert {b.backend_id for b in status.backends} == {"inference-0", "inference-1"}
    for m in record.of("inference"):
        text = logs_of(launched.dir / "slurm" / "inference" / m.job_id)
        gpus = re.findall(r"GPUs visible: (\S+)", text)
        assert gpus and re.fullmatch(r"\d", gpus[-1]), f"{m.peer_id} sees exactly one fake GPU: {gpus}"
    for m in record.of("nodes"):
        assert "GPUs" not in logs_of(launched.dir / "slurm" / "nodes" / m.job_id).split("registered")[0]
    # The same logs through `prorl logs ROLE[INDEX]`.
    shown = prorl(launched.home, "logs", "-d", NAME, "inference[1]")
    assert shown.returncode == 0 and "GPUs visible:" in shown.stdout, shown.stderr


def test_math_rollouts_from_prorl_submit_and_both_views_in_status(launched: Launched, tmp_path: Path) -> None:
    tasks = tmp_path / "math.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1),
                                         "tokenizer": str(launched.model), "max_turns": 2}) + "\n" for i in range(100)))
    out = tmp_path / "results.jsonl"
    sub = prorl(launched.home, "-d", NAME, "submit", str(tasks), "--task", "math_agent", "--max-tokens", "8",
                "--temperature", "1.0", "--seed", "7", "--timeout-s", "300", "--id-prefix", "math", "--out", str(out),
                timeout_s=600)
    results = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    # The tiny model answers at random: a wrong answer is a finished rollout too (reward 0), so all must be done.
    assert collections.Counter(r["state"] for r in results) == {"done": 100}, sub.stdout + sub.stderr
    assert sub.returncode == 0, sub.stderr
    assert sorted(r["job_id"] for r in results) == sorted(f"math-{i}-0" for i in range(100))
    assert {r["node_id"] for r in results} <= {"node-0", "node-1", "node-2"}
    assert "100 job(s)" in sub.stdout
    calls = [c for r in results for c in r["output"]["trajectory"]["calls"]]
    assert len(calls) >= 100, "every rollout called the model"
    assert max(len(c["output_ids"]) for c in calls) <= 8, "--max-tokens 8 reached every generate call"
    st = prorl(launched.home, "status", NAME)  # `prorl status NAME` is `prorl -d NAME status`
    assert st.returncode == 0, st.stderr
    assert "Slurm" in st.stdout and "RUNNING" in st.stdout, "Slurm's view"
    for peer in ("node-0", "node-1", "node-2", "inference-0", "inference-1"):
        assert st.stdout.count(peer) >= 2, f"{peer} in both views"
    # The nodes' sandbox runtime (prorl.yaml's sandbox.runtime: auto, which picks Apptainer here), as each registered it.
    report = json.loads(prorl(launched.home, "status", NAME, "--json").stdout)
    assert report["broker"] == "up" and len(report["slurm"]) == 6, report.get("slurm")  # a launch's JSON has both views
    assert {n["node_id"]: n["sandbox_runtime"] for n in report["nodes"]} == dict.fromkeys(("node-0", "node-1", "node-2"), "apptainer")
    node_rows = [line for line in st.stdout.splitlines() if re.search(r"\bnode-\d\b", line) and "RUNNING" not in line]
    assert len(node_rows) == 3 and all("apptainer" in line for line in node_rows), st.stdout


def test_scancel_of_a_node_task_mid_run_moves_its_jobs(launched: Launched) -> None:
    victim = launched.member("node-1")

    def cancel_when_busy() -> None:
        wait_until(lambda: any(n.node_id == "node-1" and n.inflight for n in launched.client.status().nodes),
                   60, "node-1 to hold jobs")
        squeue.cancel([victim.job_id])

    launched.run_load(40, 1.0, cancel_when_busy)
    assert "node-1" not in launched.alive_nodes()
    assert not squeue.wait_gone([victim.job_id], 60), "the cancelled task left squeue"


def _restarts(job_id: str) -> int:
    return int(squeue.job_detail(job_id).get("Restarts", "0"))


#: What a node or bridge logs when it made the broker's requeued job eligible without Slurm's requeue delay.
BROKER_RELEASED = "requeued and held for Slurm's requeue delay: made it eligible now"


def _peer_logs(launched: Launched) -> str:
    return logs_of(launched.dir / "slurm" / "nodes") + logs_of(launched.dir / "slurm" / "inference")


def test_requeued_broker_replays_its_journal(launched: Launched) -> None:
    broker = launched.member("broker")

    def requeue_broker() -> None:
        wait_until(lambda: launched.client.status().jobs.get("run", 0) > 0, 60, "jobs running")
        scontrol("requeue", broker.job_id)  # by hand; its nodes and bridges release it from Slurm's requeue delay

    launched.run_load(30, 1.5, requeue_broker)
    assert "journal replayed" in logs_of(launched.dir / "slurm" / "broker")
    assert f"the broker's Slurm job {broker.job_id} was {BROKER_RELEASED}" in _peer_logs(launched)
    wait_until(lambda: launched.alive_nodes() >= {"node-0", "node-2"}, 60, "nodes back with the requeued broker")


def _role_process(member: Any) -> psutil.Process:
    """The process running a role in its Slurm task (submitit's function runner, found by the task's environment;
    not the srun that started it, whose command line names the runner too)."""
    array_id, _, task_id = member.job_id.partition("_")
    for proc in psutil.process_iter(["cmdline", "name"]):
        cmdline = proc.info["cmdline"] or []
        if "submitit.core._submit" not in cmdline or proc.info["name"] == "srun":
            continue
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if (env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")) == (array_id, task_id or None) or (
            not task_id and env.get("SLURM_JOB_ID") == array_id
        ):
            return proc
    raise AssertionError(f"no process of {member.peer_id} ({member.job_id})")


def _supervisors(launched: Launched) -> list[psutil.Process]:
    folder = str(launched.dir)
    return [p for p in psutil.process_iter(["cmdline"])
            if "prorl_cli.slurm.supervisor" in (p.info["cmdline"] or []) and folder in (p.info["cmdline"] or [])]


def test_a_killed_supervisor_is_started_again_by_its_broker(launched: Launched) -> None:
    [supervisor] = _supervisors(launched)
    supervisor.kill()
    supervisor.wait(30)
    wait_until(lambda: "while the broker serves: starting it again" in logs_of(launched.dir / "slurm" / "broker"),
               60, "the broker to start its supervisor again")
    [again] = wait_until(lambda: _supervisors(launched), 30, "a new supervisor")
    assert again.pid != supervisor.pid  # the next test's killed inference task is replaced by this one


def test_a_killed_inference_task_is_replaced_under_its_name(launched: Launched) -> None:
    victim = launched.member("inference-1")
    _role_process(victim).kill()  # SIGKILL: no unregister, the task ends FAILED

    def replaced_and_serving() -> bool:
        if launched.member("inference-1").job_id == victim.job_id:
            return False
        return any(b.backend_id == "inference-1" and b.alive for b in launched.client.status().backends)

    def seen() -> str:
        rows = squeue.query([victim.job_id, launched.member("inference-1").job_id], all_states=True)
        supervisor = [line for line in logs_of(launched.dir / "slurm" / "broker").splitlines()
                      if "supervisor" in line or "inference-1" in line]
        return f"squeue: {rows}\nthe broker's log on the supervisor and inference-1:\n" + "\n".join(supervisor[-40:])

    wait_until(replaced_and_serving, 300, "a new inference-1 task to register", explain=seen)
    assert "inference-1 (Slurm job" in logs_of(launched.dir / "slurm" / "broker")
    assert victim.job_id in {m.job_id for m in launched.record.retired}


def test_a_usr2_requeued_broker_comes_back_by_itself_status_says_restarting_and_one_retry_suffices(
        launched: Launched) -> None:
    broker = launched.member("broker")
    client = launched.client
    before = _restarts(broker.job_id)
    released_before = _peer_logs(launched).count(BROKER_RELEASED)
    launched.gate.write_text("")  # the requeued job waits in its setup line: the broker is away, its job RUNNING
    try:
        squeue.cancel([broker.job_id], signal_name="USR2")  # the time-limit warning: leave, requeue, replay the journal
        # No scontrol here: a node or bridge sees the requeued job held for Slurm's requeue delay and releases it.
        wait_until(lambda: _restarts(broker.job_id) > before
                   and any(t.state == "RUNNING" for t in squeue.query([broker.job_id])), 300,
                   "the requeued broker job to run again")
        st = prorl(launched.home, "status", NAME)
        assert st.returncode == 0, st.stdout + st.stderr
        assert "broker restarting" in st.stdout and f"Slurm job {broker.job_id} is RUNNING" in st.stdout, st.stdout
        assert "Slurm" in st.stdout and st.stdout.count("RUNNING") >= 5, "Slurm's view of every task"
        js = prorl(launched.home, "status", NAME, "--json")  # the same, for scripts: exit 0, the broker restarting
        assert js.returncode == 0, js.stdout + js.stderr
        doc = json.loads(js.stdout)
        assert doc["broker"] == "restarting" and f"Slurm job {broker.job_id} is RUNNING" in doc["broker_detail"], doc
        assert {e["task"]: e["state"] for e in doc["slurm"]}["broker"] == "RUNNING", doc["slurm"]
        assert _peer_logs(launched).count(BROKER_RELEASED) > released_before, "released by its peers, not by Slurm's clock"
        # A CLI submission made while the broker is away waits for it (a training script's submit across a time
        # limit's requeue), instead of failing on the missing rendezvous file.
        tasks = launched.home / "usr2-cli.jsonl"
        tasks.write_text("".join(json.dumps({"echo": i}) + "\n" for i in range(3)))
        said = launched.home / "usr2-cli.err"
        with said.open("w") as err_file:
            waiting = subprocess.Popen(
                [sys.executable, "-m", "prorl_cli", "--home", str(launched.home), "-d", NAME, "submit", str(tasks),
                 "--task", "test", "--id-prefix", "usr2-cli"],
                stdout=subprocess.PIPE, stderr=err_file, text=True, env={**os.environ, "COLUMNS": "200"})
        try:
            wait_until(lambda: "is restarting" in said.read_text() or waiting.poll() is not None, 60,
                       "the submission to say it waits for the broker")
        except BaseException:
            waiting.kill()
            raise
    finally:
        launched.gate.unlink(missing_ok=True)
    out, _ = waiting.communicate(timeout=400)
    err = said.read_text()
    assert waiting.returncode == 0, out + err
    assert f"the broker of '{NAME}' is restarting (its Slurm job {broker.job_id} is RUNNING" in err, err
    assert f"the broker of '{NAME}' is back" in err and "3/3 ended (done 3)" in err, out + err
    ids = [f"usr2-{i}" for i in range(10)]
    instances = [{"echo": i, "sleep_s": {"run": 0.2}} for i in range(10)]
    try:
        client.submit("test", instances, job_ids=ids, timeout_s=120)  # in flight while the broker moves
    except BrokerUnavailable:
        client.submit("test", instances, job_ids=ids, timeout_s=120)  # the one retry
    results = client.wait(ids, timeout_s=240)
    assert [r.state for r in results] == ["done"] * 10 and [r.output["echo"] for r in results] == list(range(10))
    text = logs_of(launched.dir / "slurm" / "broker")
    leavers = re.findall(r"broker\[(\d+)\].*leaving on a signal", text)
    assert leavers and len(leavers) == len(set(leavers)), "each broker that left on a signal said so once"
    wait_until(lambda: launched.alive_nodes() >= {"node-0", "node-2"}, 60, "nodes back with the requeued broker")


def test_a_node_requeued_on_usr2_is_released_by_the_supervisor_and_not_counted_as_a_failure(
        launched: Launched) -> None:
    victim = launched.member("node-0")
    before, old_pid = _restarts(victim.job_id), launched.node_pid("node-0")
    squeue.cancel([victim.job_id], signal_name="USR2")  # drain with grace, then requeue itself
    wait_until(lambda: (launched.node_pid("node-0") or old_pid) != old_pid, 300, "node-0 back after its requeue")
    assert _restarts(victim.job_id) == before + 1 and launched.member("node-0").job_id == victim.job_id, "requeued, not replaced"
    broker_log = logs_of(launched.dir / "slurm" / "broker")
    assert f"node-0 (Slurm job {victim.job_id}) was requeued and held for Slurm's requeue delay: made it eligible now" \
        in broker_log, broker_log[-3000:]
    assert "node-0" not in launched.supervised(), "a requeue is no failure"


def _serving_and_pending(launched: Launched, peers: tuple[str, ...]) -> tuple[str, str] | None:
    rows = {t.job_id: t for t in squeue.query(launched.record.job_ids)}
    states = {p: rows[launched.member(p).job_id].state for p in peers if launched.member(p).job_id in rows}
    alive = launched.alive_nodes()
    serving = [p for p, state in states.items() if state == "RUNNING" and p in alive]
    pending = [p for p, state in states.items() if state == "PENDING"]
    return (serving[0], pending[0]) if len(serving) == 1 and len(pending) == 1 else None


def test_scale_down_takes_a_pending_task_first_then_drains_the_least_loaded_with_its_jobs_delivered(
        launched: Launched) -> None:
    # node-0 and node-2 hold 60% of a Slurm node each; node-1's Slurm node is free: one new task fits, not two.
    up = prorl(launched.home, "scale", NAME, "--nodes", "4")
    assert up.returncode == 0, up.stderr
    assert "added node-3" in up.stdout and "added node-4" in up.stdout
    new = ("node-3", "node-4")
    serving, pending = wait_until(lambda: _serving_and_pending(launched, new), 180,
                                  "one new node serving and the other pending")
    if int(pending.split("-")[1]) > int(serving.split("-")[1]):
        # The highest index is the pending one (Slurm starts an array's lower index first): swap them, so taking the
        # highest index, which scale-down used to do whatever the task did, would take a serving node.
        scontrol("requeuehold", launched.member(serving).job_id)
        swapped = (pending, serving)
        wait_until(lambda: _serving_and_pending(launched, new) == swapped, 180,
                   "the pending node to start and the other to wait, held")
        serving, pending = swapped
    pending_job = launched.member(pending).job_id
    shrink = prorl(launched.home, "scale", NAME, "--nodes", "3")
    assert shrink.returncode == 0, shrink.stderr
    assert f"removed {pending} (pending" in shrink.stdout, shrink.stdout
    assert not squeue.wait_gone([pending_job], 60)
    assert launched.alive_nodes() == {"node-0", "node-2", serving}

    # Under load: the least loaded serving node is drained; its running jobs finish there, delivered once.
    client = launched.client
    ids = client.submit("test", [{"echo": i, "sleep_s": {"run": 8.0}} for i in range(60)], timeout_s=120)

    def all_running() -> bool:
        nodes = [n for n in client.status().nodes if n.alive]
        return len(nodes) == 3 and all(n.stages.get("run", {}).get("active", 0) > 0 for n in nodes)

    wait_until(all_running, 60, "every node running jobs")
    down = prorl(launched.home, "scale", NAME, "--nodes", "2", timeout_s=400)
    assert down.returncode == 0, down.stdout + down.stderr
    chosen = re.search(r"drained and removed (node-\d) \(serving, (\d+) running job", down.stdout)
    assert chosen, down.stdout
    drained, running = chosen.group(1), int(chosen.group(2))
    results = client.wait(ids, timeout_s=240)
    assert sorted(r.job_id for r in results) == sorted(ids), "every job answered once"
    assert collections.Counter(r.state for r in results) == {"done": 60}
    assert sorted(r.output["echo"] for r in results) == list(range(60)), "no job lost or doubled"
    assert [r.job_id for r in results if r.attempt != 1] == [], "none was stopped and run again"
    assert sum(r.node_id == drained for r in results) >= running > 0, "its running jobs finished on it"
    assert drained not in launched.alive_nodes() and len(launched.alive_nodes()) == 2
    job = next(m.job_id for m in launched.record.retired if m.peer_id == drained)
    assert "JobState=COMPLETED" in scontrol("-o", "show", "job", job), "it drained and exited, not cancelled"
    assert "not requeueing" in logs_of(launched.dir / "slurm" / "nodes" / job)


def test_a_killed_broker_is_replaced_by_its_peers_and_its_new_job_replays_the_journal(launched: Launched) -> None:
    victim = launched.member("broker")

    def kill_broker() -> None:
        wait_until(lambda: launched.client.status().jobs.get("run", 0) > 0, 60, "jobs running")
        # SIGKILL: no drain, no requeue; the supervisor, its child, ends with its job. Its nodes and bridges see
        # the job ended FAILED and submit a new one.
        _role_process(victim).kill()

        def seen() -> str:
            rows = squeue.query([m.job_id for m in launched.record.members], all_states=True)
            lines = [line for line in _peer_logs(launched).splitlines() if "broker" in line]
            return f"squeue: {rows}\nthe peers' log on the broker:\n" + "\n".join(lines[-40:])

        wait_until(lambda: launched.member("broker").job_id != victim.job_id, 240,
                   "a new Slurm job for the broker", explain=seen)

    launched.run_load(30, 1.5, kill_broker)  # every job done once: the new broker replayed the journal
    new = launched.member("broker")
    assert victim.job_id in {m.job_id for m in launched.record.retired}
    assert "journal replayed" in logs_of(launched.dir / "slurm" / "broker" / new.job_id)
    assert re.search(rf"broker \(Slurm job {victim.job_id}\) ended FAILED .*without being asked to",
                     _peer_logs(launched))


def _counted_failures(launched: Launched) -> list[str]:
    """The names the supervisor (and, for the broker, its peers) logged as ended without being asked to."""
    text = logs_of(launched.dir / "slurm" / "broker") + _peer_logs(launched)
    return sorted(set(re.findall(r"(\S+) \(Slurm job \S+\) ended .*without being asked to", text)))


def test_down_leaves_nothing(launched: Launched) -> None:
    record = launched.record
    # Only the inference task and the broker killed with SIGKILL were failures: the requeues, the scancel of
    # node-1 and the tasks scaled away were asked for.
    assert _counted_failures(launched) == ["broker", "inference-1"]
    supervised = launched.supervised()
    assert {name: state["restarts"] for name, state in supervised.items() if state["restarts"]} == {
        "inference-1": 1, "broker": 1}
    # node-1, cancelled by hand, may have aged out of squeue by now: its log then told the supervisor so.
    assert all(state["left_alone"] for state in supervised.values() if not state["restarts"]), supervised
    launched.client.close()
    launched._client = None
    down = prorl(launched.home, "down", NAME, timeout_s=200)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not squeue.active(record.job_ids)
    assert not (launched.dir / "broker.json").exists()
    assert not (launched.dir / "launch.json").exists()
    assert not (launched.dir / "broker.journal").exists(), "down leaves nothing to replay"
    folder = str(launched.dir)
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"]) if any(folder in a for a in p.info["cmdline"] or [])]
    assert not leftovers, f"processes of the deployment still running: {leftovers}"
    gone = prorl(launched.home, "-d", NAME, "status")
    assert gone.returncode != 0
    # Nor did anything taken down count as a failure: the supervisor's state, archived with the launch, is unchanged.
    assert _counted_failures(launched) == ["broker", "inference-1"]
    archived = json.loads((launched.dir / HISTORY_NAME / record.launch_id / SUPERVISION_NAME).read_text())
    assert {name: state["restarts"] for name, state in archived["names"].items() if state["restarts"]} == {
        "inference-1": 1, "broker": 1}
