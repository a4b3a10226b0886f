"""Where users are: PRORL_HOME set in the shell, and clients holding the wrong CURVE keys (or none).

An embedded stack (quickstart, examples, benchmarks) owns its home whatever
PRORL_HOME says; a client refused by a CURVE broker is told so at once, with
the folder its keys came from, instead of waiting out its request timeout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from prorl_cli.client import RolloutClient
from prorl_cli.config import load_config
from prorl_cli.embedded import LocalStack
from prorl_cli.exceptions import BrokerRefused
from prorl_cli.security import CLIENT_KEY_NAME

# Far longer than a refusal takes: a BrokerRefused (not a timeout) shows the client did not wait it out.
PATIENT_S = 60.0


def test_an_embedded_stack_works_with_prorl_home_pointing_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRORL_HOME", str(tmp_path / "users-home"))
    monkeypatch.setenv("PRORL_DEPLOYMENT", "users-deployment")
    with LocalStack(tmp_path / "stack", "embedded", {"broker": {"journal": False}}) as stack:
        stack.start_broker()
        stack.start_node("n1")
        status = stack.client.status()
        assert [n.node_id for n in status.nodes] == ["n1"]
        cfg = stack.load_config()
        assert cfg.home_path == (tmp_path / "stack").resolve() and cfg.deployment == "embedded"
    assert not (tmp_path / "users-home").exists()  # nothing written in the shell's home


def test_an_embedded_stack_under_a_relative_home_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train_tiny_grpo.py --out runs/grpo``: the servers start in the home folder, so a relative one is made
    absolute first (else each server looked for runs/grpo/runs/grpo/NAME.yaml)."""
    monkeypatch.chdir(tmp_path)
    with LocalStack(Path("runs") / "grpo", "relative", {"broker": {"journal": False}}) as stack:
        stack.start_broker()
        stack.start_node("n1")
        assert [n.node_id for n in stack.client.status().nodes] == ["n1"]
        assert stack.home == tmp_path / "runs" / "grpo"


def test_a_client_without_the_deployments_keys_is_refused_naming_its_folder(tmp_path: Path) -> None:
    with LocalStack(tmp_path / "stack", "keys", {"broker": {"journal": False}}) as stack:
        stack.start_broker()
        elsewhere = load_config(stack.config_path, {"home": str(tmp_path / "elsewhere"), "deployment": "keys"})
        with RolloutClient("keys", address=stack.address, config=elsewhere, request_timeout_s=PATIENT_S) as client, \
                pytest.raises(BrokerRefused) as refused:
            client.status()
        message = str(refused.value)
        assert "requires CURVE keys" in message and str(tmp_path / "elsewhere") in message, message
        assert "PRORL_HOME" in message
        assert isinstance(refused.value, ConnectionRefusedError)


def test_a_request_sent_after_libzmq_dropped_the_refused_connection_still_fails_at_once(tmp_path: Path) -> None:
    """A refused handshake ends libzmq's session: the socket is left with no pipe, and a send waits for ever. On a
    loaded machine the refusal can land after ``open()`` and before the request's send, and the monitor that turns
    it into ``BrokerRefused`` runs on the loop only later: the request waited in its send, past its own timeout."""
    import asyncio
    import time

    from prorl_cli.connection import BrokerConnection

    async def request_after_the_drop(address: str) -> BaseException:
        conn = BrokerConnection(address=address, deployment_dir=None, name="client")
        conn.open()
        try:
            assert conn.sock is not None
            deadline = time.monotonic() + PATIENT_S / 4
            # Block the loop (the monitor cannot run) until libzmq has dropped the connection: no pipe to send on.
            # Most runs see the drop within a second; a loaded machine can keep reconnecting past the polls (each
            # retry makes a pipe again), and then the request meets the refusal the usual way: refused either way.
            while conn.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                async with asyncio.timeout(PATIENT_S / 2):  # the test's own bound: the request's is PATIENT_S
                    await conn.request({"op": "status"}, timeout_s=PATIENT_S)
            except BaseException as e:  # noqa: BLE001 - what it raised is the finding
                return e
            raise AssertionError("a client without keys got a reply")
        finally:
            await conn.close()

    with LocalStack(tmp_path / "stack", "keys", {"broker": {"journal": False}}) as stack:
        stack.start_broker()
        raised = asyncio.run(request_after_the_drop(stack.address))
        assert isinstance(raised, BrokerRefused) and "requires CURVE keys" in str(raised), repr(raised)


