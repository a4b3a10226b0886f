"""A worker's connection to the broker: what node servers and inference bridges share.

One DEALER socket per peer. The peer registers (and learns the broker's
heartbeat interval and liveness from the reply), heartbeats while
registered, sends requests that await a reply by request id, and registers
again when the broker goes silent for ``liveness`` intervals or answers
``unknown_peer`` (it declared the peer dead, or restarted). Subclasses say
what they register as, what their heartbeat carries, and what they do with
the broker's other ops.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from prorl_cli import protocol as P
from prorl_cli.exceptions import BrokerRestarted, BrokerUnavailable, ProtocolError, RendezvousError
from prorl_cli.protocol import ErrorCode, Op
from prorl_cli.rendezvous import read_rendezvous
from prorl_cli.security import secure_peer

log = logging.getLogger(__name__)

Reply = tuple[dict[str, Any], list[bytes]]


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
        self.address = address
        self.host = host
        #: Where the deployment's CURVE keys live (when the broker encrypts); ``None``: plain TCP.
        self.deployment_dir = deployment_dir
        self.sock: zmq.asyncio.Socket | None = None
        #: Set while the broker knows this peer.
        self.registered = asyncio.Event()
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._last_heard = time.monotonic()
        self._interval_s = heartbeat_interval_s
        self._liveness = heartbeat_liveness
        #: Set once the peer is leaving: no more re-registering.
        self._leaving = False
        self._boot_id: str | None = None  # the broker's, as of the last registration
        #: Re-read the rendezvous file when the broker goes silent, and follow it to a new address.
        self.follow_rendezvous = False
        self._connect_opts: tuple[int, bool] = (1000, False)

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
        """Open the DEALER socket (CURVE when the deployment has keys) and connect."""
        if self.address is None:
            raise BrokerUnavailable(f"{self.kind}: no broker address")
        self._connect_opts = (linger_ms, unbounded)
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        if unbounded:
            # Results and stage updates must never be dropped or block on a high-water mark.
            self.sock.setsockopt(zmq.SNDHWM, 0)
            self.sock.setsockopt(zmq.RCVHWM, 0)
        if self.deployment_dir is not None:
            secure_peer(self.sock, self.deployment_dir)
        self.sock.connect(self.address)

    async def send(self, header: dict[str, Any], payload: list[bytes] | tuple[bytes, ...] = ()) -> None:
        """Send the broker a message that gets no reply."""
        assert self.sock is not None
        await self.sock.send_multipart(P.encode(header, payload), copy=False)

    async def request(
        self,
        header: dict[str, Any],
        payload: list[bytes] | tuple[bytes, ...] = (),
        *,
        cancel: dict[str, Any] | None = None,
    ) -> Reply:
        """Send a request to the broker and await its reply (header, payload).

        ``cancel``: a message to send, with this request's ``rid``, if the
        caller stops waiting (a timeout, or its task was cancelled).
        """
        rid = next(self._rids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self.send({**header, "rid": rid, "host": self.host}, payload)
            return await fut
        except asyncio.CancelledError:
            if cancel is not None and (fut.cancelled() or not fut.done()):  # no reply came
                self._send_now({**cancel, "rid": rid})
            raise
        finally:
            self._pending.pop(rid, None)

    def _send_now(self, header: dict[str, Any]) -> None:
        """Queue a message without awaiting, so it goes out before anything the caller sends next."""
        if self.sock is None or self._leaving:
            return
        sent = asyncio.ensure_future(self.sock.send_multipart(P.encode(header, ()), copy=False))

        def check(f: asyncio.Future[Any]) -> None:
            # Never awaited: look at the outcome so a failure is logged, not lost.
            if not f.cancelled() and f.exception() is not None:
                log.warning("%s could not send %s: %s", self.kind, header.get("op"), f.exception())

        sent.add_done_callback(check)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        """Unregister (best effort, 1 s), stop the loops and close the socket."""
        self._leaving = True
        if self.sock is None:
            return
        try:
            await asyncio.wait_for(self.send(self.unregister_header()), 1.0)
        except (TimeoutError, zmq.ZMQError) as e:
            log.warning("%s could not send unregister to the broker: %s", self.kind, e)
        tasks = [*self._loops, *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loops = []
        self.sock.close()
        self.sock = None

    # ------------------------------------------------------------ registration

    async def register(self) -> None:
        """Register and await the broker's answer.

        Raises :class:`BrokerUnavailable` when no answer comes in time and
        :class:`ProtocolError` when the broker refuses.
        """
        self.registered.clear()
        deadline_s = max(10.0, self._interval_s * self._liveness * 3)
        try:
            reply, _ = await asyncio.wait_for(self.request(self.register_header()), deadline_s)
        except TimeoutError as e:
            raise BrokerUnavailable(f"broker at {self.address} did not answer register within {deadline_s:.0f} s") from e
        if not reply.get("ok"):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"broker refused register: {reply.get('error')}")
        self._interval_s = float(reply.get("heartbeat_interval_s") or self._interval_s)
        self._liveness = int(reply.get("heartbeat_liveness") or self._liveness)
        self._last_heard = time.monotonic()
        boot_id = reply.get("boot_id")
        if self._boot_id is not None and boot_id != self._boot_id:
            # A new broker: requests the old one had will never be answered. Fail them now, not at their timeouts.
            lost = [f for rid, f in self._pending.items() if not f.done() and rid != reply.get("rid")]
            for fut in lost:
                fut.set_exception(BrokerRestarted(f"the broker at {self.address} restarted; this request was lost with it"))
            if lost:
                log.warning("broker restarted: %d request(s) in flight were lost with it", len(lost))
        self._boot_id = boot_id if isinstance(boot_id, str) else None
        self.registered.set()
        self.on_registered(reply)

    async def register_again(self) -> None:
        """:meth:`register`, logging a failure instead of raising (the heartbeat loop retries)."""
        try:
            await self.register()
        except (BrokerUnavailable, ProtocolError) as e:
            log.error("%s could not register: %s", self.kind, e)

    # ------------------------------------------------------------------ loops

    def start_loops(self) -> list[asyncio.Task[None]]:
        """Start the receive and heartbeat loops (:meth:`close` stops them); returns them, to watch."""
        self._loops = [
            asyncio.ensure_future(self._receive_loop()),
            asyncio.ensure_future(self._heartbeat_loop()),
        ]
        return list(self._loops)

    async def _receive_loop(self) -> None:
        while True:
            sock = self.sock
            assert sock is not None
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self.sock is not sock and task is not None and not task.cancelling():
                    continue  # the socket was swapped for one to a broker that moved (closing it cancelled our read)
                raise
            self._last_heard = time.monotonic()
            try:
                header = P.decode_header(frames[0])
            except ProtocolError as e:
                log.error("%s: bad frame from the broker: %s", self.kind, e)
                continue
            op = header["op"]
            if op == Op.REPLY:
                self._on_reply(header, frames[1:])
            elif op == Op.SHUTDOWN:
                log.info("broker asked this %s to shut down", self.kind)
                self.on_shutdown()
            elif op != Op.HEARTBEAT:
                self.on_message(op, header, frames[1:])

    def _on_reply(self, header: dict[str, Any], payload: list[bytes]) -> None:
        fut = self._pending.get(header.get("rid"))  # type: ignore[arg-type]
        if fut is not None and not fut.done():
            fut.set_result((header, payload))
            return
        if header.get("ok"):
            return
        raw_error = header.get("error")
        error: dict[str, Any] = raw_error if isinstance(raw_error, dict) else {}
        if error.get("code") == ErrorCode.UNKNOWN_PEER.value:
            # The broker declared us dead (or restarted): register again.
            if self.registered.is_set() and not self._leaving:
                log.warning("broker does not know this %s (%s); registering again", self.kind, error.get("message"))
                self.registered.clear()
                self.spawn(self.register_again())
        else:
            log.warning("broker error: %s", header.get("error"))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            if self.registered.is_set():
                await self.send(self.heartbeat_header())
            silent_s = time.monotonic() - self._last_heard
            if silent_s > self._interval_s * self._liveness and not self._leaving:
                # The broker went silent (or never answered): register again; a restarted broker learns of us.
                log.warning("broker silent for %.1f s; %s registering again", silent_s, self.kind)
                self._last_heard = time.monotonic()
                self._follow_moved_broker()
                self.spawn(self.register_again())

    def _follow_moved_broker(self) -> None:
        """If the rendezvous file now names another address (a broker restarted elsewhere), reconnect there."""
        if not self.follow_rendezvous or self.deployment_dir is None or self.sock is None:
            return
        try:
            info = read_rendezvous(self.deployment_dir)
        except RendezvousError:
            return  # not written yet: the new broker is still starting
        if info.address == self.address:
            return
        log.warning("the broker moved from %s to %s; %s follows it", self.address, info.address, self.kind)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(BrokerRestarted(f"the broker at {self.address} is gone; this request went with it"))
        old, self.address = self.sock, info.address
        linger_ms, unbounded = self._connect_opts
        self.connect(linger_ms=linger_ms, unbounded=unbounded)  # reads the new broker's CURVE key too
        old.close(linger=0)
