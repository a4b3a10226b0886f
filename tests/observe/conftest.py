"""One real deployment for the observability tests: broker (metrics on), node, simulated-engine bridge, a run."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Deployment, fixed_port, need_module

HANDLERS = Path(__file__).resolve().parent / "handlers"

#: The run every test reads: what each instance does (turns of generate, tool calls, sandbox, failures).
INSTANCES: list[dict[str, Any]] = [
    {"turns": 2, "tools": 1, "reward": 1.0},
    {"turns": 3, "tools": 2, "reward": 0.0},
    {"turns": 1, "tools": 0, "sandbox": True, "reward": 1.0},
    {"turns": 2, "tools": 1, "fail": "run"},
    {"turns": 1, "tools": 1, "fail": "eval"},
    {"turns": 2, "tools": 1, "reward": 0.5},
]


@dataclass
class ObservedRun:
    deployment: Deployment
    results_path: Path
    results: list[dict[str, Any]]
    metrics_url: str

    def prorl(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        env = {**self.deployment.env(), "COLUMNS": "200"}
        return subprocess.run([sys.executable, "-m", "prorl_cli", "-d", self.deployment.name, *args], env=env,
                              capture_output=True, text=True, timeout=timeout_s, cwd=self.deployment.home)


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedRun]:
    need_module("prometheus_client", "observe")  # the broker's metrics endpoint
    tmp = tmp_path_factory.mktemp("observe")
    port = fixed_port()
    d = Deployment(tmp / "home", config={
        "broker": {"metrics_port": port},
        "inference": {"generate_timeout_s": 60.0, "sim_speedup": 100.0},
        "sandbox": {"runtime": "local", "local_dir": str(tmp / "sb")},
    })
    try:
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        proc = d.spawn("sim-a", "serve", "inference", "--backend-id", "sim-a", "--engine", "sim")
        d.wait_for(lambda st: any(b.backend_id == "sim-a" and b.alive for b in st.backends), 120.0,
                   "backend sim-a to register", "sim-a")
        assert proc.poll() is None
        tasks = tmp / "tasks.jsonl"
        tasks.write_text("".join(json.dumps(i) + "\n" for i in INSTANCES))
        results_path = tmp / "results.jsonl"
        run = ObservedRun(d, results_path, [], f"http://127.0.0.1:{port}/metrics")
        out = run.prorl("submit", str(tasks), "--task", "obs", "--out", str(results_path), "--id-prefix", "obs")
        assert out.returncode == 0, out.stdout + out.stderr  # two jobs fail on purpose: counted, not an error
        run.results = [json.loads(line) for line in results_path.read_text().splitlines()]
        assert len(run.results) == len(INSTANCES)
        yield run
    finally:
        d.close()


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET the metrics endpoint and parse it with prometheus-client's own parser: samples by name."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name].append((s.labels, s.value))
    return samples


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lb, v in samples.get(name, []) if all(lb.get(k) == x for k, x in labels.items()))