def another_deployments_keys(stack: LocalStack, home: Path) -> Path:
    """Another deployment's folder under ``home``: the stack broker's rendezvous file, but a client key of its own."""
    other = home / stack.name
    other.mkdir(parents=True)
    shutil.copy(stack.deployment_dir / "broker.json", other / "broker.json")
    public, secret = zmq.curve_keypair()
    (other / CLIENT_KEY_NAME).write_text(json.dumps({"public": public.decode(), "secret": secret.decode()}))
    return other


def test_a_client_with_another_deployments_key_is_refused_naming_its_folder(tmp_path: Path) -> None:
    with LocalStack(tmp_path / "stack", "keys", {"broker": {"journal": False}}) as stack:
        stack.start_broker()
        other = another_deployments_keys(stack, tmp_path / "other")
        config = load_config(stack.config_path, {"home": str(tmp_path / "other"), "deployment": "keys"})
        with RolloutClient("keys", address=stack.address, config=config, request_timeout_s=PATIENT_S) as client:
            with pytest.raises(BrokerRefused) as refused:
                client.status()
            # Every later request fails the same way at once.
            with pytest.raises(BrokerRefused):
                client.status()
        message = str(refused.value)
        assert "refused this client's key" in message and str(other) in message, message
        # The right keys still get in.
        assert stack.new_client().status().nodes == []


# Run in a process of its own: before the fix, the process's ZeroMQ froze (nothing in it could talk any more).
IDLE_REFUSED_CLIENT = """
import sys

import zmq
import zmq.asyncio

from prorl_cli.client import RolloutClient
from prorl_cli.config import load_config
from prorl_cli.embedded import LocalStack
from prorl_cli.exceptions import BrokerRefused

stack_home, other_home, name = sys.argv[1:4]
# Reconnect at once: the refusals an idle client meets over minutes (one per 100 ms reconnect) come in seconds.
zmq.asyncio.Context.instance().setsockopt(zmq.RECONNECT_IVL, 1)
stack = LocalStack(stack_home, name)
# A CURVE server with keys of its own (another deployment's broker on a reused port): every handshake fails.
router = zmq.Context().socket(zmq.ROUTER)
router.curve_server = True
router.curve_publickey, router.curve_secretkey = zmq.curve_keypair()
port = router.bind_to_random_port("tcp://127.0.0.1")
failures = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
refused = RolloutClient(name, address=f"tcp://127.0.0.1:{port}",
                        config=load_config(stack.config_path, {"home": other_home, "deployment": name}))
try:
    refused.status()
    sys.exit("the refusing server answered")
except BrokerRefused:
    pass
seen = 0
while seen < 3000:
    if not failures.poll(20_000):
        break
    failures.recv_multipart()
    seen += 1
print("refusals", seen, flush=True)
# Once refused, the client watches for a handshake that succeeds only: its refusals did not queue up.
print("queued", refused._aio._conn._monitor_sock.getsockopt(zmq.EVENTS) & zmq.POLLIN, flush=True)
with stack.new_client(request_timeout_s=20) as client:
    print("nodes", len(client.status().nodes), flush=True)
refused.close()
"""


