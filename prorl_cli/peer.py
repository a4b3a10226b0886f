"""A worker's connection to the broker: what node servers and inference bridges share.

Built on :class:`prorl_cli.connection.BrokerConnection` (the socket,
requests with replies, boot ids, following a moved broker). The peer
registers (and learns the broker's heartbeat interval and liveness from
the reply), heartbeats while registered, and registers again when the
broker goes silent for ``liveness`` intervals or answers ``unknown_peer``
(it declared the peer dead, or restarted). Subclasses say what they
register as, what their heartbeat carries, and what they do with the
broker's other ops. A peer whose broker went silent after the deployment
was stopped on purpose (the stop record, :mod:`prorl_cli.rendezvous`)
leaves as if told to shut down.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import zmq

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.connection import BrokerConnection, Reply
from prorl_cli.exceptions import (
    BrokerRestarted,
    BrokerUnavailable,
    ProtocolError,
    RemoteError,
    RendezvousError,
)
from prorl_cli.protocol import ErrorCode, Op
from prorl_cli.rendezvous import Rendezvous, process_started_at, read_rendezvous, stopped_since

log = logging.getLogger(__name__)

__all__ = ["BrokerPeer", "Reply"]


class BrokerPeer(ABC):
    """The broker side of a node server or an inference bridge."""

    #: For log lines: "node", "bridge".
    kind = "peer"

    def __init__(
        self,
        *,
        address: str | None,
        host: str,
        deployment_dir: Path | None,
        heartbeat_interval_s: float = P.HEARTBEAT_INTERVAL_S,
        heartbeat_liveness: int = P.HEARTBEAT_LIVENESS,
    ) -> None:
        self._address = address
        self.host = host
        #: Where the deployment's CURVE keys live (when the broker encrypts); ``None``: plain TCP.
        self.deployment_dir = deployment_dir
        self.conn: BrokerConnection | None = None
        #: Set while the broker knows this peer.
        self.registered = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._heard_at = timebase.now()  # before connecting; then the connection's
        self._interval_s = heartbeat_interval_s
        self._liveness = heartbeat_liveness
        #: Set once the peer is leaving: no more re-registering.
        self._leaving = False
        #: Re-read the rendezvous file when the broker goes silent, and follow it to a new address.
        self.follow_rendezvous = False
        #: Successful registrations so far (the first, then one after each broker restart or move).
        self.registrations = 0

    @property
    def address(self) -> str | None:
        """The broker's address (the connection's, once it has followed a move)."""
        return self.conn.address if self.conn is not None else self._address

    @address.setter
    def address(self, value: str | None) -> None:
        self._address = value
        if self.conn is not None:
            self.conn.address = value

    @property
    def _last_heard(self) -> float:
        return self.conn.last_heard if self.conn is not None else self._heard_at

    @_last_heard.setter
    def _last_heard(self, value: float) -> None:
        self._heard_at = value
        if self.conn is not None:
            self.conn.last_heard = value

    @property
    def _boot_id(self) -> str | None:
        return self.conn.boot_id if self.conn is not None else None

    # ------------------------------------------------------------ what subclasses say

    @abstractmethod
    def register_header(self) -> dict[str, Any]:
        """The register message (without ``rid``)."""

    @abstractmethod
    def heartbeat_header(self) -> dict[str, Any]:
        """The heartbeat message, with this peer's current stats."""

    @abstractmethod
    def unregister_header(self) -> dict[str, Any]:
        """The message that tells the broker this peer is leaving for good."""

    @abstractmethod
    def on_message(self, op: Op, header: dict[str, Any], payload: list[bytes]) -> None:
        """Handle a broker op other than reply, heartbeat and shutdown."""

    @abstractmethod
    def on_shutdown(self) -> None:
        """The broker asked this peer to shut down."""

    @abstractmethod
    def on_registered(self, reply: dict[str, Any]) -> None:
        """Called with the broker's answer after each successful registration."""

    # -------------------------------------------------------------------- I/O

    def connect(self, *, linger_ms: int, unbounded: bool = False) -> None:
        """Open the connection (CURVE when the deployment has keys); call from the running loop."""
        if self._address is None:
            raise BrokerUnavailable(f"{self.kind}: no broker address")
        self.conn = BrokerConnection(
            address=self._address,
            deployment_dir=self.deployment_dir,
            name=self.kind,
            follow_rendezvous=self.follow_rendezvous,
            host=self.host,
            linger_ms=linger_ms,
            unbounded=unbounded,
            on_message=self._dispatch,
            on_stray_reply=self._on_stray_reply,
        )
        self.conn.open()

    def _dispatch(self, op: Op, header: dict[str, Any], payload: list[bytes]) -> None:
        if op == Op.SHUTDOWN:
            log.info("broker asked this %s to shut down", self.kind)
            self.on_shutdown()
        else:
            self.on_message(op, header, payload)

    async def send(self, header: dict[str, Any], payload: list[bytes] | tuple[bytes, ...] = ()) -> None:
        """Send the broker a message that gets no reply."""
        assert self.conn is not None
        await self.conn.send(header, payload)

    async def request(
        self,
        header: dict[str, Any],
        payload: list[bytes] | tuple[bytes, ...] = (),
        *,
        cancel: dict[str, Any] | None = None,
    ) -> Reply:
        """Send a request to the broker and await its reply (header, payload), error replies included.

        ``cancel``: a message to send, with this request's ``rid``, if the
        caller stops waiting (a timeout, or its task was cancelled).
        """
        assert self.conn is not None
        return await self.conn.request(header, payload, cancel=cancel)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        assert self.conn is not None
        return self.conn.spawn(coro)

    async def close(self) -> None:
        """Unregister (best effort, 1 s), stop the loops and close the connection."""
        self._leaving = True
        if self.conn is None:
            return
        try:
            async with asyncio.timeout(1.0):
                await self.send(self.unregister_header())
        except (TimeoutError, zmq.ZMQError) as e:
            log.warning("%s could not send unregister to the broker: %s", self.kind, e)
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops = []
        await self.conn.close()
        self.conn = None

    # ------------------------------------------------------------ registration

    async def register(self) -> None:
        """Register and await the broker's answer.

        Raises :class:`BrokerUnavailable` when no answer comes in time,
        :class:`BrokerRestarted` when the broker it went to is gone (a register
        to the new one supersedes it) and :class:`RemoteError` when the broker refuses.
        """
        assert self.conn is not None
        self.registered.clear()
        deadline_s = max(10.0, self._interval_s * self._liveness * 3)
        try:
            reply, _ = await self.conn.call(self.register_header(), timeout_s=deadline_s)
        except BrokerRestarted:
            raise
        except BrokerUnavailable as e:
            raise BrokerUnavailable(f"broker at {self.address} did not answer register within {deadline_s:.0f} s") from e
        self._interval_s = float(reply.get("heartbeat_interval_s") or self._interval_s)
        self._liveness = int(reply.get("heartbeat_liveness") or self._liveness)
        self._last_heard = timebase.now()
        self.registered.set()
        self.registrations += 1
        if self.registrations > 1:
            log.info("%s re-registered with the broker at %s", self.kind, self.address)
        self.on_registered(reply)

    async def rejoin(self) -> None:
        """After a request was answered ``unknown_peer``: register again (once) and return once registered."""
        if self.registered.is_set() and not self._leaving:
            self.registered.clear()
            self.spawn(self.register_again())
        await self.registered.wait()

    async def register_again(self) -> None:
        """:meth:`register`, logging a failure instead of raising (the heartbeat loop retries)."""
        try:
            await self.register()
        except BrokerRestarted as e:
            # Sent to a broker that went away: the register sent to its successor (already under way) takes over.
            log.info("%s: a register sent to the old broker was superseded (%s)", self.kind, e)
        except (BrokerUnavailable, RemoteError, ProtocolError) as e:
            log.error("%s could not register: %s", self.kind, e)

    # ------------------------------------------------------------------ loops

    def start_loops(self) -> list[asyncio.Task[None]]:
        """Start the heartbeat loop (:meth:`close` stops it); returns the loops, to watch."""
        self._loops = [asyncio.ensure_future(self._heartbeat_loop())]
        return list(self._loops)

    def _on_stray_reply(self, header: dict[str, Any]) -> None:
        """A reply nobody waits for: an error to a message that expects none (or to a request given up)."""
        if header.get("ok"):
            return
        error = RemoteError.from_reply(header)
        if error.code == ErrorCode.UNKNOWN_PEER.value:
            # The broker declared us dead (or restarted): register again.
            if self.registered.is_set() and not self._leaving:
                log.warning("broker does not know this %s (%s); registering again", self.kind, error.message)
                self.registered.clear()
                self.spawn(self.register_again())
        else:
            log.warning("broker error: %s", error)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            if self.registered.is_set():
                await self.send(self.heartbeat_header())
            silent_s = timebase.now() - self._last_heard
            if silent_s > self._interval_s * self._liveness and not self._leaving:
                if self._deployment_stopped(silent_s):
                    return
                # The broker went silent (or never answered): register again; a restarted broker learns of us.
                log.warning("broker silent for %.1f s; %s registering again", silent_s, self.kind)
                self._last_heard = timebase.now()
                self._follow_moved_broker()
                self.spawn(self.register_again())

    def _deployment_stopped(self, silent_s: float) -> bool:
        """The broker went silent and the deployment was stopped on purpose since this process started (a stop
        whose ``shutdown`` this peer missed, a register the stopping broker took): leave, as on ``shutdown``,
        instead of registering again for ever with a broker that is not coming back."""
        if self.deployment_dir is None:
            return False
        current: Rendezvous | None
        try:
            current = read_rendezvous(self.deployment_dir)
        except RendezvousError:
            current = None
        record = stopped_since(self.deployment_dir, process_started_at(), current)
        if record is None:
            return False
        log.info("broker silent for %.1f s and the deployment was stopped (%s): this %s leaves", silent_s,
                 record.describe(), self.kind)
        self._leaving = True
        self.on_shutdown()
        return True

    def _follow_moved_broker(self) -> None:
        """If the rendezvous file now names another address (a broker restarted elsewhere), reconnect there."""
        if self.conn is not None:
            self.conn.follow_rendezvous = self.follow_rendezvous
            self.conn.follow_moved()
