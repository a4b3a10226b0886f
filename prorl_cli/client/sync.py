"""RolloutClient: the blocking face of :class:`AsyncRolloutClient`.

It drives the async client on a private event loop (no thread): each call
runs the loop until that call is done, so replies and results that arrive
meanwhile are taken in as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import warnings
import weakref
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import zmq

from prorl_cli.client.aio import AsyncRolloutClient, WeightsUpdated, checked_timeout
from prorl_cli.client.results import ResultStream, Submitted, job_id_list
from prorl_cli.connection import Reply
from prorl_cli.exceptions import ClientClosed, ClientMisuse, ProrlError
from prorl_cli.protocol import BackendStatus, ForgetOutcome, JobResult, JobSpec, Op, StatusReport

T = TypeVar("T")

log = logging.getLogger(__name__)


def _new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop, built whole: Ctrl-C and SIGTERM that come while its parts are made are handled after.

    A KeyboardInterrupt between them leaves a half-built loop whose finalizer prints an error at exit. Held in
    Python's handlers (which run in the main thread, whichever thread the signal reached), each comes, through
    the handler that was in place, as soon as the loop is whole; the loop is closed if one raises.
    """
    if threading.current_thread() is not threading.main_thread():
        return asyncio.new_event_loop()  # signal handlers run in the main thread only: none can interrupt here
    held: list[int] = []
    # A handler set outside Python (getsignal gives None) cannot be put back: that signal is left alone.
    before = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
              for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not None}
    try:
        loop = asyncio.new_event_loop()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    try:
        for signum in held:
            handler = before[signal.Signals(signum)]
            if callable(handler):
                handler(signum, None)  # Python's default for SIGINT raises KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)  # its default action, now that the default is back
    except BaseException:
        loop.close()
        raise
    return loop


