"""What the client hands back: submitted ids, forget outcomes, and result streams that can grow."""

from __future__ import annotations

import asyncio
import reprlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prorl_cli.exceptions import ClientClosed, ResultTimeout, UnknownJob
from prorl_cli.protocol import JobResult

if TYPE_CHECKING:
    from prorl_cli.client.aio import AsyncRolloutClient


def job_id_list(job_ids: Iterable[str], name: str) -> list[str]:
    """``job_ids`` as a list; ``TypeError`` naming the parameter ``name`` when it is one id rather than a collection.

    A ``str`` (or ``bytes``) is itself iterable: taken as ids, it would act on each of its characters (cancel
    jobs ``"r"``, ``"o"``, ..., forget an unrelated job named ``"o"``) instead of on the one job meant.
    """
    if isinstance(job_ids, (str, bytes, bytearray)):
        raise TypeError(f"{name}: a list of job ids, got one {type(job_ids).__name__} ({reprlib.repr(job_ids)}); "
                        "put a single id in a list")
    return list(job_ids)


class Submitted(list[str]):
    """The ids of a submit, in order (a plain list), plus which the broker accepted new and which it already had.

    ``existing`` ids were submitted before (a resumed trainer, a carried-over
    group): the broker returned those jobs instead of running them again.
    """

    def __init__(self, job_ids: Iterable[str], accepted: Iterable[str] = (), existing: Iterable[str] = ()) -> None:
        super().__init__(job_ids)
        self.accepted: list[str] = list(accepted)
        self.existing: list[str] = list(existing)


