"""A deployment stopped on purpose (``prorl stop``) ends the peers still waiting for its broker; a broker killed (or
requeued) is still waited for. Real broker, bridge and node processes, and the real ``prorl stop``.

The broker writes the stop record (``stopped.json``, :mod:`prorl_cli.rendezvous`) when it takes the ``stop`` op; a
peer that started before it and finds no broker started since exits with code 0 instead of waiting its full time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prorl_cli.rendezvous import read_stop, record_stop, stopped_path
from prorl_cli.testing.harness import Deployment

#: Long enough that a peer still waiting at the end of a test waited for the broker, not for its own limit.
LONG_WAIT_S = "300"


class _StartingServer:
    """An OpenAI-compatible server still starting: ``GET /v1/models`` (a bridge's engine start, ``--attach``) is
    answered only once the test calls :meth:`finish_start`; :attr:`asked` is set when the bridge has asked."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.started = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if not self.path.endswith("/models"):
                    self.send_error(404)
                    return
                outer.asked.set()
                outer.started.wait(120)
                body = json.dumps({"data": [{"id": "starting-model", "max_model_len": 256}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, name="starting-server", daemon=True)
        self._thread.start()

    def finish_start(self) -> None:
        self.started.set()

    def close(self) -> None:
        self.started.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=30)


@pytest.fixture
def starting_server() -> Iterator[_StartingServer]:
    server = _StartingServer()
    try:
        yield server
    finally:
        server.close()


def _prorl_stop(stack: Deployment) -> None:
    """``prorl stop`` as a user runs it, then wait for the broker to exit."""
    out = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", stack.name, "stop"], env=stack.env(), cwd=stack.home,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert stack.procs["broker"].wait(timeout=60) == 0, stack.log("broker")


def test_a_bridge_still_starting_when_the_deployment_is_stopped_exits_by_itself(
        tmp_path: Path, starting_server: _StartingServer) -> None:
    with Deployment(tmp_path / "home", "stopstart") as stack:
        stack.start_broker()
        bridge = stack.spawn("bridge", "serve", "inference", "--attach", starting_server.url, "--backend-id", "b1")
        assert starting_server.asked.wait(60), stack.log("bridge")  # its engine is starting
        _prorl_stop(stack)
        assert read_stop(stack.deployment_dir) is not None
        starting_server.finish_start()
        assert bridge.wait(timeout=60) == 0, stack.log("bridge")
        log = stack.log("bridge")
        assert "engine ready" in log
        assert "the deployment was stopped (prorl stop at " in log
        assert "while this bridge started: not waiting for a broker" in log


def test_a_node_started_before_the_stop_does_not_wait_for_a_broker(tmp_path: Path) -> None:
    """``--wait-s``: a node whose process started before the stop (held here, with SIGSTOP, before it read the
    rendezvous file) exits 0 when it finds the stop record, instead of waiting out ``--wait-s``."""
    with Deployment(tmp_path / "home", "stopnode") as stack:
        stack.start_broker()
        node = stack.spawn("n1", "serve", "node", "--node-id", "n1", "--wait-s", LONG_WAIT_S)
        os.kill(node.pid, signal.SIGSTOP)
        try:
            _prorl_stop(stack)
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert node.wait(timeout=60) == 0, stack.log("n1")
        assert "while this node started: not waiting for a broker" in stack.log("n1")


def test_a_registered_bridge_whose_broker_went_away_after_a_stop_leaves(tmp_path: Path) -> None:
    """A bridge that never heard the stopping broker's ``shutdown`` (its broker killed at the stop's deadline, say)
    leaves once the broker is silent and the stop record says the deployment was stopped, instead of registering
    again for ever."""
    with Deployment(tmp_path / "home", "stoplost") as stack:
        stack.start_broker()
        address = stack.address
        bridge = stack.spawn("bridge", "serve", "inference", "--engine", "sim", "--backend-id", "b1")
        stack.wait_for(lambda st: any(b.backend_id == "b1" and b.alive for b in st.backends), 60, "b1 to register",
                       "bridge")
        stack.drop_client()
        stack.kill("broker")  # no shutdown reaches the bridge
        record_stop(stack.deployment_dir, address)  # what the broker wrote as it took the stop
        assert bridge.wait(timeout=60) == 0, stack.log("bridge")
        assert "the deployment was stopped (prorl stop at " in stack.log("bridge")
        assert "this bridge leaves" in stack.log("bridge")


def test_a_broker_restarted_after_a_stop_or_a_kill_is_waited_for(tmp_path: Path) -> None:
    """A stop before a peer started is none of its business (it was started for the next broker), a new broker
    removes the stop record, and a broker killed (not stopped) is waited for: the bridge serves each new broker."""
    with Deployment(tmp_path / "home", "restarts") as stack:
        stack.start_broker()
        stack.client.stop()
        assert stack.procs["broker"].wait(timeout=60) == 0, stack.log("broker")
        stack.drop_client()
        assert stopped_path(stack.deployment_dir).exists()
        bridge = stack.spawn("bridge", "serve", "inference", "--engine", "sim", "--backend-id", "b1")
        stack.start_broker()
        assert not stopped_path(stack.deployment_dir).exists()
        stack.wait_for(lambda st: any(b.backend_id == "b1" and b.alive for b in st.backends), 60, "b1 to register",
                       "bridge")
        stack.drop_client()
        stack.kill("broker")  # a crash: its rendezvous file stays, and no stop record is written
        assert not stopped_path(stack.deployment_dir).exists()
        stack.start_broker()
        stack.wait_for(lambda st: any(b.backend_id == "b1" and b.alive for b in st.backends), 60,
                       "b1 to register with the restarted broker", "bridge")
        assert bridge.poll() is None, stack.log("bridge")
        assert "the deployment was stopped" not in stack.log("bridge")


def test_prorl_stop_after_the_broker_was_killed_writes_the_stop_record_and_its_peers_leave(tmp_path: Path) -> None:
    """A broker killed outright (OOM, ``kill -9``) cannot take the stop: ``prorl stop`` finds its process gone,
    writes the stop record itself, and the bridge and node still registering with it leave with code 0 instead
    of waiting for a broker for ever."""
    with Deployment(tmp_path / "home", "stopkilled") as stack:
        stack.start_broker()
        node = stack.start_node("n1")
        bridge = stack.spawn("bridge", "serve", "inference", "--engine", "sim", "--backend-id", "b1")
        stack.wait_for(lambda st: any(b.backend_id == "b1" and b.alive for b in st.backends), 60, "b1 to register",
                       "bridge")
        stack.drop_client()
        pid = stack.procs["broker"].pid
        stack.kill("broker")
        out = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", stack.name, "stop"], env=stack.env(),
                             cwd=stack.home, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        said = " ".join(out.stdout.split())
        assert f"its broker (pid {pid} on this host) was killed before; its stop record is written" in said, said
        assert read_stop(stack.deployment_dir) is not None
        assert bridge.wait(timeout=120) == 0, stack.log("bridge")
        assert node.wait(timeout=120) == 0, stack.log("n1")
        assert "this bridge leaves" in stack.log("bridge") and "this node leaves" in stack.log("n1")


def test_prorl_stop_of_a_deployment_that_never_ran_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    with Deployment(tmp_path / "home", "neverran") as stack:
        out = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", stack.name, "stop"], env=stack.env(),
                             cwd=stack.home, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "neverran" in out.stderr, out.stdout + out.stderr
        assert not stopped_path(stack.deployment_dir).exists()