def _end_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Whatever is still pending on the loop (an interrupted stream's read, say) ends, then the loop closes."""
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in left:
        task.cancel()
    if left:
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    loop.close()


#: What the ResourceWarning of a RolloutClient collected unclosed tells to do.
_CLOSE_HINT = "use `with RolloutClient(...) as client:` or call client.close()"


def _close(loop: asyncio.AbstractEventLoop, aio: AsyncRolloutClient, pid: int) -> None:
    """A client's close without the client (its finalizer holds no reference to it)."""
    if loop.is_closed() or loop.is_running() or os.getpid() != pid:
        return  # in use, or a fork's copy (its sockets are the parent's)
    # Collected while the program runs (a client made per step and dropped), not closed at its exit (a one-line
    # script, which may rely on that): said as an unclosed file is, once, though the close below releases all.
    address = aio.address  # gone once closed
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    try:
        if running is not None:
            # Collected while another loop runs in this thread (asyncio code dropped it), where this client's loop
            # cannot run: nobody else can reach that loop any more, so a thread of its own runs the close. It is
            # started from that running loop's next turn, not from here: a collection can run this in the middle
            # of threading's own bookkeeping, whose locks a thread start takes.
            running.call_soon_threadsafe(_close_in_thread, loop, aio)
        else:
            _close_now(loop, aio)
    finally:
        # Said after the close (under -W error the warning raises), and only while the program runs (a client
        # made per step and dropped), not at its exit (a one-line script, which may rely on the close there).
        if not getattr(weakref.finalize, "_shutdown", False):  # weakref sets it as it runs its finalizers at exit
            warnings.warn(f"unclosed RolloutClient (broker {address}): {_CLOSE_HINT}; it is closed now",
                          ResourceWarning, stacklevel=2)


def _close_in_thread(loop: asyncio.AbstractEventLoop, aio: AsyncRolloutClient) -> None:
    threading.Thread(target=_close_now, args=(loop, aio), name="prorl-client-close", daemon=True).start()


def _close_now(loop: asyncio.AbstractEventLoop, aio: AsyncRolloutClient) -> None:
    """Run ``aio.close()`` on the client's own ``loop`` (not running, nor reachable by anyone else), then close it."""
    try:
        loop.run_until_complete(aio.close())
    except (ProrlError, OSError, zmq.ZMQError) as e:  # the broker or the network already gone at exit
        log.debug("closing a client left open: %s", e)
    finally:
        _end_loop(loop)


class RolloutClient:
    """Blocking client. Same methods as :class:`AsyncRolloutClient`; use that one inside asyncio code."""

    def __init__(self, deployment: str | None = None, **kwargs: Any) -> None:
        self._pid = os.getpid()  # a fork's copy refuses (its ZeroMQ sockets are the parent's)
        self._loop = _new_loop()
        try:
            self._aio = self._run(self._make(deployment, kwargs))
        except BaseException:  # a bad config, no deployment, a Ctrl-C: the loop and its self-pipe go too
            _end_loop(self._loop)
            raise
        self._aio._close_hint = _CLOSE_HINT  # should the async client ever be the one found unclosed
        # A client never closed (a one-line script) is closed when it is collected or the interpreter exits,
        # instead of its loop's tasks being reported destroyed while pending.
        self._finalizer = weakref.finalize(self, _close, self._loop, self._aio, self._pid)

    @staticmethod
    async def _make(deployment: str | None, kwargs: dict[str, Any]) -> AsyncRolloutClient:
        return AsyncRolloutClient(deployment, **kwargs)

    def _run(self, coro: Any) -> Any:
        # A task kept in hand: a Ctrl-C cancels it and lets it unwind here, instead of leaving it pending
        # (to run at the next call, or to be reported as never awaited once the loop is closed).
        return self._run_to_end(self._task(coro), cancel=True)

    @staticmethod
    def _refuse_inside_a_loop(coro: Coroutine[Any, Any, Any]) -> None:
        """RuntimeError (``coro`` closed, never run) when called inside a running event loop: this would block it."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        coro.close()
        raise RuntimeError("RolloutClient blocks; inside a running event loop use AsyncRolloutClient")

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and the client's event loop (a fork's copy only lets go: the sockets are the parent's)."""
        if os.getpid() != self._pid:
            self._finalizer.detach()
            return
        if self._loop.is_running():  # another thread's call is under way on the loop: closing it there would break it
            # The waiting call cannot be woken from here (its loop is that thread's); say how it ends instead.
            raise ClientMisuse("this RolloutClient is in use by another thread: close it from that thread, once its "
                               "call returned (a wait there returns when its jobs end or its timeout_s passes; a "
                               "client of this thread can cancel those jobs)")
        self._finalizer.detach()
        if not self._loop.is_closed():
            try:
                self._run(self._aio.close())
            finally:
                _end_loop(self._loop)

    @property
    def address(self) -> str | None:
        return self._aio.address

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran: every request, wait and stream raises :class:`ClientClosed` from then on."""
        return self._loop.is_closed()

    def _check_open(self) -> None:
        """:class:`ClientClosed` once :meth:`close` ran (its loop is closed with it)."""
        if self._loop.is_closed():
            raise ClientClosed("this RolloutClient is closed; make a new one")

    @property
    def request_timeout_s(self) -> float:
        """How long a request waits for the broker's reply (the same setting as the async client's)."""
        return self._aio.request_timeout_s

    @request_timeout_s.setter
    def request_timeout_s(self, value: float) -> None:
        self._aio.request_timeout_s = checked_timeout(value)

    def broker_silent_s(self) -> float | None:
        """Seconds the broker has left the client's pings unanswered while results were awaited, else None."""
        return self._aio.broker_silent_s()

    def connect(self) -> None:
        """Open the connection (done on first use anyway)."""
        self._run(self._aio.connect())

    def request(self, op: Op, payload: Sequence[bytes] = (), timeout_s: float | None = None, **fields: Any) -> Reply:
        """One raw request (see :meth:`AsyncRolloutClient.request`)."""
        return self._run(self._aio.request(op, payload, timeout_s, **fields))

    def make_specs(self, task: str, count: int, **kwargs: Any) -> list[JobSpec]:
        return self._aio.make_specs(task, count, **kwargs)

    def submit(self, task: str, instances: Iterable[Any], **kwargs: Any) -> Submitted:
        return self._run(self._aio.submit(task, instances, **kwargs))

    def submit_specs(self, specs: Sequence[JobSpec], instances: Sequence[Any]) -> Submitted:
        return self._run(self._aio.submit_specs(specs, instances))

    def result(self, job_id: str, timeout_s: float | None = None) -> JobResult:
        return self._run(self._aio.result(job_id, timeout_s))

    def process(self, task: str, instance: Any, **kwargs: Any) -> JobResult:
        return self._run(self._aio.process(task, instance, **kwargs))

    def results(self, job_ids: Iterable[str] | None = None, timeout_s: float | None = None) -> SyncResultStream:
        """See :meth:`AsyncRolloutClient.results`: a stream of results that ``add(ids)`` extends."""
        self._check_open()  # said as every other call says it, not as the async client inside would
        return SyncResultStream(self, self._aio.results(job_ids, timeout_s))

    def as_completed(self, job_ids: Iterable[str], timeout_s: float | None = None) -> Iterator[JobResult]:
        # Checked here, not in the generator: a bad argument (or a closed client) raises at the call, not at the
        # first next().
        self._check_open()
        return self._as_completed(job_id_list(job_ids, "job_ids"), timeout_s)

    def _as_completed(self, job_ids: list[str], timeout_s: float | None) -> Iterator[JobResult]:
        with self.results(job_ids, timeout_s) as stream:
            yield from stream

    def wait(self, job_ids: Iterable[str], timeout_s: float | None = None) -> list[JobResult]:
        return list(self._run(self._aio.wait(job_ids, timeout_s)))

    def cancel(self, job_ids: Iterable[str]) -> dict[str, str]:
        return dict(self._run(self._aio.cancel(job_ids)))

    def list_jobs(self, prefix: str | None = None, group_id: str | None = None) -> dict[str, str]:
        return dict(self._run(self._aio.list_jobs(prefix, group_id)))

    def forget(self, job_ids: Iterable[str]) -> ForgetOutcome:
        return self._run(self._aio.forget(job_ids))

    def forget_local(self, job_ids: Iterable[str]) -> None:
        self._aio.forget_local(job_ids)

    def status(self) -> StatusReport:
        return self._run(self._aio.status())

    def ping(self, timeout_s: float | None = None) -> dict[str, Any]:
        return dict(self._run(self._aio.ping(timeout_s)))

    def add_backend(self, url: str, model: str | None = None) -> BackendStatus:
        return self._run(self._aio.add_backend(url, model))

    def clear_backends(self, url: str | None = None) -> list[str]:
        return list(self._run(self._aio.clear_backends(url)))

    def list_backends(self) -> list[BackendStatus]:
        return list(self._run(self._aio.list_backends()))

    def pause_generation(self, policy_version: int | None = None, *, wait: bool = False, timeout_s: float = 300.0) -> None:
        self._run(self._aio.pause_generation(policy_version, wait=wait, timeout_s=timeout_s))

    def update_weights(self, checkpoint: str | os.PathLike[str], policy_version: int, *,
                       timeout_s: float = 600.0) -> WeightsUpdated:
        return self._run(self._aio.update_weights(checkpoint, policy_version, timeout_s=timeout_s))

    def resume_generation(self, policy_version: int | None = None) -> None:
        self._run(self._aio.resume_generation(policy_version))

    @contextlib.contextmanager
    def generation_paused(self, policy_version: int, *, drain_timeout_s: float = 300.0) -> Iterator[None]:
        """See :meth:`AsyncRolloutClient.generation_paused`: no generate call runs inside the block.

        A Ctrl-C while it pauses or drains cancels the pause and resumes generation (a pause that never went
        out is neither sent later nor resumed); one while it resumes lets the resume finish first.
        """
        paused = self._aio.generation_paused(policy_version, drain_timeout_s=drain_timeout_s)
        enter = self._task(paused.__aenter__())
        try:
            self._run_to_end(enter, cancel=True)
        except BaseException as e:
            if enter.done() and not enter.cancelled() and enter.exception() is None:
                # Paused, and the interrupt came just after: the block never runs, so release the pause now.
                self._run_to_end(self._task(paused.__aexit__(type(e), e, e.__traceback__)), cancel=False)
            raise
        try:
            yield
        except BaseException as e:
            if not self._run_to_end(self._task(paused.__aexit__(type(e), e, e.__traceback__)), cancel=False):
                raise
        else:
            self._run_to_end(self._task(paused.__aexit__(None, None, None)), cancel=False)

    def _task(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """``coro`` as a task of this client's loop, not started yet: an interrupt leaves it in hand."""
        self._refuse_inside_a_loop(coro)
        if self._loop.is_closed():
            coro.close()  # never to run: no "never awaited" warning
            raise ClientClosed("this RolloutClient is closed; make a new one")
        if os.getpid() != self._pid:
            coro.close()
            # The ZeroMQ context and sockets a fork copied are unusable in the child: a call would hang for ever.
            raise ClientMisuse(f"this RolloutClient was made in process {self._pid}, before a fork: make a new one in "
                               f"this process ({os.getpid()})")
        if self._loop.is_running():
            coro.close()
            raise ClientMisuse("this RolloutClient is in use by another thread: a client serves one thread at a time "
                               "(make one per thread, or use AsyncRolloutClient for concurrent calls)")
        return self._loop.create_task(coro)

    def _run_to_end(self, task: asyncio.Task[T], *, cancel: bool) -> T:
        """:meth:`_run` for a :meth:`_task`, but an interrupt (Ctrl-C raises KeyboardInterrupt out of the loop)
        does not leave it halfway, to go on at the next call or never: it is cancelled (``cancel``) or not, and run
        to its end before the interrupt goes on. A second interrupt meanwhile goes on at once."""
        try:
            return self._loop.run_until_complete(task)
        except BaseException:
            if task.done():
                raise  # its own outcome (an interrupt inside it has been through its cleanup already)
            if cancel:
                task.cancel()
            try:
                self._loop.run_until_complete(task)
            except asyncio.CancelledError:
                pass  # the cancel asked for above, once its cleanup ran
            except (ProrlError, zmq.ZMQError) as cleanup_error:
                log.error("after the interrupt, %s could not finish its cleanup (after generation_paused or "
                          "sync_weights, generation may stay paused: resume it with resume_generation): %s",
                          task.get_coro(), cleanup_error)
            raise

    def sync_weights(self, checkpoint: str | os.PathLike[str], policy_version: int, *,
                     drain_timeout_s: float = 300.0, timeout_s: float = 600.0) -> WeightsUpdated:
        """See :meth:`AsyncRolloutClient.sync_weights`: drain, load everywhere, resume (a Ctrl-C cancels the step, as
        in :meth:`generation_paused`)."""
        return self._run_to_end(self._task(self._aio.sync_weights(checkpoint, policy_version,
                                                                  drain_timeout_s=drain_timeout_s, timeout_s=timeout_s)),
                                cancel=True)

    def hold(self) -> None:
        self._run(self._aio.hold())

    def start(self) -> None:
        self._run(self._aio.start())

    def stop(self) -> None:
        self._run(self._aio.stop())


class SyncResultStream:
    """The blocking face of :class:`ResultStream`: iterate it, ``add(ids)`` to it, close it (or use ``with``)."""

    def __init__(self, client: RolloutClient, stream: ResultStream) -> None:
        self._client = client
        self._stream = stream

    def add(self, job_ids: Iterable[str]) -> None:
        self._stream.add(job_ids)

    @property
    def pending(self) -> set[str]:
        return self._stream.pending

    def ready(self) -> list[JobResult]:
        """The results already received and not yet yielded, without waiting (batching consumers)."""
        return self._stream.ready()

    def __iter__(self) -> SyncResultStream:
        return self

    def __next__(self) -> JobResult:
        if self._stream.closed:
            raise StopIteration  # closed: nothing more comes (even once the client, and its loop, closed too)
        try:
            return self._client._run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def next_within(self, wait_s: float | None) -> JobResult | None:
        """The next result, waiting at most ``wait_s`` seconds (``None``: as ``next(stream)`` waits); ``None`` when
        none came in that time (the stream goes on). ``StopIteration`` once every result was yielded."""
        if self._stream.closed:
            raise StopIteration
        try:
            result: JobResult | None = self._client._run(self._stream.next_within(wait_s))
        except StopAsyncIteration:
            raise StopIteration from None
        return result

    def close(self) -> None:
        if not self._client._loop.is_closed():
            self._client._run(self._stream.aclose())

    def __enter__(self) -> SyncResultStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
