"""One DEALER connection to a deployment's broker: what clients, nodes and bridges share.

:class:`BrokerConnection` owns the socket (CURVE when the deployment has
keys), requests that await a reply by request id, the reader that matches
replies to requests, the broker's boot id and what happens when it
changes, and following a broker that moved (re-reading the rendezvous
file). An error reply becomes an exception in one place,
:meth:`prorl_cli.exceptions.RemoteError.from_reply`.

Who sits on top says what to do with the broker's other messages
(``on_message``), with replies nobody waits for any more (``on_stray_reply``)
and with a new broker (``on_new_boot``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.exceptions import (
    BadAddress,
    BrokerRefused,
    BrokerRestarted,
    BrokerUnavailable,
    HeaderTooLarge,
    ProtocolError,
    ProtocolMismatch,
    RemoteError,
    RendezvousError,
)
from prorl_cli.protocol import ErrorCode, Op
from prorl_cli.rendezvous import read_rendezvous, rendezvous_path
from prorl_cli.security import secure_peer

log = logging.getLogger(__name__)

#: A reply: its header and its payload frames.
Reply = tuple[dict[str, Any], list[bytes]]
#: ``on_message(op, header, payload)``: a broker message that is not a reply.
MessageHandler = Callable[[Op, dict[str, Any], list[bytes]], None]


def _frames(header: dict[str, Any], payload: Sequence[bytes]) -> list[bytes]:
    """The frames of a message (``protocol.encode``), refused before sending when its header is over the limit."""
    frames = P.encode(header, payload)
    if len(frames[0]) > P.MAX_HEADER_BYTES:
        raise HeaderTooLarge(ErrorCode.BAD_FRAME.value,
                             f"the {header.get('op')!r} header packs to {len(frames[0])} bytes, over the protocol's "
                             f"limit of {P.MAX_HEADER_BYTES}: the broker could not read it")
    return frames


_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
#: A handshake that fails without detail (a broker key that does not decrypt) this many times in a
#: row is a refusal; once could be a broker dying mid-handshake. An auth or protocol failure is at once.
_NO_DETAIL_FAILURES = 3


def _handshake_monitor(sock: zmq.asyncio.Socket, events: int = _HANDSHAKE_EVENTS) -> zmq.asyncio.Socket:
    """A PAIR socket that receives ``sock``'s ``events``, however many wait unread; it replaces a monitor ``sock``
    had, which then receives nothing more.

    libzmq's I/O thread sends a monitor's events with a blocking send, and that thread serves every socket of the
    context (a process's clients, its node). A monitor queue left full (its events unread while the event loop is
    idle: a blocking client between calls, facing a server that refuses each reconnect ten times a second) or a
    monitor closed before the socket it watches would stop that thread, and every socket of the process with it.
    An unbounded receive queue (0 on either end of an inproc pipe lifts its limit) keeps it from the first; the
    watched socket stopping its monitor before the monitor closes keeps it from the second. Once refused, a
    connection watches for a handshake that succeeds only (see ``_watch_handshake``), so an idle client's queue
    does not grow by a refusal per reconnect.
    """
    address = f"inproc://prorl-monitor-{uuid.uuid4().hex}"
    sock.monitor(address, events)
    monitor = sock.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)
    monitor.connect(address)
    return monitor


class BrokerConnection:
    """A DEALER socket to the broker with request/reply, boot-id tracking and broker following.

    ``address`` ``None``: read it from the rendezvous file on :meth:`open`.
    ``follow_rendezvous``: :meth:`follow_moved` may move to the address the
    rendezvous file names now. ``host``: stamped on every request (nodes
    and bridges say where they run). ``unbounded``: no high-water marks
    (results and stage updates must never be dropped or block).
    """

    def __init__(
        self,
        *,
        address: str | None,
        deployment_dir: Path | None,
        name: str = "peer",
        follow_rendezvous: bool = False,
        host: str | None = None,
        linger_ms: int = 0,
        unbounded: bool = True,
        on_message: MessageHandler | None = None,
        on_stray_reply: Callable[[dict[str, Any]], None] | None = None,
        on_new_boot: Callable[[str], None] | None = None,
    ) -> None:
        self.address = address
        self.deployment_dir = deployment_dir
        #: For log lines and errors: "client", "node", "bridge".
        self.name = name
        self.follow_rendezvous = follow_rendezvous
        self.host = host
        self.linger_ms = linger_ms
        self.unbounded = unbounded
        self.on_message = on_message
        self.on_stray_reply = on_stray_reply
        self.on_new_boot = on_new_boot
        #: The broker's boot id as of the last reply that carried one.
        self.boot_id: str | None = None
        #: ``timebase.now()`` of the last message from the broker.
        self.last_heard = timebase.now()
        self.sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        #: Which socket each pending request went out on (a count of sockets opened, see ``_epoch``).
        self._sent_on: dict[int, int] = {}
        #: Bumped each time a socket is opened: a new socket's requests go to whichever broker it reaches.
        self._epoch = 0
        #: The boot id the current socket's broker has answered with (None until it answers).
        self._socket_boot: str | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        #: Set when the current socket's CURVE handshake was refused; requests then fail at once.
        self.refused: BrokerRefused | None = None
        self._monitor: asyncio.Task[None] | None = None
        #: The handshake monitor's socket of the current socket (its task closes it; :meth:`abort` cannot wait for that).
        self._monitor_sock: zmq.asyncio.Socket | None = None
        #: The loop the socket was opened in (its reader runs there).
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Why :meth:`follow_moved` last could not follow the rendezvous file (logged once), None once it could.
        self._follow_problem: str | None = None

    # ----------------------------------------------------------------- socket

    @property
    def is_open(self) -> bool:
        return self.sock is not None

    def open(self) -> None:
        """Connect (reading the rendezvous file when no address was given) and start the reader.

        Raises :class:`RendezvousError` when there is no address and no rendezvous file.
        Call from a running event loop. A socket whose reader died (logged, its waiting requests
        failed) is replaced: nothing would read the replies to what is sent on it. The broker
        knows the new socket by nothing the old one asked for (its watches), so ``on_new_boot``
        is called as for a new broker.
        """
        redo = None
        if self.sock is not None:
            if self._reader is None or not self._reader.done():
                return
            self.sock.close(0)  # left in place until a new one opens: a closed socket refuses to send
            redo = self.boot_id
        if self.address is None:
            if self.deployment_dir is None:
                raise BrokerUnavailable(f"{self.name}: no broker address and no deployment to find one in")
            self.address = read_rendezvous(self.deployment_dir).address
        self._closed = False
        self._connect()
        if redo is not None and self.on_new_boot is not None:
            self.on_new_boot(redo)

    def _connect(self) -> None:
        assert self.address is not None
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sock.setsockopt(zmq.LINGER, self.linger_ms)
            # Our own routing id, kept when libzmq reconnects this socket (a dropped TCP link, a frame the broker
            # refused as too big): with the one libzmq would draw anew, the broker went on sending this peer's
            # results to a connection that is gone. A leading zero byte is libzmq's own; ours never has one.
            sock.setsockopt(zmq.ROUTING_ID, b"p" + uuid.uuid4().bytes)
            if self.unbounded:
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
            curve = self.deployment_dir is not None and secure_peer(sock, self.deployment_dir)  # the broker's key
            monitor = _handshake_monitor(sock)
            try:
                sock.connect(self.address)
            except zmq.ZMQError as e:  # malformed: ZeroMQ names the address, not what a good one looks like
                raise BadAddress(f"broker address {self.address!r}: not an endpoint to connect to ({e.strerror}); "
                                 "give tcp://HOST:PORT") from e
        except BaseException:
            sock.close(0)  # before its monitor (see _handshake_monitor)
            if monitor is not None:
                monitor.close(0)
            raise
        self.sock = sock
        self._epoch += 1
        self._socket_boot = None
        self.refused = None
        if self._monitor is not None:
            self._monitor.cancel()
        self._monitor_sock = monitor
        self._loop = asyncio.get_running_loop()
        self._monitor = asyncio.get_running_loop().create_task(
            self._watch_handshake(sock, monitor, self._epoch, curve), name=f"prorl-{self.name}-handshake"
        )
        self._reader = asyncio.get_running_loop().create_task(
            self._read(sock, self._epoch), name=f"prorl-{self.name}-reader"
        )
        self._reader.add_done_callback(self._reader_done)

    async def _watch_handshake(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket, epoch: int,
                               curve: bool) -> None:
        """Turn a refused CURVE handshake into :attr:`refused` and fail the requests waiting on it.

        Without this a peer with the wrong keys (or none) waits out its whole request timeout:
        the broker drops a handshake it refuses without a word.
        """
        failures = 0
        quiet = False  # watching for a handshake that succeeds only (refused: each reconnect fails again)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    failures = 0
                    self.refused = None
                    if quiet:
                        monitor, quiet = self._rearm(sock, monitor, _HANDSHAKE_EVENTS), False
                    continue
                if not event["event"] & _HANDSHAKE_EVENTS:
                    continue
                failures += 1
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and failures < _NO_DETAIL_FAILURES:
                    continue
                if epoch != self._epoch or self.refused is not None:
                    continue
                self.refused = BrokerRefused(self._refusal(event["event"], curve))
                log.error("%s: %s", self.name, self.refused)
                self._fail_pending(self.refused, epoch=epoch)
                # Only a handshake that succeeds can change that now; a refusal per reconnect (ten a second)
                # would pile up, unread, while a blocking client waits between its calls.
                monitor, quiet = self._rearm(sock, monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED), True
        finally:
            # The watched socket stops sending first: an event sent to a closed monitor blocks libzmq's I/O thread.
            if not sock.closed:
                sock.disable_monitor()
            monitor.close(0)

    def _rearm(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket, events: int) -> zmq.asyncio.Socket:
        """Watch ``sock`` for ``events`` from now on, on a new monitor (``monitor``, replaced, is closed)."""
        if sock.closed:
            return monitor
        new = _handshake_monitor(sock, events)  # the old one receives nothing more: it can close
        monitor.close(0)
        if self._monitor_sock is monitor:
            self._monitor_sock = new
        return new

    def _refusal(self, event: int, curve: bool) -> str:
        """What went wrong with the handshake, which keys were used, and what to do."""
        where = f"the deployment folder {self.deployment_dir}" if self.deployment_dir else "no deployment folder"
        if not curve:
            return (f"the broker at {self.address} requires CURVE keys and this {self.name} has none "
                    f"(no rendezvous file with the broker's key in {where}): connect by deployment name with "
                    "the PRORL_HOME (or prorl --home) the deployment uses, so its client.key is read; "
                    "an address alone is not enough")
        what = ("refused this client's key" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                else "did not complete the CURVE handshake (its public key is not the one in broker.json)")
        return (f"the broker at {self.address} {what}: the keys came from {where}, which belongs to another "
                "deployment or an old broker; use the PRORL_HOME (or prorl --home) and -d NAME the "
                "deployment was started with")

    def _reader_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: the reader of the broker connection died: %r", self.name, task.exception())
            self._fail_pending(BrokerUnavailable(f"{self.name}: the connection to {self.address} failed: {task.exception()}"))

    async def close(self, linger_ms: int | None = None) -> None:
        """Stop the reader and background tasks, fail waiting requests, close the socket."""
        self._closed = True
        tasks = [t for t in (self._reader, self._monitor, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reader = self._monitor = None
        self._fail_pending(BrokerUnavailable(f"{self.name}: connection closed"))
        if self.sock is not None:
            self.sock.close(self.linger_ms if linger_ms is None else linger_ms)
            self.sock = None

    def abort(self) -> None:
        """Close at once, without awaiting anything: what :meth:`close` does, for who cannot await it.

        The reader, the handshake monitor and background tasks are cancelled (they end at the loop's next turns,
        nobody waits for them), waiting requests fail, and both sockets close with linger 0, so their file
        descriptors go now. Call it from a callback of the loop the connection was opened in, or once that loop
        is closed (its tasks are then left alone: cancelling them would schedule work on a closed loop).
        """
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            for task in (self._reader, self._monitor, *self._background):
                if task is not None:
                    task.cancel()
            self._fail_pending(BrokerUnavailable(f"{self.name}: connection closed"))
        self._reader = self._monitor = None
        for sock in (self.sock, self._monitor_sock):
            if sock is not None:
                sock.close(0)
        self.sock = self._monitor_sock = None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, keeping a reference until it ends (:meth:`close` cancels it)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: background task failed: %r", self.name, task.exception())

    # --------------------------------------------------------------- messages

    async def send(self, header: dict[str, Any], payload: Sequence[bytes] = ()) -> None:
        """Send a message that gets no reply (:class:`HeaderTooLarge` if its header is over the protocol's limit)."""
        if self.sock is None:
            raise BrokerUnavailable(f"{self.name}: not connected to the broker")
        await self.sock.send_multipart(_frames(header, payload), copy=False)

    async def _send_request(self, frames: list[bytes], answered: asyncio.Future[Reply]) -> None:
        """Send a request's frames. A socket that cannot take them at once (no connection to the broker yet, or
        its queue full) is waited on only until the request ends without them: a refused handshake, or a lost
        broker, fails ``answered``, and a request stuck in its send would never see that."""
        assert self.sock is not None
        sending = asyncio.ensure_future(self.sock.send_multipart(frames, copy=False))  # pyzmq's own future
        try:
            if not sending.done():
                await asyncio.wait((sending, answered), return_when=asyncio.FIRST_COMPLETED)
            if sending.done():
                sending.result()  # a send that failed raises here
        finally:
            if not sending.done():
                sending.cancel()  # never sent: the request ended (answered, timed out or cancelled) first

    def send_soon(self, header: dict[str, Any]) -> None:
        """Send a message without awaiting: pyzmq queues it now, before anything the caller sends next."""
        if self.sock is None or self._closed:
            return
        sent = asyncio.ensure_future(self.sock.send_multipart(P.encode(header, ()), copy=False))

        def check(f: asyncio.Future[Any]) -> None:
            # Never awaited: look at the outcome so a failure is logged, not lost.
            if not f.cancelled() and f.exception() is not None:
                log.warning("%s could not send %s: %s", self.name, header.get("op"), f.exception())

        sent.add_done_callback(check)

    async def request(
        self,
        header: dict[str, Any],
        payload: Sequence[bytes] = (),
        *,
        timeout_s: float | None = None,
        cancel: dict[str, Any] | None = None,
    ) -> Reply:
        """Send a request and await its reply (header, payload), error replies included.

        ``timeout_s``: raise :class:`BrokerUnavailable` when no reply came in
        time. ``cancel``: a message sent, with this request's ``rid``, when
        the caller stops waiting (timeout, or its task was cancelled).
        :class:`BrokerRestarted` when the broker that had the request is gone.
        """
        self.open()
        if self.refused is not None:
            raise self.refused
        rid = next(self._rids)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._sent_on[rid] = self._epoch
        fields: dict[str, Any] = {"rid": rid}
        if self.host is not None:
            fields["host"] = self.host
        try:
            frames = _frames({**header, **fields}, payload)
            # asyncio.timeout, not wait_for: wait_for can swallow a cancel that lands with the reply (gh-86296).
            # The send is inside the limit: a request that could not even be sent in time was not answered either.
            async with asyncio.timeout(timeout_s):
                await self._send_request(frames, fut)
                return await fut
        except TimeoutError as e:
            if cancel is not None:
                self.send_soon({**cancel, "rid": rid})
            op = header.get("op")
            raise BrokerUnavailable(
                f"the broker at {self.address} does not answer ({op!r}: no reply within {timeout_s:g} s)"
            ) from e
        except asyncio.CancelledError:
            if cancel is not None and not (fut.done() and not fut.cancelled()):  # no reply came
                self.send_soon({**cancel, "rid": rid})
            raise
        finally:
            self._pending.pop(rid, None)
            self._sent_on.pop(rid, None)

    async def call(
        self, header: dict[str, Any], payload: Sequence[bytes] = (), *, timeout_s: float | None = None
    ) -> Reply:
        """:meth:`request`, raising the :class:`RemoteError` an error reply stands for."""
        reply, frames = await self.request(header, payload, timeout_s=timeout_s)
        if not reply.get("ok"):
            raise RemoteError.from_reply(reply)
        return reply, frames

    # ----------------------------------------------------------------- reader

    async def _read(self, sock: zmq.asyncio.Socket, epoch: int) -> None:
        while True:
            frames = await sock.recv_multipart()
            self.last_heard = timebase.now()
            try:
                header = P.decode_header(frames[0])
            except ProtocolError as e:
                if e.code == ErrorCode.BAD_VERSION:
                    self._version_mismatch(frames[0], epoch)
                else:
                    log.error("%s: bad frame from the broker: %s", self.name, e)
                continue
            op = header["op"]
            if op == Op.REPLY:
                self._on_reply(header, frames[1:], epoch)
            elif op != Op.HEARTBEAT and self.on_message is not None:
                try:
                    self.on_message(op, header, P.job_items(op, frames[1:]))
                except (ProtocolError, KeyError, TypeError, ValueError) as e:
                    # A message its handler could not take must not stop the reader (and with it every reply).
                    log.error("%s: could not handle %s from the broker: %r", self.name, op.value, e)

    def _version_mismatch(self, frame: bytes, epoch: int) -> None:
        """A reply in another protocol version: the broker runs another prorl. The request it answers fails
        saying so at once, instead of waiting out its timeout as if the broker were silent. Anything else in
        another version (no reply to a request of ours) is only logged: one bad frame must not end the link."""
        header = P.decode_map(frame)
        rid = P.header_rid(header)
        fut = self._pending.get(rid) if isinstance(rid, int) else None
        theirs = header.get("v")
        if (header.get("op") != Op.REPLY.value or not isinstance(theirs, int) or isinstance(theirs, bool)
                or fut is None or fut.done() or self._sent_on.get(rid) != epoch):
            log.error("%s: bad frame from the broker: protocol version %r (this %s speaks %d)", self.name,
                      theirs, self.name, P.PROTOCOL_VERSION)
            return
        error = ProtocolMismatch(
            f"the broker at {self.address} speaks protocol version {theirs!r} and this {self.name} speaks "
            f"{P.PROTOCOL_VERSION}: the broker runs another prorl version. Stop it with the prorl that started it "
            "(or end its process), then start it with this one, or use the prorl it runs")
        log.error("%s: %s", self.name, error)
        fut.set_exception(error)

    def _on_reply(self, header: dict[str, Any], payload: list[bytes], epoch: int | None = None) -> None:
        rid = header.get("rid")
        boot_id = header.get("boot_id")
        if isinstance(boot_id, str) and (epoch is None or epoch == self._epoch):
            self.note_boot(boot_id, answered=rid)
        fut = self._pending.get(rid) if isinstance(rid, int) else None
        if fut is not None and not fut.done():
            fut.set_result((header, payload))
        elif self.on_stray_reply is not None:
            self.on_stray_reply(header)

    def note_boot(self, boot_id: str, answered: Any = None) -> None:
        """Record the broker's boot id; a new one fails the requests the old broker took with it.

        ``answered``: the rid whose reply carried ``boot_id``. Only requests
        the old broker may have taken are lost: on the socket that had heard
        the old boot id, those sent before ``answered`` and still unanswered
        (the broker answers one peer's requests in order, so one that reached
        the new broker ahead of ``answered`` would have been answered ahead of
        it). Requests sent on a socket opened after a move, or after
        ``answered``, went to the new broker and wait for their replies.
        """
        socket_boot, self._socket_boot = self._socket_boot, boot_id
        if self.boot_id == boot_id:
            return
        first, self.boot_id = self.boot_id is None, boot_id
        if first:
            return
        lost = 0
        if socket_boot is not None:  # this socket reached the old broker: what it sent before may be gone
            lost = self._fail_pending(
                BrokerRestarted(f"the broker at {self.address} restarted; this request was lost with it"),
                before=answered if isinstance(answered, int) else None, epoch=self._epoch,
            )
        log.warning("%s: the broker at %s is a new one (new boot id); %d request(s) in flight were lost with the old one",
                    self.name, self.address, lost)
        if self.on_new_boot is not None:
            self.on_new_boot(boot_id)

    def _fail_pending(self, error: Exception, *, before: int | None = None, epoch: int | None = None) -> int:
        """Fail waiting requests (only those with a rid below ``before`` / sent on socket ``epoch``, when given)."""
        lost = [
            f for rid, f in self._pending.items()
            if not f.done() and (before is None or rid < before) and (epoch is None or self._sent_on.get(rid) == epoch)
        ]
        for fut in lost:
            fut.set_exception(error)
        return len(lost)

    # ------------------------------------------------------------- following

    @property
    def waiting(self) -> bool:
        """Whether a request awaits its reply."""
        return any(not f.done() for f in self._pending.values())

    @property
    def silent_s(self) -> float:
        """Seconds since the broker was last heard from."""
        return timebase.now() - self.last_heard

    def follow_moved(self) -> bool:
        """If the rendezvous file now names another address, reconnect there; return whether it moved.

        Requests in flight fail with :class:`BrokerRestarted` (they went with
        the old broker). Only with ``follow_rendezvous``.
        """
        if not self.follow_rendezvous or self.deployment_dir is None or self.sock is None:
            return False
        try:
            info = read_rendezvous(self.deployment_dir)
        except RendezvousError as e:
            if not isinstance(e.__cause__, FileNotFoundError):  # none yet: the new broker is still starting
                self._cannot_follow(str(e))
            return False
        if info.address == self.address:
            self._follow_problem = None
            return False
        old_sock, old_reader, old_address = self.sock, self._reader, self.address
        self.address = info.address
        try:
            self._connect()  # before the old socket goes: an address it cannot connect to leaves that one in place
        except (BadAddress, zmq.ZMQError, RendezvousError) as e:
            self.address = old_address
            self._cannot_follow(f"{rendezvous_path(self.deployment_dir)} names the broker address {info.address!r}, "
                                f"which this {self.name} cannot connect to: {e}")
            return False
        self._follow_problem = None
        log.warning("the broker moved from %s to %s; %s follows it", old_address, info.address, self.name)
        self._fail_pending(BrokerRestarted(f"the broker at {old_address} is gone; this request went with it"))
        if old_reader is not None:
            old_reader.cancel()
            self._background.add(old_reader)
            old_reader.add_done_callback(self._background.discard)
        old_sock.close(0)
        return True

    def _cannot_follow(self, problem: str) -> None:
        """Log why the rendezvous file cannot be followed (once while it stays the same): the old address stays."""
        if problem != self._follow_problem:
            self._follow_problem = problem
            log.error("%s cannot follow the rendezvous file: %s; staying with %s", self.name, problem, self.address)
