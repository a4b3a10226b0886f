"""CURVE encryption and authentication for the broker's socket.

Every broker (``broker.curve: auto`` or ``on``; loopback included: another
user of a shared login or compute node reaches 127.0.0.1 as easily as its
owner) uses the deployment's server key pair (``server.key``, made on the
first start and kept, so that a broker restarted on the same address is
reached by peers that still hold its public key), publishes the public key in
the rendezvous file, and accepts only peers that present the deployment's client
key, kept in ``$PRORL_HOME/<deployment>/client.key`` (mode 0600, in the
deployment folder, mode 0700). Who can read the deployment folder can
connect; nobody else can, and nothing crosses the network in clear.
``broker.curve: off`` is plain TCP, for a broker on a machine of one's own.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from prorl_cli.exceptions import RendezvousError
from prorl_cli.rendezvous import Rendezvous, read_rendezvous

log = logging.getLogger(__name__)
CLIENT_KEY_NAME = "client.key"
SERVER_KEY_NAME = "server.key"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def curve_wanted(mode: str, bind_host: str) -> bool:
    """``off``: plain TCP; ``on`` and ``auto``: CURVE, on loopback too (``bind_host`` no longer matters)."""
    return mode != "off"


def private_folder(deployment_dir: Path) -> None:
    """Make the deployment folder (keys, rendezvous file, journal) the owner's alone: mode 0700."""
    deployment_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = deployment_dir.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(deployment_dir, 0o700)


def client_keys(deployment_dir: Path, create: bool = False) -> tuple[bytes, bytes]:
    """The deployment's client key pair (public, secret), made on first use by the broker."""
    return _key_pair(deployment_dir / CLIENT_KEY_NAME, create, "client")


def _key_pair(path: Path, create: bool, what: str) -> tuple[bytes, bytes]:
    deployment_dir = path.parent
    if not path.exists():
        if not create:
            raise RendezvousError(f"{path}: no {what} key; this deployment's broker requires CURVE")
        public, secret = zmq.curve_keypair()
        deployment_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # made meanwhile by another process: read that one
        else:
            with os.fdopen(fd, "w") as f:
                json.dump({"public": public.decode(), "secret": secret.decode()}, f)
    try:
        data = json.loads(path.read_text())
        return data["public"].encode(), data["secret"].encode()
    except (OSError, ValueError, KeyError) as e:
        raise RendezvousError(f"{path}: unreadable {what} key: {e}") from e


class _AllowOne:
    """ZAP credentials check: only the deployment's client key gets in."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        ok = zmq.utils.z85.encode(key) == self.allowed if len(key) == 32 else key == self.allowed
        if not ok:
            log.warning("refused a peer with an unknown CURVE key")
        return ok


def secure_server(ctx: zmq.Context, sock: zmq.Socket, deployment_dir: Path) -> tuple[str, ThreadAuthenticator]:
    """Make ``sock`` a CURVE server that admits only the client key; return (public key, authenticator)."""
    private_folder(deployment_dir)
    public, secret = _key_pair(deployment_dir / SERVER_KEY_NAME, True, "server")
    client_public, _ = client_keys(deployment_dir, create=True)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("prorl.zap"))
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_AllowOne(client_public))
    sock.curve_server = True
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    return public.decode(), auth


def secure_peer(sock: zmq.Socket, deployment_dir: Path, info: Rendezvous | None = None) -> bool:
    """Give a DEALER the CURVE keys the deployment's broker expects; return whether it got any.

    No rendezvous file (an explicit address) or a broker without CURVE: plain TCP, ``False``.
    """
    if info is None:
        try:
            info = read_rendezvous(deployment_dir)
        except RendezvousError:
            return False  # an explicit address with no rendezvous file: plain TCP
    if not info.curve_public_key:
        return False
    public, secret = client_keys(deployment_dir)
    sock.curve_serverkey = info.curve_public_key.encode()
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    return True
