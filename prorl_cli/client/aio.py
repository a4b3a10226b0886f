"""AsyncRolloutClient: the trainer's side of the broker, on asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import uuid
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.client.results import ResultStream, Submitted, job_id_list
from prorl_cli.config import ProrlConfig, load_config
from prorl_cli.connection import BrokerConnection, Reply
from prorl_cli.exceptions import (
    BrokerUnavailable,
    CheckpointNotADirectory,
    CheckpointNotFound,
    ClientClosed,
    ClientMisuse,
    DrainTimeout,
    HeaderTooLarge,
    ProrlError,
    ProtocolError,
    ReloadFailed,
    RemoteError,
    RequestRefused,
    ResultTimeout,
    UnknownJob,
)
from prorl_cli.protocol import (
    BackendStatus,
    ForgetOutcome,
    JobResult,
    JobSpec,
    Op,
    SamplingParams,
    StatusReport,
    derive_seed,
)
from prorl_cli.protocol import headers as H
from prorl_cli.protocol.checks import BIG

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 30.0
#: While the broker stays silent under a waiting client, its warning is repeated this often.
SILENCE_REPEAT_S = 60.0
#: The short ping that tells "the broker does not answer" before a real request waits its full timeout.
DEFAULT_PING_TIMEOUT_S = 3.0
#: What :meth:`AsyncRolloutClient.cancel` says for an id the broker does not know.
UNKNOWN = "unknown"


@dataclass
class WeightsUpdated:
    """What :meth:`AsyncRolloutClient.update_weights` did: bridges that loaded the weights, HTTP backends skipped."""

    updated: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    policy_version: int = 0
    #: A bridge loaded the checkpoint. False: none was up to load it (or only HTTP backends were), yet the broker
    #: took it as the current weights: nothing has shown that it loads, and the first bridge to join must load it
    #: (``StatusReport.weights.verified`` turns true then; a bridge that cannot is told to shut down).
    verified: bool = False


_Args = ParamSpec("_Args")


def _weakly(method: Callable[_Args, None]) -> Callable[_Args, None]:
    """``method``, called through a weak reference to its object (a call once the object is gone does nothing).

    The connection outlives a client dropped unclosed (the loop keeps its reader waiting on the socket): with
    the client's bound methods as its callbacks, it would keep that client alive, and its sockets open, for ever.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: _Args.args, **kwargs: _Args.kwargs) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)

    return call


#: What packing adds around an instance in a submit's payload frame (msgpack's bin and array headers), at most.
_FRAMING_BYTES = 64
#: Jobs per submit below which the header's size is estimated from the first spec alone (the payload's is summed).
_SUBMIT_FAST_JOBS = 256


