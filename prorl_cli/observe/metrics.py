"""Prometheus metrics for a whole deployment, served by the broker (one scrape target).

Every process keeps its figures in a :class:`MetricSet` (plain dicts: a counter
increment or a histogram observation is a dict lookup and a list update, cheap
enough for the node's hot path). Nodes and bridges send theirs to the broker in
each heartbeat (``metrics``, cumulative since the process started); the broker
keeps the latest set of each peer and, when ``broker.metrics_port`` is set,
serves them beside its own with ``prometheus-client`` on
``http://broker.metrics_host:PORT/metrics``. :data:`FAMILIES` names every
metric; ``docs/observability.md`` lists them for people.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from prorl_cli.broker.state import Job
    from prorl_cli.protocol import StatusReport

log = logging.getLogger(__name__)

#: Bucket upper bounds (seconds) of every latency histogram.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Bucket upper bounds of token-count histograms.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class Family:
    """One metric: its kind, help text, label names, and who reports it (``broker``, ``node``, ``bridge``).

    Counters are named without ``_total`` here; the exposition adds it.
    """

    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...]
    source: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S


#: The label the broker adds to a peer's figures: which node or backend sent them.
PEER_LABEL = {"node": "node", "bridge": "backend"}

FAMILIES: dict[str, Family] = {
    # broker
    "prorl_jobs_submitted": Family("counter", "Jobs accepted by the broker.", ("task",), "broker"),
    "prorl_jobs_finished": Family("counter", "Jobs that reached a terminal state, by final state and attempt.",
                                  ("task", "state", "attempt"), "broker"),
    "prorl_jobs_requeued": Family("counter", "Jobs put back in the queue because their node was lost.", ("task",), "broker"),
    "prorl_job_queue_seconds": Family("histogram", "Broker queue time: accepted (or re-queued) to placed on a node.",
                                      ("task",), "broker"),
    "prorl_jobs": Family("gauge", "Jobs the broker holds, by state.", ("state",), "broker"),
    "prorl_held_generate_calls": Family("gauge", "Generate calls held at the broker (generation paused or no backend).",
                                        (), "broker"),
    "prorl_generation_paused": Family("gauge", "1 while generation is paused.", (), "broker"),
    "prorl_peers": Family("gauge", "Registered peers by kind (node, bridge, http) and liveness.", ("kind", "alive"), "broker"),
    "prorl_journal_bytes": Family("gauge", "Size of the broker's journal file.", (), "broker"),
    "prorl_retained_results": Family("gauge", "Finished results kept for late watchers.", (), "broker"),
    "prorl_retained_bytes": Family("gauge", "Bytes of the retained results.", (), "broker"),
    "prorl_rejected_frames": Family("counter", "Messages the broker refused (bad frame, field, version, op...).", ("code",), "broker"),
    "prorl_backend_inflight": Family("gauge", "Generate calls a backend serves now (as the broker routes them).",
                                     ("backend",), "broker"),
    "prorl_backend_served": Family("counter", "Generate calls a backend has answered (as the broker routes them).",
                                   ("backend",), "broker"),
    "prorl_backend_engine": Family("gauge", "A bridge engine's own figures from its heartbeat (busy fraction, tokens/s...).",
                                   ("backend", "stat"), "broker"),
    "prorl_node_stage_jobs": Family("gauge", "Jobs in a node's stage pool: active, queued, and the pool's limit.",
                                    ("node", "stage", "kind"), "broker"),
    # node (the broker adds the label node)
    "prorl_node_jobs": Family("counter", "Jobs a node finished, by final state.", ("task", "state"), "node"),
    "prorl_stage_wait_seconds": Family("histogram", "Time a job waited for a slot of a stage pool on its node.",
                                       ("task", "stage"), "node"),
    "prorl_stage_seconds": Family("histogram", "In-stage time of a job (per stage).", ("task", "stage"), "node"),
    "prorl_generate_seconds": Family("histogram", "Generate call latency seen by the node (broker and backend included).",
                                     ("backend",), "node"),
    "prorl_generate_calls": Family("counter", "Generate calls made by a node's jobs, by outcome (ok, error).",
                                   ("backend", "outcome"), "node"),
    "prorl_generate_prompt_tokens": Family("counter", "Prompt tokens sent in generate calls.", ("backend",), "node"),
    "prorl_generate_output_tokens": Family("counter", "Tokens sampled in generate calls.", ("backend",), "node"),
    "prorl_tool_call_seconds": Family("histogram", "Tool call latency (agent tools and sandbox tool-server ops).",
                                      ("tool",), "node"),
    "prorl_sandbox_starts": Family("counter", "Sandbox starts by runtime and outcome (ok, failed).", ("runtime", "outcome"), "node"),
    "prorl_sandbox_start_seconds": Family("histogram", "Time to start a sandbox until its tool server answers.",
                                          ("runtime",), "node"),
    # bridge (the broker adds the label backend)
    "prorl_bridge_generate_seconds": Family("histogram", "Engine time of a generate call at the bridge (queued for its engine and generating).", (), "bridge"),
    "prorl_bridge_generate_calls": Family("counter", "Generate calls a bridge served, by outcome (ok, error, cancelled).", ("outcome",), "bridge"),
    "prorl_bridge_prompt_tokens": Family("counter", "Prompt tokens a bridge's engine read.", (), "bridge"),
    "prorl_bridge_output_tokens": Family("counter", "Tokens a bridge's engine sampled.", (), "bridge"),
    "prorl_bridge_inflight": Family("gauge", "Generate calls a bridge's engine serves now.", (), "bridge"),
}

Key = tuple[str, tuple[str, ...]]


class MetricSet:
    """Counters, gauges and histograms of one process, keyed by (family, label values)."""

    __slots__ = ("counters", "gauges", "hists")

    def __init__(self) -> None:
        self.counters: dict[Key, float] = {}
        self.gauges: dict[Key, float] = {}
        #: key -> [sum, [count per bucket..., count above the last bound]]
        self.hists: dict[Key, list[Any]] = {}

    def inc(self, family: str, labels: tuple[str, ...] = (), value: float = 1.0) -> None:
        key = (family, labels)
        self.counters[key] = self.counters.get(key, 0.0) + value

    def set(self, family: str, labels: tuple[str, ...], value: float) -> None:
        self.gauges[(family, labels)] = value

    def observe(self, family: str, labels: tuple[str, ...], value: float) -> None:
        key = (family, labels)
        h = self.hists.get(key)
        bounds = FAMILIES[family].buckets
        if h is None:
            h = self.hists[key] = [0.0, [0] * (len(bounds) + 1)]
        h[0] += value
        h[1][bisect.bisect_left(bounds, value)] += 1

    def to_wire(self) -> list[list[Any]]:
        """``[[family, [labels], value]]`` for counters and gauges, ``[[family, [labels], sum, [counts]]]`` for histograms."""
        out: list[list[Any]] = [[f, list(lb), v] for (f, lb), v in list(self.counters.items())]
        out += [[f, list(lb), v] for (f, lb), v in list(self.gauges.items())]
        out += [[f, list(lb), h[0], list(h[1])] for (f, lb), h in list(self.hists.items())]
        return out


def check_samples(samples: list[list[Any]]) -> list[list[Any]]:
    """Keep the samples of known peer families with the right label count (the schema has checked their shape)."""
    good = []
    for s in samples:
        fam = FAMILIES.get(s[0])
        if fam is None or fam.source == "broker" or len(s[1]) != len(fam.labels):
            continue
        if (fam.kind == "histogram") != (len(s) == 4) or (len(s) == 4 and len(s[3]) != len(fam.buckets) + 1):
            continue
        good.append(s)
    return good


class DeploymentCollector:
    """A prometheus-client collector: the broker's own figures and the latest ones of every peer.

    ``broker`` is the broker's :class:`MetricSet`; ``peers`` maps (kind, id) to a
    peer's latest samples. Read from the HTTP server's thread: the loop only ever
    replaces a peer's list or updates single dict entries.
    """

    def __init__(self, broker: MetricSet) -> None:
        self.broker = broker
        self.peers: dict[tuple[str, str], list[list[Any]]] = {}
        #: Each node's failure groups from its last heartbeat (``protocol.FAILURE_GROUP``).
        self.failures: dict[str, list[dict[str, Any]]] = {}
        #: Jobs the broker itself failed (their nodes kept dying), grouped the same way.
        self._broker_failures: dict[tuple[str, str, str], list[Any]] = {}

    def note_broker_failure(self, task: str, error: dict[str, Any]) -> None:
        """A job the broker failed (no node reports on it): counted under the pseudo-node ``broker``."""
        key = (task, str(error.get("stage") or "node"), str(error.get("type") or "failed"))
        group = self._broker_failures.setdefault(key, [0, ""])
        group[0] += 1
        group[1] = str(error.get("message") or "")[:300]
        self.failures["broker"] = [{"task": t, "stage": s, "type": e, "count": c, "sample": m}
                                   for (t, s, e), (c, m) in self._broker_failures.items()]

    def failure_groups(self) -> list[dict[str, Any]]:
        """Failures across nodes grouped by (task, stage, type), most frequent first, with a sample message."""
        groups: dict[tuple[str, str, str], dict[str, Any]] = {}
        for node_id, node_groups in self.failures.items():
            for f in node_groups:
                key = (f["task"], f["stage"], f["type"])
                g = groups.setdefault(key, {"task": key[0], "stage": key[1], "type": key[2], "count": 0, "sample": "",
                                            "nodes": []})
                g["count"] += f["count"]
                g["sample"] = f.get("sample") or g["sample"]
                g["nodes"].append(node_id)
        return sorted(groups.values(), key=lambda g: (-g["count"], g["task"], g["stage"], g["type"]))

    def token_totals(self) -> dict[str, dict[str, float]]:
        """Prompt and output tokens per backend, summed over the nodes' generate counters."""
        out: dict[str, dict[str, float]] = {}
        for (kind, _), samples in list(self.peers.items()):
            if kind != "node":
                continue
            for s in samples:
                which = {"prorl_generate_prompt_tokens": "prompt", "prorl_generate_output_tokens": "output"}.get(s[0])
                if which is not None:
                    per = out.setdefault(s[1][0], {"prompt": 0.0, "output": 0.0})
                    per[which] += s[2]
        return out

    def update_peer(self, kind: str, peer_id: str, samples: list[list[Any]]) -> None:
        self.peers[(kind, peer_id)] = check_samples(samples)

    def forget_peer(self, kind: str, peer_id: str) -> None:
        self.peers.pop((kind, peer_id), None)
        if kind == "node":
            self.failures.pop(peer_id, None)

    def _rows(self) -> Iterator[tuple[str, list[str], list[Any]]]:
        """(family, label values, sample) for every sample, peers' labels first-prefixed with their id."""
        for s in self.broker.to_wire():
            yield s[0], s[1], s
        for (_kind, peer_id), samples in list(self.peers.items()):
            for s in samples:
                yield s[0], [peer_id, *s[1]], s

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        made: dict[str, Any] = {}
        for name, labels, s in self._rows():
            fam = FAMILIES.get(name)
            if fam is None:
                continue
            metric = made.get(name)
            if metric is None:
                names = list(fam.labels) if fam.source == "broker" else [PEER_LABEL[fam.source], *fam.labels]
                cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[fam.kind]
                metric = made[name] = cls(name, fam.help, labels=names)
            if fam.kind == "histogram":
                cumulative, buckets = 0, []
                for bound, count in zip((*fam.buckets, float("inf")), s[3], strict=True):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
                metric.add_metric(labels, buckets, s[2])
            else:
                metric.add_metric(labels, s[2])
        yield from made.values()


