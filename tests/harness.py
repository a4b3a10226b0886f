"""Start real prorl processes (broker, nodes, bridges) for tests and benchmarks.

Every process is a real ``python -m prorl_cli ...`` child in its own process
group, talking over real ZeroMQ sockets on loopback. ``Deployment.close``
stops the deployment through the broker and then makes sure every process
group it started is gone (SIGTERM, then SIGKILL) — it never touches anything
it did not start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from prorl_cli.client import RolloutClient
from prorl_cli.config import ENV_CONFIG, ENV_HOME
from prorl_cli.rendezvous import read_rendezvous, wait_rendezvous

REPO = Path(__file__).resolve().parent.parent


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


DEFAULT_TEST_CONFIG: dict[str, Any] = {
    "broker": {"heartbeat_interval_s": 0.25, "heartbeat_liveness": 8},
    "node": {"n_init": 4, "n_run": 8, "n_eval": 4, "stop_grace_s": 3.0},
    "jobs": {"timeout_s": 60.0},
    "log_level": "INFO",
}


class Deployment:
    """A deployment of real processes under ``home`` (a PRORL_HOME of its own)."""

    def __init__(self, home: Path, name: str = "test", config: dict[str, Any] | None = None) -> None:
        self.home = home
        self.name = name
        self.config = _merge(DEFAULT_TEST_CONFIG, {"deployment": name, "home": str(home), **(config or {})})
        home.mkdir(parents=True, exist_ok=True)
        self.config_path = home / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.logs = home / "logs"
        self.logs.mkdir(exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._client: RolloutClient | None = None

    @property
    def deployment_dir(self) -> Path:
        return self.home / self.name

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[ENV_HOME] = str(self.home)
        env[ENV_CONFIG] = str(self.config_path)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``prorl ARGS`` as a child in its own process group, logging to logs/NAME.log."""
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "prorl_cli", "-d", self.name, *args],
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.home,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start_broker(self, timeout_s: float = 20.0) -> subprocess.Popen[bytes]:
        proc = self.spawn("broker", "serve", "broker")
        deadline = time.monotonic() + timeout_s
        while True:
            info = wait_rendezvous(self.deployment_dir, timeout_s)
            if info.pid == proc.pid:
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"broker did not start; log:\n{self.log('broker')}")
        return proc

    @property
    def address(self) -> str:
        return read_rendezvous(self.deployment_dir).address

    def start_node(self, node_id: str, *args: str, wait: bool = True, timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
        proc = self.spawn(node_id, "serve", "node", "--node-id", node_id, *args)
        if wait:
            self.wait_for(lambda st: any(n["node_id"] == node_id and n["alive"] for n in st.nodes), timeout_s,
                          f"node {node_id} to register", node_id)
        return proc

    def wait_for(self, predicate: Any, timeout_s: float, what: str, log_name: str | None = None) -> Any:
        """Poll the broker's status until ``predicate(status)`` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.client.status()
            if predicate(status):
                return status
            if time.monotonic() > deadline:
                log = self.log(log_name) if log_name else ""
                raise TimeoutError(f"timed out waiting for {what}\n{log}")
            time.sleep(0.05)

    @property
    def client(self) -> RolloutClient:
        if self._client is None:
            self._client = RolloutClient(self.name, address=self.address, request_timeout_s=15.0)
        return self._client

    def new_client(self) -> RolloutClient:
        return RolloutClient(self.name, address=self.address, request_timeout_s=15.0)

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-5000:] if path.exists() else ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the process group of one child (ours)."""
        proc = self.procs[name]
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """``prorl stop`` through the client, then wait for every child to exit."""
        self.client.stop()
        for proc in self.procs.values():
            proc.wait(timeout=timeout_s)

    def close(self) -> None:
        """Stop everything this deployment started, whatever state it is in."""
        if self._client is not None:
            self._client.close()
            self._client = None
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
