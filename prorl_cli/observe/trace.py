"""Chrome / Perfetto trace-event JSON from the timelines of a run's results.

Layout: one process per node with one thread (track) per *slot* (jobs that
overlapped in time on that node get different slots), each job a span on its
slot with its stages, queue waits, generate and tool calls and sandbox starts
nested inside; one process "inference" with a track per backend holding the
generate calls it served; one process "broker" with each job's queue time as an
async span. Timestamps are microseconds since the first submission of the run
(jobs are lined up by the wall-clock submission time the broker recorded).
Open the file at ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prorl_cli.protocol import JobResult

_US = 1_000_000.0


@dataclass
class _JobSpan:
    result: JobResult
    base_s: float  # the job's submission, seconds since the run's first one
    start_s: float  # on its node (received), relative to its submission
    end_s: float
    node: str


def _attrs(ev: list[Any]) -> dict[str, Any]:
    return ev[3] if len(ev) > 3 and isinstance(ev[3], dict) else {}


def _submitted_at(r: JobResult) -> float | None:
    for ev in r.events or []:
        if ev and ev[0] == "submitted":
            at = _attrs(ev).get("at")
            return float(at) if isinstance(at, int | float) else None
    return None


def _spans(results: list[JobResult]) -> list[_JobSpan]:
    timed = [r for r in results if r.events]
    ats = [a for a in map(_submitted_at, timed) if a is not None]
    first = min(ats) if ats else 0.0
    spans = []
    for r in timed:
        events = r.events or []
        at = _submitted_at(r)
        node_events = [ev for ev in events if ev[0] not in ("submitted", "queued", "assigned", "requeued")]
        received = [ev[1] for ev in events if ev[0] == "received"]
        start = received[-1] if received else min((ev[1] for ev in node_events), default=0.0)
        end = max((ev[1] + ev[2] for ev in events), default=start)
        spans.append(_JobSpan(r, (at - first) if at is not None else 0.0, start, end, r.node_id or "broker"))
    return spans


def _lanes(spans: list[_JobSpan]) -> dict[int, int]:
    """Slot index per span (by id), per node: the first slot free when the job started there."""
    out: dict[int, int] = {}
    by_node: dict[str, list[_JobSpan]] = {}
    for s in spans:
        by_node.setdefault(s.node, []).append(s)
    for node_spans in by_node.values():
        ends: list[float] = []
        for s in sorted(node_spans, key=lambda s: s.base_s + s.start_s):
            start, end = s.base_s + s.start_s, s.base_s + s.end_s
            lane = next((i for i, e in enumerate(ends) if e <= start), None)
            if lane is None:
                lane = len(ends)
                ends.append(end)
            else:
                ends[lane] = end
            out[id(s)] = lane
    return out


def trace_events(results: list[JobResult]) -> dict[str, Any]:
    """The trace-event JSON object (``{"traceEvents": [...]}``) of ``results``; jobs without a timeline are skipped."""
    spans = _spans(results)
    lanes = _lanes(spans)
    pids: dict[str, int] = {"broker": 1, "inference": 2}
    backend_tids: dict[str, int] = {}
    out: list[dict[str, Any]] = []
    seen_threads: set[tuple[int, int]] = set()

    def pid_of(node: str) -> int:
        if node not in pids:
            pids[node] = len(pids) + 1
        return pids[node]

    def thread(pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in seen_threads:
            seen_threads.add((pid, tid))
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

    for n, s in enumerate(sorted(spans, key=lambda s: s.base_s + s.start_s)):
        r = s.result
        pid, tid = pid_of(s.node), lanes[id(s)] + 1
        thread(pid, tid, f"slot {tid}")

        def us(t: float, _base: float = s.base_s) -> float:
            return round((_base + t) * _US, 3)

        out.append({
            "ph": "X", "name": r.job_id, "cat": "job", "pid": pid, "tid": tid, "ts": us(s.start_s),
            "dur": round((s.end_s - s.start_s) * _US, 3),
            "args": {"task": r.task, "state": r.state, "attempt": r.attempt, "reward": r.reward,
                     "error": (r.error or {}).get("message")},
        })
        # Queue time at the broker (accepted or re-queued to placed) as async spans of the broker process.
        queued_from: float | None = 0.0
        for ev in r.events or []:
            if ev[0] == "requeued":
                queued_from = ev[1]
            elif ev[0] == "assigned" and queued_from is not None:
                args = {"job": r.job_id, "node": _attrs(ev).get("node")}
                out.append({"ph": "b", "cat": "queue", "name": "queued", "id": n, "pid": 1, "tid": 1, "ts": us(queued_from), "args": args})
                out.append({"ph": "e", "cat": "queue", "name": "queued", "id": n, "pid": 1, "tid": 1, "ts": us(ev[1])})
                queued_from = None
        for ev in r.events or []:
            name, t, dur, attrs = ev[0], ev[1], ev[2], _attrs(ev)
            if name in ("submitted", "assigned", "requeued", "received", "finished", "queued"):
                continue
            label = {"stage": attrs.get("stage"), "wait": f"wait {attrs.get('stage')}",
                     "tool": f"tool {attrs.get('tool')}"}.get(name) or name
            event = {"ph": "X", "name": str(label), "cat": name, "pid": pid, "tid": tid, "ts": us(t),
                     "dur": round(dur * _US, 3), "args": {"job": r.job_id, **attrs}}
            out.append(event)
            if name == "generate":
                backend = str(attrs.get("backend") or "unrouted")
                if backend not in backend_tids:
                    backend_tids[backend] = len(backend_tids) + 1
                btid = backend_tids[backend]
                thread(2, btid, backend)
                out.append({**event, "pid": 2, "tid": btid, "name": f"generate {r.job_id}"})
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name if pid <= 2 else f"node {name}"}}
            for name, pid in pids.items()]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms", "otherData": {"source": "prorl trace", "jobs": len(spans)}}