class MetricsServer:
    """The broker's ``/metrics`` HTTP endpoint (a prometheus-client server thread)."""

    def __init__(self, collector: Collector, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._httpd.server_port)
        self.url = f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def gauges_from_status(status: StatusReport, journal_bytes: int) -> dict[Key, float]:
    """The broker's state gauges, read off its status report (a fresh dict: the HTTP thread may be reading the old one)."""
    g: dict[Key, float] = {}
    for state, count in status.jobs.items():
        g[("prorl_jobs", (state,))] = float(count)
    g[("prorl_held_generate_calls", ())] = float(status.held_generates)
    g[("prorl_generation_paused", ())] = 1.0 if status.generation_paused else 0.0
    g[("prorl_journal_bytes", ())] = float(journal_bytes)
    g[("prorl_retained_results", ())] = float(status.retained_results)
    g[("prorl_retained_bytes", ())] = float(status.retained_bytes)
    peers: dict[tuple[str, str], float] = {}
    for n in status.nodes:
        key = ("node", "true" if n.alive else "false")
        peers[key] = peers.get(key, 0.0) + 1
        for stage, st in n.stages.items():
            for kind in ("active", "queued", "limit"):
                g[("prorl_node_stage_jobs", (n.node_id, stage, kind))] = float(st.get(kind, 0))
    for b in status.backends:
        key = (b.kind, "true" if b.alive else "false")
        peers[key] = peers.get(key, 0.0) + 1
        g[("prorl_backend_inflight", (b.backend_id,))] = float(b.inflight)
        g[("prorl_backend_served", (b.backend_id,))] = float(b.served)
        for stat, v in b.stats.items():
            g[("prorl_backend_engine", (b.backend_id, stat))] = float(v)
    for (kind, alive), total in peers.items():
        g[("prorl_peers", (kind, alive))] = total
    return g


