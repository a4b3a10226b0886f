"""A loopback broker admits only its owner's peers: another local user gets nothing (real second user, real sockets).

Root runs a broker; the unprivileged test user (``scripts/provision/40-testuser.sh``, with the world-readable
Python of ``scripts/provision/55-user-python.sh``) tries to submit, cancel and read results, with no keys and with
keys of its own. Then the reverse: the test user's broker serves the test user's own CLI, and a peer without the
deployment's keys gets nothing from it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from prorl_cli import protocol as P
from prorl_cli.rendezvous import wait_rendezvous
from tests.harness import Deployment
from tests.other_user import OtherUser
from tests.other_user import other_user as make_other_user

#: Run as the other user: every way in it has, each must come back empty-handed. Prints a JSON verdict.
INTRUDER = r"""
import json, sys, zmq, msgpack
from prorl_cli import protocol as P
address, server_key, job_id = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
for name in ("broker.json", "client.key", "server.key"):
    try:
        open(sys.argv[4] + "/" + name).read()
        out["read_" + name] = "read"
    except OSError as e:
        out["read_" + name] = type(e).__name__
ctx = zmq.Context()
def attempt(curve):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:  # the server's public key is no secret; a key pair of one's own is not the deployment's
        sock.curve_serverkey = server_key.encode()
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(address)
    jobs = [{"job_id": "intruder-1", "task": "test"}]
    for i, (h, payload) in enumerate([({"op": "submit", "jobs": jobs}, [msgpack.packb({"echo": "x"})]),
                                      ({"op": "cancel", "job_ids": [job_id]}, []),
                                      ({"op": "watch", "job_ids": [job_id]}, []),
                                      ({"op": "status"}, [])]):
        sock.send_multipart(P.encode({"rid": i, **h}, payload))
    got = sock.poll(3000)
    sock.close(0)
    return "answered" if got else "nothing"
out["plain"] = attempt(False)
out["curve"] = attempt(True)
print(json.dumps(out))
"""


@pytest.fixture
def other_user() -> Iterator[OtherUser]:
    yield from make_other_user()


def test_another_local_user_cannot_submit_cancel_or_read_on_a_loopback_broker(other_user: OtherUser) -> None:
    # Under /tmp, not tmp_path: pytest's folder is root's alone anyway; the deployment folder must guard itself.
    home = Path(tempfile.mkdtemp(prefix="prorl-owner-"))
    home.chmod(0o755)
    d = Deployment(home / "home", "owned")  # bind_host 127.0.0.1, broker.curve: auto
    try:
        d.start_broker()
        [job_id] = d.client.submit("test", [{"echo": "mine"}])  # no node: it stays queued
        info = json.loads((d.deployment_dir / "broker.json").read_text())
        assert info["address"].startswith("tcp://127.0.0.1:") and info["curve_public_key"]
        assert (d.deployment_dir.stat().st_mode & 0o777) == 0o700
        out = other_user.run("-c", INTRUDER, info["address"], info["curve_public_key"], job_id, str(d.deployment_dir))
        assert out.returncode == 0, out.stderr
        verdict = json.loads(out.stdout)
        assert verdict == {"read_broker.json": "PermissionError", "read_client.key": "PermissionError",
                           "read_server.key": "PermissionError", "plain": "nothing", "curve": "nothing"}, verdict
        # Nothing of it reached the broker: the owner's job is still queued, no other job exists.
        status = d.client.status()
        assert status.jobs.get("queued") == 1 and sum(status.jobs.values()) == 1, status.jobs
        assert d.client.cancel([job_id]) == {job_id: "cancelled"}
        assert "refused a peer with an unknown CURVE key" in d.log("broker")
    finally:
        d.close()
        shutil.rmtree(home, ignore_errors=True)


def test_the_other_users_broker_serves_its_own_cli_and_nobody_without_its_keys(other_user: OtherUser) -> None:
    broker = other_user.run("-m", "prorl_cli", "-d", "theirs", "serve", "broker", background=True)
    try:
        info = wait_rendezvous(other_user.home / "theirs", 60)  # root may read it; the point is what a peer gets
        # The owner's own CLI works unchanged.
        out = other_user.run("-m", "prorl_cli", "-d", "theirs", "status", "--json")
        assert out.returncode == 0, out.stderr + out.stdout
        assert json.loads(out.stdout)["deployment"] == "theirs"
        # A peer without the deployment's keys (plain, or a key pair of its own) gets nothing.
        ctx = zmq.Context.instance()
        for curve in (False, True):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if curve:
                sock.curve_serverkey = (info.curve_public_key or "").encode()
                sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.connect(info.address)
            sock.send_multipart(P.encode({"op": "status", "rid": 1}))
            assert not sock.poll(3000), f"a peer without the keys was answered (curve={curve})"
            sock.close(0)
    finally:
        os.killpg(broker.pid, 15)
        broker.wait(30)
