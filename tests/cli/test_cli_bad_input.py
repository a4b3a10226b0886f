"""Bad input to the real ``prorl`` CLI: a non-zero exit and one ``error:`` line naming the problem, never a traceback.

Each row runs ``python -m prorl_cli`` in a subprocess. No row needs a
running broker, except the two-broker test at the end (two real brokers).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from prorl_cli.rendezvous import read_rendezvous
from tests.harness import Deployment, fixed_port


def run_prorl(home: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PRORL_HOME": str(home), "COLUMNS": "80"}  # 80: long errors must still be one line
    env.pop("PRORL_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "prorl_cli", *args], env=env, cwd=home.parent,
        capture_output=True, text=True, timeout=timeout_s,
    )


@dataclass
class Case:
    name: str
    #: ``prepare(home) -> CLI args`` (it may write files under ``home``).
    prepare: Callable[[Path], list[str]]
    #: Fragments the one error line must contain (``{home}`` is replaced).
    expect: tuple[str, ...]


def _silent_broker(home: Path) -> list[str]:
    """A rendezvous file naming a port where nothing answers (a broker that died without cleaning up)."""
    d = home / "ghost"
    d.mkdir(parents=True, exist_ok=True)
    port = fixed_port()
    (d / "broker.json").write_text(json.dumps({
        "address": f"tcp://127.0.0.1:{port}", "deployment": "ghost", "host": "h", "pid": 1, "started_at": 0.0,
    }))
    return ["-d", "ghost", "status"]


def _binary_tasks(home: Path) -> list[str]:
    path = home.parent / "tasks.bin"
    path.write_bytes(b'{"a": 1}\n\xff\xfe\x00\x01garbage\n')
    return ["submit", str(path), "--task", "test"]


def _out_in_missing_folder(home: Path) -> list[str]:
    path = home.parent / "tasks.jsonl"
    path.write_text('{"echo": 1}\n')
    return ["-d", "nobroker", "submit", str(path), "--task", "test", "--out", str(home.parent / "no" / "such" / "r.jsonl")]


def _submit_with(*options: str) -> Callable[[Path], list[str]]:
    """``submit`` of a good tasks file with these options (refused before any broker is asked)."""

    def prepare(home: Path) -> list[str]:
        path = home.parent / "tasks.jsonl"
        path.write_text('{"echo": 1}\n')
        return ["-d", "nobroker", "submit", str(path), "--task", "test", *options]

    return prepare


def _sampling_file(text: str) -> Callable[[Path], list[str]]:
    def prepare(home: Path) -> list[str]:
        f = home.parent / "sampling.yaml"
        f.write_text(text)
        return _submit_with("--sampling-file", str(f))(home)

    return prepare


def _home_is_a_file(home: Path) -> list[str]:
    f = home.parent / "home-file"
    f.write_text("not a folder")
    return ["--home", str(f), "status"]


def _port_in_use(home: Path) -> list[str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    _KEEP.append(s)
    return ["-d", "busyport", "serve", "broker", "--port", str(s.getsockname()[1])]


_KEEP: list[socket.socket] = []

CASES = [
    Case("status-no-broker", lambda h: ["-d", "nodeploy", "status"], ("nodeploy", "rendezvous")),
    Case("stop-no-broker", lambda h: ["-d", "nodeploy", "stop"], ("nodeploy", "rendezvous")),
    Case("cancel-no-broker", lambda h: ["-d", "nodeploy", "cancel", "j1"], ("nodeploy", "rendezvous")),
    Case("backends-list-no-broker", lambda h: ["-d", "nodeploy", "backends", "list"], ("nodeploy", "rendezvous")),
    Case("backends-add-no-broker", lambda h: ["-d", "nodeploy", "backends", "add", "http://h:1/v1"], ("nodeploy",)),
    Case("backends-pause-no-broker", lambda h: ["-d", "nodeploy", "backends", "pause"], ("nodeploy",)),
    Case("unreachable-broker", _silent_broker, ("the broker at tcp://127.0.0.1:", "does not answer")),
    Case("binary-tasks-file", _binary_tasks, ("tasks.bin", "not a UTF-8 text file")),
    Case("out-into-missing-folder", _out_in_missing_folder, ("--out", "does not exist")),
    Case("sampling-not-json", _submit_with("--sampling", "{max_tokens: 5"), ("--sampling", "not valid JSON")),
    Case("sampling-not-an-object", _submit_with("--sampling", "[1, 2]"), ("--sampling", "must be a JSON object", "got list")),
    Case("sampling-unknown-field", _submit_with("--sampling", '{"max_token": 5}'), ("--sampling", "unknown field", "max_token")),
    Case("sampling-bad-value", _submit_with("--sampling", '{"top_p": 1.5}'), ("--sampling", "sampling.top_p", "must be in (0, 1]")),
    Case("sampling-and-file", _submit_with("--sampling", "{}", "--sampling-file", "/etc/hostname"), ("--sampling or --sampling-file",)),
    Case("sampling-file-bad-value", _sampling_file("max_tokens: many\n"), ("sampling.yaml", "sampling.max_tokens", "must be an integer")),
    Case("status-two-names", lambda h: ["-d", "one", "status", "two"], ("-d one", "DEPLOYMENT two", "different deployments")),
    Case("home-is-a-file", _home_is_a_file, ("home-file", "is a file")),
    Case("serve-broker-port-in-use", _port_in_use, ("cannot listen", "in use")),
    Case("serve-broker-bad-bind-host", lambda h: ["-d", "badhost", "serve", "broker", "--bind-host", "no-such-host.invalid"],
         ("cannot listen", "no-such-host.invalid")),
]


# Options click itself checks: its usage error (exit 2) names the option and the value.
USAGE_CASES = [
    Case("max-tokens-zero", _submit_with("--max-tokens", "0"), ("'--max-tokens'", "0 is not in the range")),
    Case("temperature-negative", _submit_with("--temperature", "-1"), ("'--temperature'", "-1.0 is not in the range")),
    Case("top-p-above-one", _submit_with("--top-p", "1.5"), ("'--top-p'", "1.5 is not in the range")),
    Case("seed-not-an-int", _submit_with("--seed", "abc"), ("'--seed'", "'abc' is not a valid integer")),
]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    h = tmp_path_factory.mktemp("badcli") / "home"
    h.mkdir()
    yield h
    for s in _KEEP:
        s.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_line_error(case: Case, home: Path) -> None:
    args = case.prepare(home)
    started = time.monotonic()
    r = run_prorl(home, *args)
    took_s = time.monotonic() - started
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for fragment in case.expect:
        assert fragment in errors[0], (fragment, r.stderr)
    # Not a timing assertion on prorl's speed: the unreachable broker must be reported by the short ping, not after
    # the 30 s request timeout (a generous bound that only the wrong path exceeds).
    assert took_s < 25, f"{case.name} took {took_s:.1f} s"


def test_a_second_broker_for_a_live_deployment_refuses_and_leaves_the_first_alone(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "twice")
    try:
        first = d.start_broker()
        before = read_rendezvous(d.deployment_dir)
        journal = d.deployment_dir / "broker.journal"
        r = subprocess.run(
            [sys.executable, "-m", "prorl_cli", "-d", "twice", "serve", "broker"],
            env=d.env(), cwd=d.home, capture_output=True, text=True, timeout=60,
        )
        assert r.returncode != 0
        assert "Traceback" not in r.stderr
        assert f"already has a live broker (pid {first.pid}" in r.stderr and before.address in r.stderr
        # The first broker's rendezvous file and journal are untouched, and it still answers.
        assert read_rendezvous(d.deployment_dir) == before
        assert journal.exists()
        assert d.client.ping()["boot_id"]
        # Once the first is gone (even by kill -9), a new broker starts.
        d.kill("broker")
        d.start_broker()
        assert read_rendezvous(d.deployment_dir).pid != first.pid
    finally:
        d.close()


@pytest.mark.parametrize("case", USAGE_CASES, ids=[c.name for c in USAGE_CASES])
def test_bad_option_values_get_clicks_usage_error(case: Case, home: Path) -> None:
    r = run_prorl(home, *case.prepare(home))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error: Invalid value")]
    assert len(errors) == 1, r.stderr
    for fragment in case.expect:
        assert fragment in errors[0], (fragment, r.stderr)
