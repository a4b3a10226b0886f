"""Where the broker listens: its ROUTER socket, the rendezvous file that publishes it, its metrics HTTP server.

The broker's loop reads and writes the socket (``broker/server.py``); this
file only opens, publishes and closes. Rules:

- A send never blocks and never queues half a message: an unknown peer is
  refused at once (``ROUTER_MANDATORY``, no send high-water mark).
- Unread input is bounded per peer (``broker.receive_window_messages``:
  libzmq stops reading that connection, the backlog waits in the sender),
  and an oversized frame disconnects its sender (``broker.max_message_bytes``).
- CURVE encrypts and authenticates whenever the broker listens beyond
  loopback (``broker.curve``); peers learn the public key from the
  rendezvous file, which is written once the loop is about to run and
  removed on the way out only if it is still this process's. Publishing
  removes the deployment's stop record (the deployment runs again); a
  ``stop`` writes one (:meth:`Endpoint.record_stop`), so that peers still
  waiting for a broker do not wait for ever.
- A wildcard bind publishes this host's name (peers elsewhere cannot dial
  ``0.0.0.0``).
- A metrics port that cannot be served is logged, and the broker runs without it.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import zmq

from prorl_cli.config import BrokerConfig, ProrlConfig
from prorl_cli.observe.metrics import DeploymentCollector, MetricsServer
from prorl_cli.rendezvous import (
    Rendezvous,
    clear_stop,
    record_stop,
    remove_rendezvous,
    write_rendezvous,
)
from prorl_cli.security import curve_wanted, secure_server

log = logging.getLogger(__name__)


class Endpoint:
    """The broker's bound ROUTER socket (``sock``), the ``address`` peers dial, and its CURVE key."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], config: ProrlConfig) -> None:
        self.config = config
        bc = config.broker
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer reconnecting under its routing id (peers keep theirs) takes it over from a link the broker has not
        # seen die yet (a half-open TCP connection); without this its new connection would be refused.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        # Bounded per peer (libzmq then stops reading that connection): unread input cannot outgrow memory
        # when nodes send results faster than the loop reads them; the backlog waits in the senders.
        self.sock.setsockopt(zmq.RCVHWM, bc.receive_window_messages)
        # Oversized frames are refused by libzmq itself (the sender is disconnected).
        self.sock.setsockopt(zmq.MAXMSGSIZE, bc.max_message_bytes)
        self.curve_public_key: str | None = None
        self._auth = None
        if curve_wanted(bc.curve, bc.bind_host):
            self.curve_public_key, self._auth = secure_server(ctx, self.sock, config.deployment_dir)
        if bc.port:
            self.sock.bind(f"tcp://{bc.bind_host}:{bc.port}")
        else:
            self.sock.bind(f"tcp://{bc.bind_host}:*")
        bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # Peers on other hosts cannot dial a wildcard: publish a name (or address) of this host they can reach.
        self.address = bound.replace("0.0.0.0", advertised_host(), 1) if "://0.0.0.0:" in bound else bound
        #: Whether :meth:`publish` wrote the rendezvous file (a replay on simulated time publishes nothing).
        self.published = False

    def publish(self) -> None:
        """Write the rendezvous file (every peer finds the broker and its key there) and say where it listens.

        The stop record of an earlier ``prorl stop`` goes first: peers that wait from now on wait for this broker.
        """
        clear_stop(self.config.deployment_dir)
        self.published = True
        write_rendezvous(
            self.config.deployment_dir,
            Rendezvous(
                address=self.address,
                deployment=self.config.deployment,
                host=socket.gethostname(),
                pid=os.getpid(),
                started_at=time.time(),
                curve_public_key=self.curve_public_key,
            ),
        )
        log.info(
            "broker of deployment %r listening on %s (%s)", self.config.deployment, self.address,
            "CURVE encrypted and authenticated" if self.curve_public_key
            else "plain TCP (broker.curve: off): whoever reaches the port can use it",
        )

    def record_stop(self) -> None:
        """The deployment is being stopped on purpose (the ``stop`` op): write its stop record, so that a peer still
        starting or waiting for a broker exits instead of waiting for one. Only a broker that published writes it;
        one that cannot is logged (its peers then wait as they would for a broker killed)."""
        if not self.published:
            return
        try:
            record_stop(self.config.deployment_dir, self.address)
        except OSError as e:
            log.error("cannot write the stop record in %s: %s; peers still waiting for a broker will wait their "
                      "full time", self.config.deployment_dir, e)

    def unpublish(self) -> None:
        """Remove the rendezvous file if it is still ours (a newer broker may have replaced it)."""
        remove_rendezvous(self.config.deployment_dir, os.getpid())

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket and stop the CURVE authenticator's thread."""
        self.sock.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def serve_metrics(collector: DeploymentCollector, bc: BrokerConfig) -> MetricsServer | None:
    """Serve ``collector`` on ``broker.metrics_host:metrics_port``; None when unset, or (logged) when it cannot."""
    if bc.metrics_port is None:
        return None
    try:
        server = MetricsServer(collector, bc.metrics_host, bc.metrics_port)
    except ImportError as e:
        log.error("broker.metrics_port is set but prometheus-client is missing (pip install 'prorl[observe]'): %s; "
                  "the broker runs without metrics", e)
        return None
    except OSError as e:
        log.error("cannot serve metrics on %s:%s: %s; the broker runs without them", bc.metrics_host, bc.metrics_port, e)
        return None
    log.info("Prometheus metrics at %s", server.url)
    return server


def _loopback(name: str) -> bool:
    """Whether ``name`` resolves only to loopback addresses (or not at all)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET)
    except OSError:
        return True
    return all(str(info[4][0]).startswith("127.") for info in infos)


def advertised_host() -> str:
    """This host as peers on other hosts dial it, for a broker bound to every interface.

    The fully qualified name, else the host name, when it resolves to a non-loopback address. Many clusters'
    ``/etc/hosts`` map the host name to 127.0.x.1: published, it would send every node on another host to its
    own loopback, where no broker listens. Then the address of the interface that routes off this host.
    """
    for name in (socket.getfqdn(), socket.gethostname()):
        if name and not _loopback(name):
            return name
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 9))  # a UDP connect sends nothing: it only picks the outgoing interface
        address = str(probe.getsockname()[0])
    except OSError:
        address = ""
    finally:
        probe.close()
    if address and not address.startswith("127.") and address != "0.0.0.0":
        return address
    name = socket.getfqdn()
    log.warning("this host's names resolve to loopback only and no routed interface was found: publishing %r, "
                "which peers on other hosts may not reach (set broker.bind_host to an address they can dial)", name)
    return name