class ResultStream:
    """Final results as they arrive, each job's once per stream, in completion order.

    With ids (``client.results(ids)``, ``client.as_completed(ids)``) the
    stream ends once every id's result was yielded; :meth:`add` extends it
    with more ids (top-up groups) while it runs. Without ids it never ends
    and yields every result the client receives (jobs it submitted or
    watches) from the moment it was made. Close it (``aclose``, or leave an
    ``async for``) to stop collecting: a closed stream yields nothing more
    (``StopAsyncIteration`` at once, a waiting consumer included).

    An id the broker does not know raises :class:`UnknownJob` (a ``KeyError``
    naming it) once, from the call that asks the broker to watch it; it is
    dropped from :attr:`pending` and the stream goes on with the other ids,
    whose results (received before or after) are still yielded.

    Closing the client ends a stream not closed before: nothing feeds it any more, so a consumer waiting on it,
    and every later call, gets :class:`ClientClosed` (not ``StopAsyncIteration``: its results did not all come).
    """

    def __init__(
        self,
        client: AsyncRolloutClient,
        job_ids: Iterable[str] | None,
        timeout_s: float | None = None,
    ) -> None:
        self._client = client
        #: ``None`` in it wakes a consumer waiting on it to watch ids :meth:`add` queued in ``_to_watch``.
        self._queue: asyncio.Queue[JobResult | None] = asyncio.Queue()
        #: ``None``: open-ended (every result); else the ids still to yield.
        self._wanted: set[str] | None = None if job_ids is None else set()
        self._seen: set[str] = set()
        self._to_watch: list[str] = []
        self._timeout_s = timeout_s
        self._deadline: float | None = None
        self._closed = False
        # Checked before the stream registers with the client: a refused argument leaves no stream behind.
        ids = None if job_ids is None else job_id_list(job_ids, "job_ids")
        client._streams.append(self)
        if ids is not None:
            self.add(ids)

    def add(self, job_ids: Iterable[str]) -> None:
        """Also yield these jobs' results (ones already yielded by this stream are not yielded again)."""
        if self._closed:
            raise ClientClosed("this result stream is closed: make a new one (client.results(ids))")
        self._check_client_open()
        ids = job_id_list(job_ids, "job_ids")
        to_watch = len(self._to_watch)
        for job_id in ids:
            if job_id in self._seen:
                continue
            if self._wanted is not None:
                self._wanted.add(job_id)
            cached = self._client._results.get(job_id)
            if cached is not None:
                self._queue.put_nowait(cached)
            else:
                self._to_watch.append(job_id)
        if len(self._to_watch) > to_watch:
            # A consumer already waiting on the queue would not watch these ids until some other result came.
            self._queue.put_nowait(None)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` ran (or the stream ended): it yields nothing more."""
        return self._closed

    @property
    def pending(self) -> set[str]:
        """Ids added and not yet yielded (empty for an open-ended stream)."""
        return set(self._wanted or ())

    def _client_closed(self) -> None:
        """The client closed: wake a consumer waiting on the queue, which then sees it (:meth:`_check_client_open`)."""
        self._queue.put_nowait(None)

    def _check_client_open(self) -> None:
        if self._client.closed:
            missing = "" if self._wanted is None else f" ({len(self._wanted)} result(s) still missing)"
            raise ClientClosed(f"the client of this result stream was closed{missing}: nothing more can come; the "
                               "jobs go on at the broker (a new client's results(ids) collects them)")

    def _offer(self, result: JobResult) -> None:
        """The client received ``result``."""
        if self._wanted is None or result.job_id in self._wanted:
            self._queue.put_nowait(result)

    def _forget(self, job_ids: Iterable[str]) -> None:
        self._seen.difference_update(job_ids)

    def ready(self) -> list[JobResult]:
        """The results already received and not yet yielded, without waiting (batching consumers)."""
        out = []
        while not self._queue.empty():
            result = self._take(self._queue.get_nowait())
            if result is not None:
                out.append(result)
        return out

    def __aiter__(self) -> ResultStream:
        return self

    async def __anext__(self) -> JobResult:
        result = await self.next_within(None)
        assert result is not None  # only a bounded wait ends without one
        return result

    async def next_within(self, wait_s: float | None) -> JobResult | None:
        """The next result, as ``async for`` yields it, waiting at most ``wait_s`` seconds for it (``None``: as
        long as the stream's own ``timeout_s`` allows); ``None`` when none came in that time, the stream going on.

        For a consumer with something to do meanwhile (a progress line to keep current while jobs run for
        minutes). ``StopAsyncIteration`` once every result was yielded, :class:`ResultTimeout` past ``timeout_s``.
        """
        loop = asyncio.get_running_loop()
        self._client._check_loop()
        if self._deadline is None and self._timeout_s is not None:
            self._deadline = loop.time() + self._timeout_s
        # The stream's deadline stays the one that raises; this wait's own end only returns None.
        wait_until = None if wait_s is None else loop.time() + max(wait_s, 0.0)
        until = self._deadline if wait_until is None else wait_until if self._deadline is None else min(
            wait_until, self._deadline)
        while True:
            if self._closed:
                # Like a closed generator: nobody feeds a closed stream's queue, so waiting on it would never end.
                raise StopAsyncIteration
            # Nor a stream whose client closed; its consumer must not take that for "every result came".
            self._check_client_open()
            if self._to_watch:
                todo, self._to_watch = self._to_watch, []
                try:
                    await self._client._watch(todo)
                except UnknownJob:
                    # The broker watched the ids it knows; one it does not know never gets a result. Reported
                    # once (this error names it) and dropped, rather than asked for again on every call: the
                    # other ids' results, received already or still to come, are yielded as before.
                    unknown = {j for j in todo if j not in self._client._watched and j not in self._client._results}
                    if self._wanted is not None:
                        self._wanted.difference_update(unknown)
                    raise
                except BaseException:
                    # Not watched (a broker down, an interrupt): the next call asks again, rather than wait for ever.
                    self._to_watch[:0] = todo
                    raise
            while not self._queue.empty():
                result = self._take(self._queue.get_nowait())
                if result is not None:
                    return result
            if self._wanted is not None and not self._wanted:
                await self.aclose()
                raise StopAsyncIteration
            try:
                async with asyncio.timeout_at(until):
                    got = await self._queue.get()
            except TimeoutError:
                if wait_until is not None and (self._deadline is None or wait_until < self._deadline):
                    return None
                silent_s = self._client.broker_silent_s()
                why = "" if silent_s is None else (
                    f"; the broker at {self._client.address} has not answered for {silent_s:.0f} s (down, or "
                    "moved without a rendezvous file to follow: prorl status tells)")
                raise ResultTimeout(
                    f"{len(self._wanted or ())} result(s) still missing after {self._timeout_s:g} s{why}"
                ) from None
            result = self._take(got)
            if result is not None:
                return result

    def _take(self, result: JobResult | None) -> JobResult | None:
        """``result`` if this stream still owes it, else ``None`` (a duplicate, not asked for, or a wake-up)."""
        if result is None or result.job_id in self._seen:
            return None
        if self._wanted is not None:
            if result.job_id not in self._wanted:
                return None
            self._wanted.discard(result.job_id)
        self._seen.add(result.job_id)
        return result

    async def aclose(self) -> None:
        """Stop collecting results; a consumer waiting for the next one gets ``StopAsyncIteration``."""
        self._closed = True
        self._queue.put_nowait(None)  # wakes a consumer waiting on the queue, which then sees the stream closed
        if self in self._client._streams:
            self._client._streams.remove(self)