def observe_job(metrics: MetricSet, task: str, state: str, events: list[list[Any]]) -> None:
    """Count one finished job on its node from its timeline (stage waits and times, calls, tools, sandboxes)."""
    metrics.inc("prorl_node_jobs", (task, state))
    for ev in events:
        name = ev[0]
        if name not in _OBSERVED:
            continue  # the broker's events, received, finished: nothing to count (no attrs built for them)
        attrs = ev[3] if len(ev) > 3 else {}
        if name == "stage":
            metrics.observe("prorl_stage_seconds", (task, attrs["stage"]), ev[2])
        elif name == "wait":
            metrics.observe("prorl_stage_wait_seconds", (task, attrs["stage"]), ev[2])
        elif name == "generate":
            backend = str(attrs.get("backend") or "-")
            ok = attrs.get("ok", True)
            metrics.inc("prorl_generate_calls", (backend, "ok" if ok else "error"))
            if ok:
                metrics.observe("prorl_generate_seconds", (backend,), ev[2])
                metrics.inc("prorl_generate_prompt_tokens", (backend,), attrs.get("prompt", 0))
                metrics.inc("prorl_generate_output_tokens", (backend,), attrs.get("output", 0))
        elif name == "tool":
            metrics.observe("prorl_tool_call_seconds", (str(attrs.get("tool")),), ev[2])
        else:  # sandbox_start
            runtime = str(attrs.get("runtime") or "-")
            ok = attrs.get("ok", True)
            metrics.inc("prorl_sandbox_starts", (runtime, "ok" if ok else "failed"))
            if ok:
                metrics.observe("prorl_sandbox_start_seconds", (runtime,), ev[2])


#: The timeline events :func:`observe_job` counts.
_OBSERVED = frozenset(("stage", "wait", "generate", "tool", "sandbox_start"))


def jobs_by_task(jobs: Iterable[Job]) -> dict[str, dict[str, int]]:
    """Jobs counted by task, then by state."""
    out: dict[str, dict[str, int]] = {}
    for job in jobs:
        per = out.setdefault(job.spec.task, {})
        state = job.state.value
        per[state] = per.get(state, 0) + 1
    return out
