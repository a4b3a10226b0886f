"""`prorl top` / `prorl status --watch` against a real deployment under load."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from prorl_cli.observe.dashboard import Dashboard, render, status_flags
from prorl_cli.protocol import StatusReport
from prorl_cli.protocol.records import BackendStatus
from tests.harness import Deployment, kill_if_running
from tests.observe.conftest import HANDLERS, INSTANCES, ObservedRun, scrape, total

N_SLOW = 8  # the test deployment's RUN pool holds 8


def test_dashboard_shows_a_loaded_deployment_as_status_reports_it(observed_run: ObservedRun) -> None:
    d = observed_run.deployment
    release = d.home / "release-the-slow-jobs"
    ids = d.client.submit("obs_slow", [{"turns": 0, "tools": 0, "hold_s": 120.0, "release": str(release)}], n=N_SLOW)
    # Loaded: every slow job holds a RUN slot until the test releases them (the numbers stay put meanwhile).
    d.wait_for(lambda st: st.by_task.get("obs_slow", {}).get("run") == N_SLOW, 30.0, "the slow jobs to run", "n1")
    out = observed_run.prorl("status", "--json")
    assert out.returncode == 0, out.stderr
    report = StatusReport.from_wire(json.loads(out.stdout))
    assert report.by_task["obs_slow"] == {"run": N_SLOW}  # what the test submitted

    console = Console(record=True, width=200, force_terminal=False)
    board = Dashboard()
    board.update(report, now=0.0)
    snap = board.update(report, now=1.0)
    console.print(render(snap))
    text = console.export_text()
    tables = _tables(text)
    # jobs by task and state: the obs run (4 done, 2 failed) and the loaded ones, and a total row that equals status.
    jobs = tables["jobs by task and state"]
    assert jobs["obs"]["done"] == "4" and jobs["obs"]["failed"] == "2" and jobs["obs"]["total"] == str(len(INSTANCES))
    assert jobs["obs_slow"]["run"] == str(N_SLOW) and jobs["obs_slow"]["total"] == str(N_SLOW)
    assert jobs["all"]["total"] == str(sum(report.jobs.values())) and jobs["all"]["run"] == str(report.jobs["run"])
    # The node's RUN pool: active/queued/limit as its heartbeat said.
    run_pool = report.nodes[0].stages["run"]
    node = tables["nodes: stage pools active/queued/limit"]["n1"]
    assert node["run"] == f"{run_pool['active']}/{run_pool['queued']}/{run_pool['limit']}" == f"{N_SLOW}/0/8"
    # The backend: served calls as the broker counts them; tokens from the nodes' counters.
    backend = report.backends[0]
    row = tables["inference backends"]["sim-a"]
    assert (row["in-flight"], row["served"], row["state"]) == (str(backend.inflight), str(backend.served), "serving")
    assert backend.served == sum(i["turns"] for i in INSTANCES)
    assert report.tokens["sim-a"]["output"] == 8 * backend.served
    # Failures grouped by task, stage and error type, with a sample message.
    failures = {(r["task"], r["stage"], r["error"], r["count"], r["sample message"])
                for r in tables["failures by task, stage and error"].rows}
    assert failures == {("obs", "run", "RuntimeError", "1", "the run failed on purpose"),
                        ("obs", "eval", "ValueError", "1", "the eval failed on purpose")}

    # A scrape during the load: the RUN pool's occupancy as the node's heartbeat reported it (refreshed each second).
    deadline = time.monotonic() + 20
    while total(scrape(observed_run.metrics_url), "prorl_node_stage_jobs", node="n1", stage="run", kind="active") != N_SLOW:
        assert time.monotonic() < deadline, "the scrape never showed the loaded RUN pool"
        time.sleep(0.2)

    release.touch()
    results = list(d.client.as_completed(ids, timeout_s=60))
    assert {r.state for r in results} == {"done"}
    out = observed_run.prorl("top", "--json", "--interval-s", "0.2")
    assert out.returncode == 0, out.stderr
    snap_json = json.loads(out.stdout)
    assert snap_json["by_task"]["obs_slow"] == {"done": N_SLOW}
    assert snap_json["finished"] == len(INSTANCES) + N_SLOW
    assert {(f["task"], f["stage"], f["type"], f["count"]) for f in snap_json["failures"]} == {
        ("obs", "run", "RuntimeError", 1), ("obs", "eval", "ValueError", 1)}
    assert snap_json["backends"][0]["backend_id"] == "sim-a"


def test_jobs_per_s_counts_the_jobs_a_trainer_forgot(tmp_path: Path) -> None:
    # A trainer forgets each result it consumed, so the broker holds no finished job: the rate and the
    # finished count still show the jobs that finished, not 0.
    d = Deployment(tmp_path / "home", "forgets")
    try:
        d.start_broker()
        d.start_node("n1")
        board = Dashboard()
        board.update(d.client.status(), now=0.0)
        ids = d.client.submit("test", [{"echo": i} for i in range(3)])
        assert {r.state for r in d.client.wait(ids, timeout_s=60)} == {"done"}
        d.client.forget(ids)
        status = d.client.status()
        assert sum(status.jobs.values()) == 0 and status.finished_total == 3
        snap = board.update(status, now=1.0)
        assert (snap.finished, snap.jobs_per_s) == (3, 3.0)
    finally:
        d.close()


def test_status_and_dashboard_flag_what_is_held() -> None:
    base = StatusReport(deployment="d", jobs={}, queued=0, nodes=[], backends=[], generation_paused=False,
                        placing=True, uptime_s=1.0)
    assert status_flags(base) == []
    held = StatusReport(**{**base.__dict__, "generation_paused": True, "held_generates": 3, "placing": False})
    assert status_flags(held) == ["generation PAUSED", "3 generate call(s) held", "placement HELD"]
    assert Dashboard().update(held, now=0.0).flags == status_flags(held)


def test_dashboard_shows_a_resting_backend_and_its_last_fault() -> None:
    # An HTTP backend that failed calls in a row rests; the board says so, as `prorl backends list` does,
    # instead of "serving" for a backend new calls avoid.
    def backend(backend_id: str, resting_s: float, fault: str | None) -> BackendStatus:
        return BackendStatus(backend_id=backend_id, kind="http", url=f"http://{backend_id}:8000", host=None, model=None,
                             max_model_len=None, inflight=0, jobs=0, served=5, cleared=False, alive=True,
                             resting_s=resting_s, last_fault=fault)

    report = StatusReport(deployment="d", jobs={}, queued=0, nodes=[], placing=True, uptime_s=1.0,
                          generation_paused=False,
                          backends=[backend("good", 0.0, None), backend("down", 12.4, "unreachable: connection refused")])
    snap = Dashboard().update(report, now=0.0)
    assert [(b.backend_id, b.resting_s, b.last_fault) for b in snap.backends] == [
        ("good", 0.0, None), ("down", 12.4, "unreachable: connection refused")]
    console = Console(record=True, width=200, force_terminal=False)
    console.print(render(snap))
    table = _tables(console.export_text())["inference backends"]
    assert table["good"]["state"] == "serving"
    assert table["down"]["state"] == "resting 12 s: unreachable: connection refused"


def test_status_watch_leaves_cleanly_on_ctrl_c(observed_run: ObservedRun) -> None:
    d = observed_run.deployment
    env = {**d.env(), "COLUMNS": "160"}
    proc = subprocess.Popen([sys.executable, "-m", "prorl_cli", "-d", d.name, "status", "--watch"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        seen, deadline = "", time.monotonic() + 60
        while "inference backends" not in seen:  # the first frame is drawn (piped: frame after frame)
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([proc.stdout], [], [], 1.0)[0]:
                seen += proc.stdout.readline()
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "stopped" in stdout


def test_dashboard_after_a_node_died_and_the_bridge_left(tmp_path: Path) -> None:
    # A node killed mid-run and the only bridge stopped: the board names both as `prorl status` does (the node
    # lost and why, with no pools; the bridge left), and says why generate calls are held, instead of an idle
    # row of zeros for a dead node, an empty backends table and a bare "held".
    d = Deployment(tmp_path / "home", "gone", config={"inference": {"sim_speedup": 100.0}})
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        d.start_node("n2", "--handlers", str(HANDLERS))
        d.spawn("sim-a", "serve", "inference", "--backend-id", "sim-a", "--engine", "sim")
        d.wait_for(lambda st: any(b.backend_id == "sim-a" and b.alive for b in st.backends), 120.0, "sim-a", "sim-a")
        d.kill("n2", signal.SIGKILL)
        d.kill("sim-a", signal.SIGTERM)  # a planned exit: it leaves
        d.wait_for(lambda st: not any(n.alive for n in st.nodes if n.node_id == "n2") and not st.backends
                   and any(b.backend_id == "sim-a" for b in st.gone_backends), 60.0, "n2 lost and sim-a gone")
        d.client.submit("obs", [{"turns": 1, "tools": 0}])
        status = d.wait_for(lambda st: st.held_generates == 1, 60.0, "the generate call to be held", "n1")

        out = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", d.name, "top", "--json", "--interval-s", "0.1"],
                             env=d.env(), capture_output=True, text=True, timeout=120, cwd=d.home)
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        assert [(b["backend_id"], b["alive"], b["gone_reason"]) for b in snap["backends"]] == [("sim-a", False, "left")]
        assert snap["flags"] == ["1 generate call(s) held: no inference backend is up"]
        lost = {n["node_id"]: n for n in snap["nodes"]}["n2"]
        assert not lost["alive"] and lost["lost_reason"].startswith("silent for")

        console = Console(record=True, width=200, force_terminal=False)
        console.print(render(Dashboard().update(status, now=0.0)))
        tables = _tables(console.export_text())
        nodes = tables["nodes: stage pools active/queued/limit"]
        assert nodes["n1"]["state"] == "yes"
        assert nodes["n2"]["state"].startswith("lost: silent for")
        assert [nodes["n2"][c] for c in ("inflight/credit", "init", "run", "eval")] == ["-"] * 4
        assert tables["inference backends"]["sim-a"]["state"] == "left"
    finally:
        d.close()


class _Table(dict[str, dict[str, str]]):
    """A rendered table: rows by their first cell, and all rows in order."""

    rows: list[dict[str, str]]


def _tables(text: str) -> dict[str, _Table]:
    """The tables of a rich text export, by title: each row as {column: cell}."""
    out: dict[str, _Table] = {}
    title, columns, table = "", [], _Table()
    for line in text.splitlines():
        if "┃" in line:
            columns = [c.strip() for c in line.split("┃")[1:-1]]
        elif "│" in line:
            row = dict(zip(columns, (c.strip() for c in line.split("│")[1:-1]), strict=True))
            table[row[columns[0]]] = row
            table.rows.append(row)
        elif line.strip() and not set(line.strip()) <= set("┏┓┗┛━┳┻┡┩╇└┘─┴┌┐┬"):
            title, table = line.strip(), _Table()
            table.rows = []
            out[title] = table
    return out
