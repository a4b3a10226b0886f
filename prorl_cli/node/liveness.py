"""Node liveness that a busy handler cannot break.

Heartbeats used to share the node's event loop with handlers: a handler
that blocked the loop for a few seconds (a synchronous call in a stage) got
its node declared dead and its jobs re-run elsewhere. The
:class:`LivenessSidecar` is a thread with its own DEALER socket: every
heartbeat interval it sends ``heartbeat {node_id, liveness_token}``, which
the broker accepts from any identity that knows the node's registration
token. It also watches the loop's lag (the loop stamps a time each turn of
:meth:`LoopStamp.tick`): it logs which job's stage blocked the loop and for
how long, and stops vouching for the node once the loop has been blocked
past ``node.loop_stall_limit_s``, so a dead-locked node is still declared
dead.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

import zmq

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.protocol import headers as H
from prorl_cli.security import secure_peer

log = logging.getLogger(__name__)

#: Loop lag (in heartbeat intervals) past which the sidecar reports a blocked loop.
REPORT_AFTER_INTERVALS = 2.0


def new_liveness_token() -> str:
    """A random token for one registration."""
    return secrets.token_hex(16)


class LoopStamp:
    """The event loop's proof of life: a time stamped from a loop callback every ``period_s``."""

    def __init__(self, period_s: float, on_stall: Callable[[float], None] | None = None) -> None:
        self.period_s = period_s
        #: Called from the loop, with the lag, on the first turn after the loop was blocked a while.
        self.on_stall = on_stall
        self.at = timebase.now()
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.at = timebase.now()
        self._handle = asyncio.get_running_loop().call_later(self.period_s, self._tick)

    def _tick(self) -> None:
        now = timebase.now()
        lag_s = now - self.at - self.period_s
        self.at = now
        if lag_s > 4 * self.period_s and self.on_stall is not None:
            self.on_stall(lag_s)
        self._handle = asyncio.get_running_loop().call_later(self.period_s, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def lag_s(self) -> float:
        """How long the loop has gone without running its stamp (beyond the period)."""
        return max(0.0, timebase.now() - self.at - self.period_s)


class LivenessSidecar(threading.Thread):
    """Sends the node's liveness heartbeats from a thread; see the module docstring.

    ``blocker()`` is called from this thread while the loop is blocked and
    names what blocks it (e.g. ``"job j1 (stage run)"``); it must only read.
    ``address()`` is read each round, so the sidecar follows a broker that moved.
    """

    def __init__(
        self,
        *,
        node_id: str,
        token: str,
        address: Callable[[], str | None],
        deployment_dir: Path | None,
        interval_s: Callable[[], float],
        stamp: LoopStamp,
        stall_limit_s: float,
        blocker: Callable[[], str],
    ) -> None:
        super().__init__(name=f"liveness-{node_id}", daemon=True)
        self.node_id = node_id
        self.token = token
        self._address = address
        self._deployment_dir = deployment_dir
        self._interval_s = interval_s
        self._stamp = stamp
        self._stall_limit_s = stall_limit_s
        self._blocker = blocker
        self._halt = threading.Event()
        #: Heartbeats sent (for tests and logs).
        self.sent = 0

    def stop(self) -> None:
        """Stop sending and close the socket (returns once the thread has ended)."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=5.0)

    def _connect(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> zmq.Socket[bytes]:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # old heartbeats are worthless: never queue many
        if self._deployment_dir is not None:
            secure_peer(sock, self._deployment_dir)
        sock.connect(address)
        return sock

    def run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock: zmq.Socket[bytes] | None = None
        connected_to: str | None = None
        blocked_by: str | None = None
        blocked_max_s = 0.0
        vouching = True
        try:
            while not self._halt.wait(self._interval_s()):
                address = self._address()
                if address != connected_to:
                    if sock is not None:
                        sock.close(linger=0)
                        sock = None
                    connected_to = address
                    if address is not None:
                        sock = self._connect(ctx, address)
                if sock is None:
                    continue
                self._drain(sock)
                lag_s = self._stamp.lag_s()
                if lag_s > REPORT_AFTER_INTERVALS * self._interval_s():
                    if blocked_by is None:
                        blocked_by = self._blocker()
                        log.warning("event loop blocked for %.1f s by %s", lag_s, blocked_by)
                    blocked_max_s = lag_s
                elif blocked_by is not None:
                    log.warning("event loop was blocked for %.1f s by %s", blocked_max_s, blocked_by)
                    blocked_by = None
                if lag_s > self._stall_limit_s:
                    if vouching:
                        log.error("event loop blocked for %.0f s (node.loop_stall_limit_s=%.0f) by %s: "
                                  "no longer vouching for this node", lag_s, self._stall_limit_s, blocked_by)
                        vouching = False
                    continue
                vouching = True
                try:
                    heartbeat = H.Heartbeat(node_id=self.node_id, liveness_token=self.token).to_wire()
                    sock.send_multipart(P.encode(heartbeat), flags=zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:
                    pass  # the broker is not reachable right now: the next round tries again
        finally:
            if sock is not None:
                sock.close(linger=0)
            ctx.term()

    @staticmethod
    def _drain(sock: zmq.Socket[bytes]) -> None:
        """Discard what the broker sends this socket (it answers nothing on success; errors are moot)."""
        while True:
            try:
                sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