def checked_timeout(value: Any) -> float:
    """``request_timeout_s`` as given, checked: a number of seconds above 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"request_timeout_s: a number of seconds, got {type(value).__name__} {value!r}")
    if not value > 0:
        raise ValueError(f"request_timeout_s: must be above 0 s, got {value!r}")
    return float(value)


def _packed_instances(specs: Sequence[JobSpec], instances: Sequence[Any]) -> list[bytes]:
    """Each instance packed; :class:`RequestRefused` naming the first that msgpack cannot carry (a set, an object,
    an int beyond 64 bits), its index and job id."""
    frames = []
    for k, instance in enumerate(instances):
        try:
            frames.append(P.pack_obj(instance))
        except (TypeError, ValueError, OverflowError) as e:
            raise RequestRefused(P.ErrorCode.BAD_FIELD.value,
                                 f"instance {k} ({specs[k].job_id!r}) cannot be sent: {e} (instances are msgpack: "
                                 "dicts, lists, str, bytes, numbers up to 64 bits, bools, None)") from e
    return frames


def _refuse_repeated_ids(specs: Sequence[JobSpec]) -> None:
    """:class:`RequestRefused` naming a job id that appears twice (the broker's check, for a submit it gets in parts)."""
    seen: set[str] = set()
    for k, spec in enumerate(specs):
        if spec.job_id in seen:
            raise RequestRefused(P.ErrorCode.BAD_FIELD.value, f"jobs[{k}]: job id {spec.job_id!r} appears twice in "
                                 "one submit")
        seen.add(spec.job_id)


def _submit_chunks(specs: Sequence[JobSpec], frames: list[bytes], limit_bytes: int,
                   *, guess: bool = True) -> list[tuple[int, int]]:
    """``(first, end)`` index ranges of ``specs`` to send as one submit message each.

    The instances of one message travel in one payload frame, which the broker's socket refuses (dropping the
    connection without a word) past ``limit_bytes``; the specs travel in the header, refused past
    MAX_HEADER_BYTES. Each message keeps to half of either. ``guess``: a small submit may go whole on the
    first spec's size (see :meth:`AsyncRolloutClient.submit_specs` for when the guess is wrong).
    """
    payload_budget, header_budget = limit_bytes // 2, P.MAX_HEADER_BYTES // 2
    if (guess and len(specs) <= _SUBMIT_FAST_JOBS
            and sum(map(len, frames)) + _FRAMING_BYTES * len(frames) <= payload_budget
            # Specs of one submit mostly share their fields, so the first one's size, with room to spare, stands
            # for the rest without packing each of them once more.
            and (not specs or 4 * len(specs) * (len(P.pack_obj(specs[0].to_wire())) + _FRAMING_BYTES) <= header_budget)):
        return [(0, len(specs))]
    chunks: list[tuple[int, int]] = []
    start = payload = header = 0
    for k, (spec, frame) in enumerate(zip(specs, frames, strict=True)):
        pay, head = len(frame) + _FRAMING_BYTES, len(P.pack_obj(spec.to_wire())) + _FRAMING_BYTES
        if k > start and (payload + pay > payload_budget or header + head > header_budget):
            chunks.append((start, k))
            start, payload, header = k, 0, 0
        payload += pay
        header += head
    chunks.append((start, len(specs)))
    return chunks


async def _watch_broker(client_ref: weakref.ref[AsyncRolloutClient]) -> None:
    """A client's watchdog: :meth:`AsyncRolloutClient._check_broker` every heartbeat, for as long as the client lives.

    It holds the client only during a check. Asleep, a strong reference from this task (which the loop keeps
    while it sleeps) would keep a client its owner dropped without closing alive for ever, its sockets open.
    """
    while (client := client_ref()) is not None:
        interval_s = client.config.broker.heartbeat_interval_s
        del client
        await asyncio.sleep(interval_s)
        if (client := client_ref()) is not None:
            await client._check_broker()


def _release_abandoned(loop: asyncio.AbstractEventLoop | None, conn: BrokerConnection,
                       tasks: list[asyncio.Task[None]]) -> None:
    """Close the connection of a client collected unclosed: called from its finalizer, in any thread, at any moment.

    A garbage collection may run the finalizer in another thread than the loop's, or in the loop's own thread in
    the middle of the loop's work (it starts at any allocation): there it must neither cancel tasks nor touch
    the loop's selector (closing an asyncio socket of pyzmq unregisters it). The loop does that at its next turn,
    handed the work by ``call_soon_threadsafe``, which is made to be called from anywhere (asyncio's own signal
    handling calls it). A closed loop runs nothing any more (``asyncio.run`` cancelled the tasks as it ended):
    the sockets close here, with linger 0, which is safe from any thread.
    """
    if loop is not None and not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # "Event loop is closed": closed meanwhile by its thread
            loop.call_soon_threadsafe(_abort, conn, tasks)
            return
    conn.abort()


def _abort(conn: BrokerConnection, tasks: list[asyncio.Task[None]]) -> None:
    """In the loop: end the background tasks of a client collected unclosed, and close its connection at once."""
    for task in tasks:
        task.cancel()
    conn.abort()


class AsyncRolloutClient:
    """Submit jobs, await or stream their results, cancel, forget, inspect, manage backends.

    Find the broker by deployment (the rendezvous file under ``PRORL_HOME``)
    or give its ``address`` directly::

        async with AsyncRolloutClient("default") as client:
            ids = await client.submit("math", instances, n=8)
            async for result in client.as_completed(ids):
                ...

    Each job's final result is delivered once per stream, however often a
    (restarted) broker sends it again.
    """

    def __init__(
        self,
        deployment: str | None = None,
        *,
        address: str | None = None,
        config: ProrlConfig | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        self.config = config or load_config(overrides={"deployment": deployment} if deployment else None)
        if deployment and self.config.deployment != deployment:
            # A copy: the caller's config may serve other clients, of the deployment it names.
            self.config = copy.copy(self.config)
            self.config.deployment = deployment
        self._address = address
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the connection lives in (_check_loop)
        self._pid = os.getpid()
        #: Without an explicit address the client reads the rendezvous file, and reads it again if the broker goes away.
        self.follow_rendezvous = address is None
        self.request_timeout_s = checked_timeout(request_timeout_s)
        self._conn: BrokerConnection | None = None
        self._results: dict[str, JobResult] = {}
        self._waiters: dict[str, list[asyncio.Future[JobResult]]] = {}
        self._streams: list[ResultStream] = []
        #: The jobs a broker confirmed (accepted, already had, or watched) whose results we want: id -> task ("" if unknown).
        self._watched: dict[str, str] = {}
        self._watchdog: asyncio.Task[None] | None = None
        #: When the watchdog's pings began to go unanswered (None: the broker answers, or nobody waits).
        self._silent_since: float | None = None
        self._silence_said_at: float | None = None
        self._rewatch_task: asyncio.Task[None] | None = None
        self._rewatch_again = False
        #: What the ResourceWarning of a client dropped unclosed tells to do (RolloutClient, which wraps this one, says its own).
        self._close_hint = "use `async with AsyncRolloutClient(...) as client:` or `await client.close()`"
        #: Set by :meth:`close`, for good: a closed client refuses every call (:class:`ClientClosed`), as the
        #: blocking one does, instead of quietly connecting again.
        self._closed = False

    def __del__(self, _warn: Callable[..., None] = warnings.warn, _getpid: Callable[[], int] = os.getpid,
                _release: Callable[..., None] = _release_abandoned) -> None:
        # Dropped while connected (no close(), no `async with`): like an unclosed asyncio transport, say so, and
        # release the sockets so that a client made per training step does not run the process out of fds.
        # What it calls is bound now: at interpreter exit, module globals may be gone before this runs.
        conn: BrokerConnection | None = getattr(self, "_conn", None)  # absent when __init__ raised
        if conn is None or getattr(self, "_pid", None) != _getpid():
            return  # nothing open, or a fork's copy of the parent's sockets, which this process must not close
        # Released first: under -W error the warning raises, and the sockets must go all the same.
        address = conn.address
        try:
            _release(self._loop, conn, [t for t in (self._watchdog, self._rewatch_task) if t is not None])
        finally:
            _warn(f"unclosed {type(self).__name__} (broker {address}), collected with its connection open: "
                  f"{self._close_hint}; its sockets are closed now", ResourceWarning, source=self)

    @property
    def address(self) -> str | None:
        """The broker's address (once connected, where the connection is now)."""
        return self._conn.address if self._conn is not None else self._address

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: every request, wait and stream raises :class:`ClientClosed` from then on."""
        return self._closed

    def _check_open(self) -> None:
        """:class:`ClientClosed` once :meth:`close` ran."""
        if self._closed:
            raise ClientClosed(f"this {type(self).__name__} is closed; make a new one")

    # -------------------------------------------------------------- plumbing

    async def __aenter__(self) -> AsyncRolloutClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the connection (done on first use anyway); :class:`RendezvousError` if the deployment has no broker."""
        self._check_open()  # every request comes through here: a closed client must not open a new connection
        if self._conn is not None:
            self._check_loop()
            return
        self._loop = asyncio.get_running_loop()
        conn = BrokerConnection(
            address=self._address,
            deployment_dir=self.config.deployment_dir,
            name="client",
            follow_rendezvous=self.follow_rendezvous,
            on_message=_weakly(self._on_message),
            on_new_boot=_weakly(self._on_new_boot),
        )
        conn.open()
        self._conn = conn
        self._watchdog = asyncio.get_running_loop().create_task(_watch_broker(weakref.ref(self)),
                                                                name="prorl-client-watchdog")

    async def close(self) -> None:
        """Close the connection; calls waiting on it end with :class:`ClientClosed`, as every later request does.

        Nothing can reach a closed client any more (no result, no reply): a ``result()``, ``wait()``, or
        result stream (a DAPO sampler's step) awaited in another task would otherwise wait for ever.
        Closing twice is fine.
        """
        if not self._closed:
            self._closed = True
            waiters, self._waiters = self._waiters, {}
            for job_id, futures in waiters.items():
                for fut in futures:
                    if not fut.done():
                        fut.set_exception(ClientClosed(f"the client was closed while job {job_id!r}'s result was "
                                                       "awaited (the job goes on at the broker)"))
            streams, self._streams = self._streams, []
            for stream in streams:
                stream._client_closed()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        if self._conn is not None:
            await self._conn.close(0)
            self._conn = None

    def _on_message(self, op: Op, header: dict[str, Any], payload: list[bytes]) -> None:
        if op != Op.RESULT:
            return
        for frame in payload:
            try:
                result = JobResult.from_wire(P.unpack_obj(frame))
            except ProtocolError:
                continue  # the broker never sends garbage; ignore rather than die
            self._deliver(result)

    def _deliver(self, result: JobResult) -> None:
        if result.job_id in self._results:
            return  # sent again (a restarted broker, a second watch): every stream already has it
        self._results[result.job_id] = result
        for fut in self._waiters.pop(result.job_id, []):
            if not fut.done():
                fut.set_result(result)
        for stream in self._streams:
            stream._offer(result)

    async def request(
        self, op: Op, payload: Sequence[bytes] = (), timeout_s: float | None = None, **fields: Any
    ) -> Reply:
        """Send one request; return the reply. Raise :class:`RemoteError` on an error reply and
        :class:`BrokerUnavailable` when no reply comes within ``timeout_s`` (default ``request_timeout_s``)."""
        return await self._call({"op": op.value, **fields}, payload, timeout_s)

    def _check_loop(self) -> None:
        """:class:`ClientMisuse` if this client's connection lives in another event loop than the running one (its
        reader and watchdog died with that loop: results would never arrive here), or in the process a fork copied."""
        if self._conn is None:
            return
        if os.getpid() != self._pid:
            raise ClientMisuse(f"this client was made in process {self._pid}, before a fork: make a new one in this "
                               f"process ({os.getpid()})")
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise ClientMisuse("this AsyncRolloutClient belongs to the event loop it connected in (each asyncio.run "
                               "is a new loop): make a client in this loop, or use RolloutClient across calls")

    async def _call(self, header: dict[str, Any], payload: Sequence[bytes] = (), timeout_s: float | None = None) -> Reply:
        """:meth:`request` with its header built (its ``rid`` is the connection's own)."""
        await self.connect()
        assert self._conn is not None
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        conn = self._conn
        try:
            return await conn.call(header, payload, timeout_s=timeout_s)
        except BrokerUnavailable as e:
            # The connection failed the request because close() closed it: say that, not "broker unavailable".
            self._refuse_if_closed(e)
            # Unanswered: if the broker moved meanwhile, the caller's retry goes to the new one.
            conn.follow_moved()
            raise

    def _refuse_if_closed(self, error: BaseException) -> None:
        """:class:`ClientClosed` (from ``error``) if :meth:`close` ran while a request waited for its reply."""
        if self._closed:
            raise ClientClosed(f"the client was closed while a request to the broker waited for its reply: {error}") \
                from error

    async def _ask(self, op: Op, header: H.Header, payload: Sequence[bytes] = ()) -> Any:
        """Send the typed ``header`` of ``op``; its reply checked and typed (``protocol.parse_reply``): ``ProtocolError``
        names a bad field."""
        reply, _ = await self._call(header.to_wire(op), payload)
        return P.parse_reply(op, reply)

    # --------------------------------------------------------- broker restarts

    def _on_new_boot(self, boot_id: str) -> None:
        """A broker that restarted knows no watchers (and, without its journal, no jobs): watch again, once."""
        if self._rewatch_task is not None and not self._rewatch_task.done():
            self._rewatch_again = True
            return
        assert self._conn is not None
        self._rewatch_task = self._conn.spawn(self._rewatch())

    def broker_silent_s(self) -> float | None:
        """Seconds the broker has left the watchdog's pings unanswered while results were awaited, else None."""
        return None if self._silent_since is None else timebase.now() - self._silent_since

    async def _check_broker(self) -> None:
        """The watchdog's turn (:func:`_watch_broker`): while results are awaited, ping the broker to notice a
        restart or a move."""
        interval_s = self.config.broker.heartbeat_interval_s
        if not (self._waiters or self._streams or (self._conn is not None and self._conn.waiting)):
            return  # nobody is waiting for a result or a reply
        asked_at = timebase.now()
        try:
            await self._call(_PING, timeout_s=max(1.0, interval_s * self.config.broker.heartbeat_liveness))
            if self._silent_since is not None:
                log.warning("the broker at %s answers again, after %.0f s", self.address,
                            timebase.now() - self._silent_since)
            self._silent_since = self._silence_said_at = None
        except (BrokerUnavailable, RemoteError):
            now = timebase.now()
            if self._silent_since is None:
                self._silent_since = asked_at  # silent since the unanswered ping went out
            if self._silence_said_at is None or now - self._silence_said_at >= SILENCE_REPEAT_S:
                # Whoever waits (a trainer, prorl submit) learns why nothing comes, not only at a timeout.
                self._silence_said_at = now
                # Results awaited wait on; a single request (a status, a scale) fails at its own timeout instead.
                waits = ("results wait for it to come back (prorl status tells what runs)"
                         if self._waiters or self._streams else "a request waits for its reply")
                log.warning("the broker at %s has not answered for %.0f s: %s", self.address,
                            now - self._silent_since, waits)
            # Down: it may come back here (the next ping sees its boot id) or at a new address.
            if self._conn is not None and self._conn.follow_moved():
                with contextlib.suppress(BrokerUnavailable, RemoteError):
                    await self._call(_PING)  # its reply brings the new boot id, which watches again

    async def _rewatch(self) -> None:
        while True:
            self._rewatch_again = False
            ids = [j for j in self._watched if j not in self._results]
            if ids:
                try:
                    watched: H.WatchReply = await self._ask(Op.WATCH, H.JobIds(H.NEW_RID, ids))
                except (BrokerUnavailable, RemoteError, ProtocolError, ClientClosed):
                    return  # the next new boot id tries again (closed: nobody waits any more)
                for job_id in watched.unknown:
                    if job_id not in self._watched:
                        continue  # forgotten meanwhile
                    # Without a journal the new broker never heard of it: say so rather than wait forever.
                    self._deliver(JobResult(
                        job_id=job_id, task=self._watched.get(job_id) or "?", state=P.JobState.FAILED.value,
                        critical_error="broker",
                        error={"stage": "broker", "type": "BrokerRestarted",
                               "message": "the broker restarted and does not know this job "
                                          "(its journal was off or lost, or removed by `prorl down`); submit it again"},
                    ))
            if not self._rewatch_again:
                return

    # ------------------------------------------------------------------ jobs

    def make_specs(
        self,
        task: str,
        count: int,
        *,
        job_ids: Sequence[str] | None = None,
        timeout_s: float | None = None,
        stage_timeouts_s: dict[str, float] | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
        max_attempts: int | None = None,
        group_id: str | None = None,
        meta: dict[str, Any] | None = None,
        seed_from: int | None = None,
    ) -> list[JobSpec]:
        """``count`` job specs for ``task`` (fresh uuids unless ``job_ids``); ``group_id``/``meta`` go on each.

        A seed in ``sampling`` goes to every job as given, unless ``seed_from`` is set: then job ``j`` is
        sampled with ``derive_seed(seed, seed_from + j)``, the seed of the run's ``seed_from + j``-th rollout
        (rollouts of one prompt with one seed would all be the same on an engine that honours it).
        Each is checked by the ``submit`` schema the broker applies, so a bad field raises
        :class:`RequestRefused` here (a ``ProtocolError`` and a ``BadRequest``), naming it, before anything is sent.
        """
        if job_ids is not None:
            ids = job_id_list(job_ids, "job_ids")
            if len(ids) != count:
                raise ValueError(f"{len(ids)} job ids for {count} instances")
        else:
            ids = [uuid.uuid4().hex for _ in range(count)]
        wire: dict[str, Any] = {"task": task, "max_attempts": self.config.jobs.max_attempts if max_attempts is None
                                else max_attempts}
        # Optional fields travel only when given, so a broker from before they existed still takes the jobs.
        for name, value in (("timeout_s", timeout_s), ("stage_timeouts_s", stage_timeouts_s), ("group_id", group_id),
                            ("meta", meta)):
            if value is not None:
                wire[name] = value
        if sampling is not None:
            wire["sampling"] = sampling.to_wire() if isinstance(sampling, SamplingParams) else sampling
        given = wire.get("sampling")
        seed = given.get("seed") if isinstance(given, Mapping) else None
        try:
            if seed_from is None or type(seed) is not int or not -BIG <= seed <= BIG or not isinstance(given, Mapping):
                # No seed to derive from (a bad one: the schema names it, as given).
                return [JobSpec.from_wire({**wire, "job_id": jid}, f"job {jid}") for jid in ids]
            return [JobSpec.from_wire({**wire, "job_id": jid, "sampling": {**given, "seed": derive_seed(seed, seed_from + j)}},
                                      f"job {jid}") for j, jid in enumerate(ids)]
        except ProtocolError as e:
            # What the broker would refuse as a BadRequest is refused as one here too: one except clause for both.
            raise RequestRefused(e.code, e.message) from None

    async def submit(
        self,
        task: str,
        instances: Iterable[Any],
        *,
        n: int = 1,
        job_ids: Sequence[str] | None = None,
        timeout_s: float | None = None,
        stage_timeouts_s: dict[str, float] | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
        max_attempts: int | None = None,
        group_id: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Submitted:
        """Submit each instance ``n`` times; return the job ids at once (results come later).

        The ``n`` jobs of one instance are one group (a GRPO group: ``samples_from_results`` computes their
        advantages against each other): without ``group_id``, each instance's jobs get the id of the first of
        them as their ``group_id``. A ``group_id`` given goes on every job of the submit, as given.

        A seed in ``sampling`` seeds the whole submission: the ``j``-th job (instance ``j // n``, its
        rollout ``j % n``) is sampled with ``derive_seed(seed, j)``, so an instance's rollouts differ and
        a rerun repeats them. Give each job its own sampling with :meth:`submit_specs`.

        Submitting a job id the broker already knows returns that job
        (idempotent): the returned list's ``.accepted`` and ``.existing`` say
        which ids were new and which the broker already had. A submit that
        fails (``BrokerRestarted``, a timeout) is sent again with the same ids:
        the error carries them as ``e.submitted`` (every id, in order, with
        ``accepted`` and ``existing`` for what the broker confirmed), so
        ``submit(..., job_ids=e.submitted)`` works where this call made them.
        A submit bigger than one broker message goes as several (a note on the
        error says how many the broker took); the jobs it took come back as
        ``existing``, never run twice.
        """
        if isinstance(instances, (str, bytes, bytearray, Mapping)):
            # Iterating one would submit its characters or keys, one job each.
            raise TypeError(f"instances: a sequence of instances, one per job, got one {type(instances).__name__}; "
                            "put a single instance in a list")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: the number of jobs per instance must be an int of at least 1, got {n!r}")
        insts = [inst for inst in instances for _ in range(n)]
        specs = self.make_specs(
            task, len(insts), job_ids=job_ids, timeout_s=timeout_s, stage_timeouts_s=stage_timeouts_s,
            sampling=sampling, max_attempts=max_attempts, group_id=group_id, meta=meta, seed_from=0,
        )
        if group_id is None and n > 1:
            # Left ungrouped, every rollout was its own group and every group-relative advantage 0. The group is
            # named after its first job's id, not a fresh uuid: the same ids sent again (a retry) make the same
            # groups, as `prorl submit`'s PREFIX-LINE groups do for its PREFIX-LINE-K ids.
            for j, spec in enumerate(specs):
                spec.group_id = specs[j - j % n].job_id
        return await self.submit_specs(specs, insts)

    async def submit_specs(self, specs: Sequence[JobSpec], instances: Sequence[Any]) -> Submitted:
        """Submit fully specified jobs (one instance each); see :meth:`submit`."""
        if len(specs) != len(instances):
            raise ValueError(f"{len(specs)} specs for {len(instances)} instances")
        frames = _packed_instances(specs, instances)
        limit = self.config.broker.max_message_bytes
        over = next(((k, len(f)) for k, f in enumerate(frames) if len(f) > limit - _FRAMING_BYTES), None)
        if over is not None:
            # The broker's socket would drop the connection (libzmq refuses the frame): no answer, only a timeout.
            raise RequestRefused(P.ErrorCode.BAD_FRAME.value,
                                 f"instance {over[0]} ({specs[over[0]].job_id!r}) packs to {over[1] / 2**20:.1f} MiB, "
                                 f"over broker.max_message_bytes ({limit / 2**20:.1f} MiB): send a path or an id "
                                 "the handler reads, not the data itself")
        # A submit goes as messages the broker takes (its payload frame under max_message_bytes, its header under
        # MAX_HEADER_BYTES); each is idempotent, so one that fails can be sent again whole, ids unchanged.
        chunks = _submit_chunks(specs, frames, limit)
        if len(chunks) == 1:
            try:
                return await self._submit_in(specs, frames, chunks)
            except HeaderTooLarge:
                # Sent whole on the first spec's size, but later specs are larger (each with its own long
                # stop_token_ids): the header was refused before it left, so nothing was taken. Size every spec.
                chunks = _submit_chunks(specs, frames, limit, guess=False)
        return await self._submit_in(specs, frames, chunks)

    async def _submit_in(self, specs: Sequence[JobSpec], frames: list[bytes], chunks: list[tuple[int, int]]) -> Submitted:
        """Send ``specs`` as the messages ``chunks`` cut them into, in order; a failure says what was taken."""
        accepted: list[str] = []
        existing: list[str] = []
        if len(chunks) > 1:
            _refuse_repeated_ids(specs)  # the broker sees one message at a time: a repeat across two goes unseen
        for sent, (first, end) in enumerate(chunks):
            try:
                reply = await self._submit_chunk(specs[first:end], frames[first:end])
            except (ProrlError, OSError) as e:
                # The error keeps its type (a retry loop catches what it always caught) and carries the ids: submit()
                # may have made them, and only the same ids send the submit again without running a job twice.
                e.submitted = Submitted([s.job_id for s in specs], accepted, existing)  # type: ignore[union-attr]
                if first:
                    e.add_note(f"the broker took {first} of this submit's {len(specs)} jobs (in {sent} of {len(chunks)} "
                               "messages): send it again with the same ids (e.submitted); the jobs it took come back "
                               "as existing, never run twice")
                raise
            accepted += reply.accepted
            existing += reply.existing
        return Submitted([s.job_id for s in specs], accepted, existing)

    async def _submit_chunk(self, specs: Sequence[JobSpec], frames: list[bytes]) -> H.SubmitReply:
        """One submit message; its jobs are watched once the broker took them."""
        # A result kept for a resubmitted id may be stale (a synthetic failure after a lost broker): drop it before
        # sending, so the answer to this submit (the broker pushes an existing job's result again) is taken in.
        kept = {s.job_id: r for s in specs if (r := self._results.pop(s.job_id, None)) is not None}
        try:
            header, _ = await self._call(H.Submit(H.NEW_RID, list(specs)).to_wire(), frames)
        except BaseException:
            for job_id, result in kept.items():
                self._results.setdefault(job_id, result)
            raise
        # Only what a broker confirmed is watched: after a restart the client never makes up a result for a job
        # it never saw accepted.
        for spec in specs:
            self._watched[spec.job_id] = spec.task
        # Read once the jobs are watched: a malformed reply (ProtocolError) still came from a broker that took them.
        reply: H.SubmitReply = P.parse_reply(Op.SUBMIT, header)
        return reply

    async def _watch(self, job_ids: Iterable[str]) -> None:
        todo = [j for j in dict.fromkeys(job_ids) if j not in self._watched and j not in self._results]
        if todo:
            watched: H.WatchReply = await self._ask(Op.WATCH, H.JobIds(H.NEW_RID, todo))
            unknown = set(watched.unknown)
            for j in todo:
                if j not in unknown:
                    self._watched.setdefault(j, "")
            if unknown:
                raise UnknownJob(P.ErrorCode.UNKNOWN_JOB.value, f"unknown job id(s): {sorted(unknown)}")

    async def result(self, job_id: str, timeout_s: float | None = None) -> JobResult:
        """Await one job's result."""
        self._check_open()
        if job_id in self._results:
            return self._results[job_id]
        self._check_loop()
        fut: asyncio.Future[JobResult] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, []).append(fut)
        try:
            await self._watch([job_id])
            try:
                async with asyncio.timeout(timeout_s):
                    return await fut
            except TimeoutError:
                silent_s = self.broker_silent_s()
                why = "" if silent_s is None else (
                    f"; the broker at {self.address} has not answered for {silent_s:.0f} s")
                raise ResultTimeout(f"no result for job {job_id!r} after {timeout_s:g} s{why} (prorl status tells "
                                    "where it is: a job of a task no node serves waits in the queue)") from None
        finally:
            if fut.done() and not fut.cancelled():
                fut.exception()  # seen: one close() failed while _watch() was still under way is not logged as lost
            waiters = self._waiters.get(job_id)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._waiters[job_id]

    async def process(self, task: str, instance: Any, timeout_s: float | None = None, **kwargs: Any) -> JobResult:
        """Submit one instance and await its result (the paper's blocking ``/process``).

        ``timeout_s`` is the job's own budget in its stages (as :meth:`submit`'s), not a bound on this wait: a
        job queued behind others waits its turn. To bound the wait, ``submit`` then ``result(id, timeout_s=)``.
        """
        (job_id,) = await self.submit(task, [instance], timeout_s=timeout_s, **kwargs)
        return await self.result(job_id)

    def results(self, job_ids: Iterable[str] | None = None, timeout_s: float | None = None) -> ResultStream:
        """A stream of results, each job's once, in completion order (``async for``).

        With ``job_ids``, it ends once they are all in; ``stream.add(ids)``
        adds more while it runs. Without, it yields every result this client
        receives from now on (every job it submits or watches), for streaming
        consumers that keep a window full with concurrent :meth:`submit` calls.
        Closing the client ends the stream: a consumer waiting on it gets :class:`ClientClosed`.
        """
        self._check_open()
        return ResultStream(self, job_ids, timeout_s)

    def as_completed(self, job_ids: Iterable[str], timeout_s: float | None = None) -> AsyncIterator[JobResult]:
        """Yield the results of ``job_ids`` as they finish, in completion order."""
        # Checked here, not in the generator: a bad argument raises at the call, not at the first iteration.
        self._check_open()
        return self._as_completed(job_id_list(job_ids, "job_ids"), timeout_s)

    async def _as_completed(self, job_ids: list[str], timeout_s: float | None) -> AsyncIterator[JobResult]:
        stream = ResultStream(self, job_ids, timeout_s)
        try:
            async for result in stream:
                yield result
        finally:
            await stream.aclose()

    async def wait(self, job_ids: Iterable[str], timeout_s: float | None = None) -> list[JobResult]:
        """Await all the given jobs; results in the order of ``job_ids``."""
        ids = job_id_list(job_ids, "job_ids")
        got = {r.job_id: r async for r in self.as_completed(ids, timeout_s)}
        return [got[j] for j in ids]

    async def cancel(self, job_ids: Iterable[str]) -> dict[str, str]:
        """Cancel jobs (queued or running); return each id's state after the cancel (``"unknown"`` for ids the
        broker does not know). The cancelled jobs' results come like any other."""
        ids = job_id_list(job_ids, "job_ids")
        reply: H.CancelReply = await self._ask(Op.CANCEL, H.JobIds(H.NEW_RID, ids))
        states = reply.states
        for job_id in states:
            self._watched.setdefault(job_id, "")  # the broker now pushes its result to us
        return {j: states.get(j, UNKNOWN) for j in ids}

    async def list_jobs(self, prefix: str | None = None, group_id: str | None = None) -> dict[str, str]:
        """Ids and states of the jobs the broker holds (unfinished, and finished ones it still retains) whose id
        starts with ``prefix`` and whose ``group_id`` is ``group_id`` (each only when given), in submission order."""
        found: dict[str, str] = {}
        after: int | None = 0
        while after is not None:
            page: H.JobPage = await self._ask(Op.LIST_JOBS, H.ListJobs(H.NEW_RID, prefix, group_id, after))
            found.update(page.jobs)
            # Only forward: a page that points back would loop for ever.
            after = page.next if page.next is not None and page.next > after else None
        return found

    async def forget(self, job_ids: Iterable[str]) -> ForgetOutcome:
        """Drop finished jobs' results at the broker and here (consumed results; keeps a long run's memory flat).

        Unfinished jobs are not forgotten (``running``); ids the broker does
        not know come back in ``unknown`` (and are dropped here too).
        """
        ids = list(dict.fromkeys(job_id_list(job_ids, "job_ids")))
        outcome: ForgetOutcome = await self._ask(Op.FORGET, H.JobIds(H.NEW_RID, ids))
        self.forget_local([*outcome.forgotten, *outcome.unknown])
        return outcome

    def forget_local(self, job_ids: Iterable[str]) -> None:
        """Drop only this client's copies of finished results (the broker keeps them for late watchers)."""
        dropped = job_id_list(job_ids, "job_ids")
        for job_id in dropped:
            self._results.pop(job_id, None)
            self._watched.pop(job_id, None)
        for stream in self._streams:
            stream._forget(dropped)

    # ------------------------------------------------------------- deployment

    async def status(self) -> StatusReport:
        reply: H.StatusReply = await self._ask(Op.STATUS, H.Request(H.NEW_RID))
        return reply.status

    async def ping(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Ask the broker for its address, deployment and boot id; :class:`BrokerUnavailable` if it does not answer."""
        header, _ = await self._call(_PING, timeout_s=timeout_s)
        return header

    async def add_backend(self, url: str, model: str | None = None) -> BackendStatus:
        """Register a plain HTTP OpenAI-compatible backend (the paper's add_llm_server)."""
        reply: H.BackendReply = await self._ask(Op.ADD_LLM_SERVER, H.AddLlmServer(H.NEW_RID, url, model or None))
        return reply.backend

    async def clear_backends(self, url: str | None = None) -> list[str]:
        """Stop routing new jobs to one backend, or to all; jobs already using them finish."""
        reply: H.ClearedReply = await self._ask(Op.CLEAR_LLM_SERVER, H.ClearLlmServer(H.NEW_RID, url or None))
        return reply.cleared

    async def list_backends(self) -> list[BackendStatus]:
        reply: H.BackendList = await self._ask(Op.LIST_LLM_SERVERS, H.Request(H.NEW_RID))
        return reply.backends

    async def pause_generation(
        self, policy_version: int | None = None, *, wait: bool = False, timeout_s: float = 300.0
    ) -> None:
        """Hold new generate calls at the broker (weight sync); in-flight ones drain.

        ``policy_version``: the version of the weights about to be loaded
        (the broker stamps it on every generate reply; see ``status``).
        ``wait``: return only once no generate call is in flight on any
        backend; after ``timeout_s`` raise :class:`DrainTimeout` naming the
        calls still running (generation stays paused either way). Calls held
        at the broker meanwhile do not count against their jobs' clocks.

        With ``wait``, the broker takes ``policy_version`` only once the
        drain is over: after :class:`DrainTimeout` (or a resume that cut the
        drain short) its version is still the old one, so calls released by
        a plain :meth:`resume_generation` (the step given up) carry the
        weights that serve them. To go on with the step anyway, the version
        moves with :meth:`update_weights` or ``resume_generation(version)``.
        """
        version = _checked_version(policy_version)
        if not wait:
            await self._call(H.PauseGeneration(H.NEW_RID, version).to_wire())
            return
        _check_drain_s(timeout_s)
        await self._call_keeping_fields(H.PauseGeneration(H.NEW_RID, version, float(timeout_s)), timeout_s)

    async def update_weights(
        self, checkpoint: str | os.PathLike[str], policy_version: int, *, timeout_s: float = 600.0
    ) -> WeightsUpdated:
        """Have every inference bridge load the weights in ``checkpoint`` in place, as ``policy_version``.

        Each bridge lets its calls in flight finish on the old weights (their
        results carry the old version), loads the checkpoint (a model
        directory every bridge can read), and serves the new version from
        then on; this returns once all have. For a clean switch, pause
        generation first (``wait=True``) and resume after. HTTP backends
        (``backends add``) cannot be reloaded: they are listed as skipped.
        With no bridge up it still succeeds, ``verified=False``: the broker
        keeps the checkpoint for the bridges that join later, untested.
        Raises :class:`ReloadFailed` naming the bridges that could not load
        it (restart those on the checkpoint; the engine's restart path), and
        :class:`CheckpointNotFound` before sending anything when ``checkpoint``
        is not there on this machine (the trainer wrote it; the bridges read it
        from a filesystem they share with it), and its
        :class:`CheckpointNotADirectory` when it is a file, not a model directory.
        """
        version = _checked_version(policy_version)
        if version is None:
            raise ValueError("update_weights needs a policy_version")
        _check_load_s(timeout_s)
        path = _checkpoint_path(checkpoint, "update_weights")
        header = await self._call_keeping_fields(H.UpdateWeights(H.NEW_RID, path, version, float(timeout_s)), timeout_s)
        reply: H.WeightsUpdateReply = P.parse_reply(Op.UPDATE_WEIGHTS, header)
        return WeightsUpdated(updated=reply.updated, skipped=reply.skipped,
                              policy_version=policy_version if reply.policy_version is None else reply.policy_version,
                              verified=bool(reply.updated) if reply.verified is None else reply.verified)

    @contextlib.asynccontextmanager
    async def generation_paused(
        self, policy_version: int, *, drain_timeout_s: float = 300.0
    ) -> AsyncIterator[None]:
        """A trainer's step boundary around a weight load of its own: no generate call runs inside the block.

        Pauses and waits until no call is in flight (:class:`DrainTimeout` after ``drain_timeout_s``, and
        generation resumed), runs the block, and resumes: under ``policy_version`` when the block succeeded,
        under the version served before when it raised (the error goes on). A failed load never leaves the
        deployment paused.
        """
        version = _checked_version(policy_version)
        if version is None:
            raise ValueError("generation_paused needs a policy_version")
        # Refused before the pause: a bad argument must neither pause the deployment nor resume one paused before.
        _check_drain_s(drain_timeout_s, "drain_timeout_s")
        try:
            await self.pause_generation(wait=True, timeout_s=drain_timeout_s)
        except BaseException:
            await self.resume_generation()
            raise
        try:
            yield
        except BaseException:
            await self.resume_generation()
            raise
        await self.resume_generation(version)

    async def sync_weights(
        self, checkpoint: str | os.PathLike[str], policy_version: int, *,
        drain_timeout_s: float = 300.0, timeout_s: float = 600.0,
    ) -> WeightsUpdated:
        """One step boundary: drain, have every bridge load ``checkpoint`` as ``policy_version``, resume.

        :meth:`update_weights` inside :meth:`generation_paused`: calls in flight finish on the old weights,
        none starts during the load, and generation resumes however the load ends.
        """
        _checkpoint_path(checkpoint, "sync_weights")  # bad arguments raise before the drain, not after it
        _check_load_s(timeout_s)
        async with self.generation_paused(policy_version, drain_timeout_s=drain_timeout_s):
            return await self.update_weights(checkpoint, policy_version, timeout_s=timeout_s)

    async def _call_keeping_fields(self, header: H.Header, wait_s: float) -> dict[str, Any]:
        """A request the broker answers late (after ``wait_s``); an error's extra fields stay on the exception."""
        await self.connect()
        assert self._conn is not None
        try:
            reply, _ = await self._conn.request(header.to_wire(), timeout_s=wait_s + self.request_timeout_s)
        except BrokerUnavailable as e:
            self._refuse_if_closed(e)
            raise
        if reply.get("ok"):
            return reply
        error = RemoteError.from_reply(reply)
        if isinstance(error, DrainTimeout) and isinstance(reply.get("running"), list):
            error.running = reply["running"]
        if isinstance(error, ReloadFailed) and isinstance(reply.get("failed"), dict):
            error.failed = reply["failed"]
        raise error

    async def resume_generation(self, policy_version: int | None = None) -> None:
        """Release held generate calls and route new ones again (``policy_version``: the weights now served)."""
        await self._call(H.ResumeGeneration(H.NEW_RID, _checked_version(policy_version)).to_wire())

    async def hold(self) -> None:
        """Stop placing queued jobs on nodes (running ones go on)."""
        await self._call(H.Request(H.NEW_RID).to_wire(Op.HOLD))

    async def start(self) -> None:
        """(Re)open job placement (the paper's /start)."""
        await self._call(H.Request(H.NEW_RID).to_wire(Op.START))

    async def stop(self) -> None:
        """Stop the deployment: cancel all jobs, shut nodes and bridges down, stop the broker."""
        await self._call(H.Request(H.NEW_RID).to_wire(Op.STOP))


def _checked_version(policy_version: int | None) -> int | None:
    if policy_version is None:
        return None
    if not isinstance(policy_version, int) or isinstance(policy_version, bool) or policy_version < 0:
        raise ValueError(f"policy_version must be a non-negative integer, got {policy_version!r}")
    return policy_version


def _check_drain_s(timeout_s: float, name: str = "timeout_s") -> None:
    if not (isinstance(timeout_s, int | float) and 0 <= timeout_s <= 1e6):
        raise ValueError(f"{name} must be a number of seconds in [0, 1e6], got {timeout_s!r}")


def _checkpoint_path(checkpoint: str | os.PathLike[str], what: str) -> str:
    """``checkpoint`` as an absolute path, which must be a directory there: the trainer wrote it, and the bridges
    read it from a filesystem they share with it. With no bridge up to try a mistyped one, the broker would take it
    for the weights every bridge joining later must load."""
    path = os.path.abspath(os.fspath(checkpoint))
    if not os.path.exists(path):
        raise CheckpointNotFound(f"{what}: checkpoint {path} does not exist here; the bridges read it from a "
                                 "filesystem they share with this trainer")
    if not os.path.isdir(path):
        # Every engine loads a model directory (its config.json and weights): a file sent on would be refused by
        # each bridge, after the drain, as "not a model directory (no config.json)" even where it is config.json.
        raise CheckpointNotADirectory(f"{what}: checkpoint {path} is a file, not a model directory: give the "
                                      f"directory that holds config.json and the weights ({os.path.dirname(path)}?)")
    return path


def _check_load_s(timeout_s: float) -> None:
    if not (isinstance(timeout_s, int | float) and 0 < timeout_s <= 1e9):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


#: A ``ping``: the broker's address, deployment and boot id (also the client's liveness probe).
_PING = H.Request(H.NEW_RID).to_wire(Op.PING)
