"""Per-job timelines in real results, and `prorl trace` turning them into a Perfetto trace."""

from __future__ import annotations

import json
from pathlib import Path

from tests.observe.conftest import INSTANCES, ObservedRun

_NESTED = ("stage", "wait", "generate", "tool", "sandbox_start", "sandbox_stop")


def test_results_carry_their_timelines(observed_run: ObservedRun) -> None:
    by_id = {r["job_id"]: r for r in observed_run.results}
    for i, inst in enumerate(INSTANCES):
        r = by_id[f"obs-{i}-0"]
        names = [ev[0] for ev in r["events"]]
        assert names[0] == "submitted" and "assigned" in names and "received" in names and names[-1] == "finished"
        times = [ev[1] for ev in r["events"]]
        assert times[0] == 0.0 and all(t >= 0 for t in times)
        stages = [ev[3]["stage"] for ev in r["events"] if ev[0] == "stage"]
        want = {None: ["init", "run", "eval"], "run": ["init", "run"], "eval": ["init", "run", "eval"]}[inst.get("fail")]
        assert stages == want, r["events"]
        gens = [ev for ev in r["events"] if ev[0] == "generate"]
        assert len(gens) == inst["turns"]
        assert all(g[3]["backend"] == "sim-a" and g[3]["prompt"] >= 40 and g[3]["output"] == 8 for g in gens)
        tools = [ev for ev in r["events"] if ev[0] == "tool" and ev[3]["tool"] == "add"]
        assert len(tools) == inst["turns"] * inst["tools"]
        starts = [ev for ev in r["events"] if ev[0] == "sandbox_start"]
        assert len(starts) == (1 if inst.get("sandbox") else 0)
        if inst.get("sandbox"):
            assert any(ev[0] == "sandbox_stop" for ev in r["events"])
            assert any(ev[0] == "tool" and ev[3]["tool"] == "sandbox.bash" for ev in r["events"])
        # A failed job's own log file says why; a job that logged nothing has none.
        if inst.get("fail"):
            log_text = Path(r["log_path"]).read_text()
            assert "failed on purpose" in log_text
        else:
            assert r["log_path"] is None


def test_trace_is_valid_trace_event_json_with_stages_inside_their_jobs(observed_run: ObservedRun) -> None:
    out_path = observed_run.results_path.parent / "trace.json"
    out = observed_run.prorl("trace", str(observed_run.results_path), "-o", str(out_path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out_path.read_text())
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for ev in events:
        assert ev["ph"] in ("X", "M", "b", "e"), ev
        assert isinstance(ev["pid"], int) and isinstance(ev["name"], str)
        if ev["ph"] == "X":
            assert isinstance(ev["ts"], int | float) and ev["dur"] >= 0 and isinstance(ev["tid"], int)
    jobs = {ev["name"]: ev for ev in events if ev["ph"] == "X" and ev.get("cat") == "job"}
    assert set(jobs) == {f"obs-{i}-0" for i in range(len(INSTANCES))}
    for job_id, job in jobs.items():
        inner = [ev for ev in events if ev["ph"] == "X" and ev.get("cat") in _NESTED and ev["args"].get("job") == job_id
                 and ev["pid"] == job["pid"]]
        assert inner
        for ev in inner:  # on the job's slot track, within the job's span (1 µs of rounding)
            assert ev["tid"] == job["tid"]
            assert job["ts"] - 1 <= ev["ts"] and ev["ts"] + ev["dur"] <= job["ts"] + job["dur"] + 1, (job, ev)
        stages = [ev for ev in inner if ev["cat"] == "stage"]
        assert [s["name"] for s in stages] == sorted((s["name"] for s in stages), key=["init", "run", "eval"].index)
        for a, b in zip(stages, stages[1:], strict=False):  # in time order, not overlapping
            assert a["ts"] + a["dur"] <= b["ts"] + 1
    # Each job's slot never holds two overlapping jobs; the backend has its own track with every generate call.
    by_track: dict[tuple[int, int], list[dict]] = {}
    for job in jobs.values():
        by_track.setdefault((job["pid"], job["tid"]), []).append(job)
    for track in by_track.values():
        track.sort(key=lambda j: j["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(track, track[1:], strict=False))
    names = {ev["args"]["name"] for ev in events if ev["ph"] == "M" and ev["name"] == "thread_name"}
    assert "sim-a" in names
    backend_calls = [ev for ev in events if ev["ph"] == "X" and ev["name"].startswith("generate ")]
    assert len(backend_calls) == sum(i["turns"] for i in INSTANCES)


def test_trace_reads_the_parquet_of_submit_out(observed_run: ObservedRun) -> None:
    from prorl_cli.agent.trajectory import Trajectory, write_parquet

    rows = [{"job_id": r["job_id"], "reward": r["reward"], "trajectory": Trajectory().to_dict(), "task": r["task"],
             "state": r["state"], "node_id": r["node_id"], "events": r["events"]} for r in observed_run.results]
    path = observed_run.results_path.parent / "results.parquet"
    write_parquet(path, rows)  # what `prorl submit --out X.parquet` writes for these results
    out_path = path.with_suffix(".trace.json")
    out = observed_run.prorl("trace", str(path), "-o", str(out_path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out_path.read_text())
    jobs = [ev for ev in doc["traceEvents"] if ev.get("cat") == "job"]
    assert sorted(j["name"] for j in jobs) == sorted(r["job_id"] for r in observed_run.results)
    assert {j["args"]["state"] for j in jobs} == {"done", "failed"}