def test_a_refused_client_left_idle_does_not_stop_the_other_clients_of_its_process(tmp_path: Path) -> None:
    """A blocking client runs its event loop only during its calls. Between them its handshake monitor goes
    unread while libzmq keeps reconnecting to a server that refuses it, an event each time; once 2,000 waited,
    libzmq's I/O thread blocked on the next, and every client of the process got no reply (CI saw a whole test
    lane fail that way). The monitor's queue has no limit now, and once refused a client watches for a handshake
    that succeeds only, so its refusals do not pile up: it goes on being refused, nothing waits in its monitor,
    and a client of the process with the right keys is answered."""
    with LocalStack(tmp_path / "stack", "keys", {"broker": {"journal": False}}) as stack:
        stack.start_broker()
        another_deployments_keys(stack, tmp_path / "other")
        child = subprocess.run([sys.executable, "-c", IDLE_REFUSED_CLIENT, str(stack.home), str(tmp_path / "other"),
                                stack.name], capture_output=True, text=True, timeout=180)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split("\n")[:3] == ["refusals 3000", "queued 0", "nodes 0"], child.stdout + child.stderr[-3000:]


def test_an_embedded_stack_from_asyncio_code_says_how_and_gives_an_async_client(tmp_path: Path) -> None:
    """A notebook cell, or a trainer's asyncio main: starting a server (which waits with a blocking client) is
    refused before anything is spawned, to_thread works, and async_client() serves the asyncio code."""
    import asyncio

    with LocalStack(tmp_path / "stack", "aio", {"broker": {"journal": False}}) as stack:

        async def main() -> list[str]:
            with pytest.raises(RuntimeError, match=r"LocalStack.start_broker blocks.*asyncio.to_thread"):
                stack.start_broker()
            assert stack.procs == {}, "nothing was spawned"
            await asyncio.to_thread(stack.start_broker)
            await asyncio.to_thread(stack.start_node, "n1", "--handlers", "prorl_cli.testing.handlers")
            with pytest.raises(RuntimeError, match="'n1' of this stack still runs"):
                stack.start_node("n1", wait=False)
            async with stack.async_client() as client:
                ids = await client.submit("test", [{"echo": 1}])
                return [r.state async for r in client.as_completed(ids, timeout_s=60)]

        assert asyncio.run(main()) == ["done"]
        assert list(stack.procs) == ["broker", "n1"]


def test_an_embedded_stack_opened_and_left_inside_asyncio_code_stops_its_servers(tmp_path: Path) -> None:
    """The README's notebook recipe with the ``with`` block inside the coroutine: leaving it closes the stack's
    blocking client (which start_node's wait made, on another thread) without running a loop in this one."""
    import asyncio

    async def main() -> tuple[list[str], dict[str, subprocess.Popen[bytes]]]:
        with LocalStack(tmp_path / "stack", "aio2", {"broker": {"journal": False}}) as stack:
            await asyncio.to_thread(stack.start_broker)
            await asyncio.to_thread(stack.start_node, "n1", "--handlers", "prorl_cli.testing.handlers")
            async with stack.async_client() as client:
                ids = await client.submit("test", [{"echo": 1}])
                states = [r.state async for r in client.as_completed(ids, timeout_s=60)]
        return states, stack.procs

    states, procs = asyncio.run(main())
    assert states == ["done"]
    assert sorted(procs) == ["broker", "n1"] and all(p.poll() is not None for p in procs.values()), "servers stopped"


def test_a_relative_home_names_where_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PRORL_HOME=relhome: every path the deployment names (and every error naming one) is absolute, so a
    command run from another folder says where it looked."""
    from click.testing import CliRunner

    from prorl_cli.cli import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PRORL_HOME", "relhome")
    cfg = load_config(None, {"deployment": "rel1"})
    assert cfg.deployment_dir == tmp_path / "relhome" / "rel1"
    out = CliRunner().invoke(cli, ["status", "-d", "rel1"])
    assert out.exit_code != 0 and str(tmp_path / "relhome" / "rel1" / "broker.json") in out.stderr, out.stderr
