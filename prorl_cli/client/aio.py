"""AsyncRolloutClient: the trainer's side of the broker, on asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from prorl_cli import protocol as P
from prorl_cli.config import ProrlConfig, load_config
from prorl_cli.exceptions import (
    BrokerRestarted,
    BrokerUnavailable,
    ProtocolError,
    RemoteError,
    RendezvousError,
)
from prorl_cli.protocol import BackendStatus, JobResult, JobSpec, Op, StatusReport
from prorl_cli.rendezvous import read_rendezvous
from prorl_cli.security import secure_peer

DEFAULT_REQUEST_TIMEOUT_S = 30.0


class AsyncRolloutClient:
    """Submit jobs, await or stream their results, cancel, inspect, manage backends.

    Find the broker by deployment (the rendezvous file under ``PRORL_HOME``)
    or give its ``address`` directly::

        async with AsyncRolloutClient("default") as client:
            ids = await client.submit("math", instances, n=8)
            async for result in client.as_completed(ids):
                ...
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
            self.config.deployment = deployment
        self.address = address
        #: Without an explicit address the client reads the rendezvous file, and reads it again if the broker goes away.
        self.follow_rendezvous = address is None
        self.request_timeout_s = request_timeout_s
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], list[bytes]]]] = {}
        self._results: dict[str, JobResult] = {}
        self._waiters: dict[str, list[asyncio.Future[JobResult]]] = {}
        self._streams: list[asyncio.Queue[JobResult]] = []
        self._watched: dict[str, str] = {}  # job id -> task ("" if only watched): the jobs whose results we want
        self._boot_id: str | None = None  # the broker's, as last seen
        self._watchdog: asyncio.Task[None] | None = None

    # -------------------------------------------------------------- plumbing

    async def __aenter__(self) -> AsyncRolloutClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the connection (done on first use anyway)."""
        if self._sock is not None:
            return
        if self.address is None:
            self.address = read_rendezvous(self.config.deployment_dir).address
        self._open()
        self._watchdog = asyncio.create_task(self._watch_broker(), name="prorl-client-watchdog")

    def _open(self) -> None:
        assert self.address is not None
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        secure_peer(sock, self.config.deployment_dir)
        sock.connect(self.address)
        self._sock = sock
        self._reader = asyncio.create_task(self._read(), name="prorl-client-reader")

    async def _follow_moved_broker(self) -> None:
        """The broker does not answer: if the rendezvous file names a new address, connect there and watch again."""
        if not self.follow_rendezvous:
            return
        try:
            address = read_rendezvous(self.config.deployment_dir).address
        except RendezvousError:
            return
        if address == self.address or self._sock is None:
            return
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(BrokerRestarted(f"the broker at {self.address} is gone; this request went with it"))
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._sock.close(0)
        self.address = address
        self._open()
        await self._rewatch()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        if self._reader is not None:
            self._reader.cancel()
            # The reader ends by cancellation; anything else it raised is a bug worth seeing.
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                header = P.decode_header(frames[0])
            except ProtocolError:
                continue  # the broker never sends garbage; ignore rather than die
            if header["op"] == Op.REPLY:
                fut = self._pending.get(header.get("rid"))  # type: ignore[arg-type]
                if fut is not None and not fut.done():
                    fut.set_result((header, frames[1:]))
            elif header["op"] == Op.RESULT:
                for frame in frames[1:]:
                    try:
                        result = JobResult.from_wire(P.unpack_obj(frame))
                    except ProtocolError:
                        continue
                    self._deliver(result)

    def _deliver(self, result: JobResult) -> None:
        self._results[result.job_id] = result
        for fut in self._waiters.pop(result.job_id, []):
            if not fut.done():
                fut.set_result(result)
        for q in self._streams:
            q.put_nowait(result)

    async def request(
        self, op: Op, payload: Sequence[bytes] = (), timeout_s: float | None = None, **fields: Any
    ) -> tuple[dict[str, Any], list[bytes]]:
        """Send one request; return the reply. Raise :class:`RemoteError` on an error reply."""
        await self.connect()
        assert self._sock is not None
        rid = next(self._rids)
        fut: asyncio.Future[tuple[dict[str, Any], list[bytes]]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        try:
            await self._sock.send_multipart(P.encode({"op": op.value, "rid": rid, **fields}, payload), copy=False)
            header, frames = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError as e:
            raise BrokerUnavailable(f"no reply to {op.value!r} from the broker at {self.address} within {timeout_s} s") from e
        finally:
            self._pending.pop(rid, None)
        if not header.get("ok"):
            err = header.get("error") or {}
            raise RemoteError(str(err.get("code", "error")), str(err.get("message", header)))
        if "boot_id" in header:
            self._note_boot(str(header["boot_id"]))
        return header, frames

    # --------------------------------------------------------- broker restarts

    def _outstanding(self) -> list[str]:
        return [j for j in self._watched if j not in self._results]

    def _note_boot(self, boot_id: str) -> None:
        """A broker that restarted knows no watchers (and, without its journal, no jobs): watch again."""
        if self._boot_id is None:
            self._boot_id = boot_id
        elif boot_id != self._boot_id:
            self._boot_id = boot_id
            asyncio.ensure_future(self._rewatch())

    async def _watch_broker(self) -> None:
        """While results are awaited, ping the broker now and then to notice a restart."""
        interval_s = self.config.broker.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval_s)
            if not (self._waiters or self._streams):
                continue  # nobody is waiting for a result
            try:
                await self.request(Op.PING, timeout_s=max(1.0, interval_s * self.config.broker.heartbeat_liveness))
            except (BrokerUnavailable, RemoteError):
                await self._follow_moved_broker()  # down: it may come back, here or at a new address

    async def _rewatch(self) -> None:
        ids = self._outstanding()
        if not ids:
            return
        try:
            header, _ = await self.request(Op.WATCH, job_ids=ids)
        except (BrokerUnavailable, RemoteError):
            return  # the next ping that answers tries again
        for job_id in header.get("unknown") or []:
            # Without a journal the new broker never heard of it: say so rather than wait forever.
            self._deliver(JobResult(
                job_id=job_id, task=self._watched.get(job_id) or "?", state=P.JobState.FAILED.value, critical_error="broker",
                error={"stage": "broker", "type": "BrokerRestarted",
                       "message": "the broker restarted and does not know this job (its journal was off or lost); submit it again"},
            ))

    # ------------------------------------------------------------------ jobs

    def make_specs(
        self,
        task: str,
        count: int,
        *,
        job_ids: Sequence[str] | None = None,
        timeout_s: float | None = None,
        stage_timeouts_s: dict[str, float] | None = None,
        sampling: dict[str, Any] | None = None,
        max_attempts: int | None = None,
    ) -> list[JobSpec]:
        if job_ids is not None and len(job_ids) != count:
            raise ValueError(f"{len(job_ids)} job ids for {count} instances")
        ids = list(job_ids) if job_ids is not None else [uuid.uuid4().hex for _ in range(count)]
        return [
            JobSpec(
                job_id=jid,
                task=task,
                timeout_s=timeout_s,
                stage_timeouts_s=stage_timeouts_s,
                sampling=sampling,
                max_attempts=max_attempts or self.config.jobs.max_attempts,
            )
            for jid in ids
        ]

    async def submit(
        self,
        task: str,
        instances: Iterable[Any],
        *,
        n: int = 1,
        job_ids: Sequence[str] | None = None,
        timeout_s: float | None = None,
        stage_timeouts_s: dict[str, float] | None = None,
        sampling: dict[str, Any] | None = None,
        max_attempts: int | None = None,
    ) -> list[str]:
        """Submit each instance ``n`` times; return the job ids at once (results come later).

        Submitting a job id the broker already knows returns that job (idempotent).
        """
        insts = [inst for inst in instances for _ in range(n)]
        specs = self.make_specs(
            task, len(insts), job_ids=job_ids, timeout_s=timeout_s,
            stage_timeouts_s=stage_timeouts_s, sampling=sampling, max_attempts=max_attempts,
        )
        return await self.submit_specs(specs, insts)

    async def submit_specs(self, specs: Sequence[JobSpec], instances: Sequence[Any]) -> list[str]:
        """Submit fully specified jobs (one instance each)."""
        if len(specs) != len(instances):
            raise ValueError(f"{len(specs)} specs for {len(instances)} instances")
        for spec in specs:
            self._watched[spec.job_id] = spec.task
        await self.request(
            Op.SUBMIT, [P.pack_obj(i) for i in instances], jobs=[s.to_wire() for s in specs]
        )
        return [s.job_id for s in specs]

    async def _watch(self, job_ids: Iterable[str]) -> None:
        todo = [j for j in job_ids if j not in self._watched and j not in self._results]
        if todo:
            header, _ = await self.request(Op.WATCH, job_ids=todo)
            if header.get("unknown"):
                raise RemoteError(P.ErrorCode.UNKNOWN_JOB.value, f"unknown job id(s): {header['unknown']}")
            for j in todo:
                self._watched.setdefault(j, "")

    async def result(self, job_id: str, timeout_s: float | None = None) -> JobResult:
        """Await one job's result."""
        if job_id in self._results:
            return self._results[job_id]
        fut: asyncio.Future[JobResult] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, []).append(fut)
        await self._watch([job_id])
        return await asyncio.wait_for(fut, timeout_s)

    async def process(self, task: str, instance: Any, timeout_s: float | None = None, **kwargs: Any) -> JobResult:
        """Submit one instance and await its result (the paper's blocking ``/process``)."""
        (job_id,) = await self.submit(task, [instance], timeout_s=timeout_s, **kwargs)
        return await self.result(job_id)

    async def as_completed(self, job_ids: Iterable[str], timeout_s: float | None = None) -> AsyncIterator[JobResult]:
        """Yield results as they finish, in completion order."""
        wanted = set(job_ids)
        queue: asyncio.Queue[JobResult] = asyncio.Queue()
        self._streams.append(queue)
        try:
            for jid in list(wanted):
                if jid in self._results:
                    wanted.discard(jid)
                    yield self._results[jid]
            await self._watch(wanted)
            deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
            while wanted:
                remaining = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
                result = await asyncio.wait_for(queue.get(), remaining)
                if result.job_id in wanted:
                    wanted.discard(result.job_id)
                    yield result
        finally:
            self._streams.remove(queue)

    async def results(self) -> AsyncIterator[JobResult]:
        """Every result this client receives from now on, as it arrives (for streaming consumers).

        Jobs this client submitted, or watches, are pushed to it; pair this
        with :meth:`submit` calls made concurrently to keep a window full.
        """
        queue: asyncio.Queue[JobResult] = asyncio.Queue()
        self._streams.append(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._streams.remove(queue)

    async def wait(self, job_ids: Iterable[str], timeout_s: float | None = None) -> list[JobResult]:
        """Await all the given jobs; results in the order of ``job_ids``."""
        ids = list(job_ids)
        got = {r.job_id: r async for r in self.as_completed(ids, timeout_s)}
        return [got[j] for j in ids]

    async def cancel(self, job_ids: Iterable[str]) -> dict[str, str]:
        """Cancel jobs (queued or running); return each job's state after the cancel."""
        ids = list(job_ids)
        for j in ids:
            self._watched.setdefault(j, "")
        header, _ = await self.request(Op.CANCEL, job_ids=ids)
        if header.get("unknown"):
            raise RemoteError(P.ErrorCode.UNKNOWN_JOB.value, f"unknown job id(s): {header['unknown']}")
        return dict(header["states"])

    def forget(self, job_ids: Iterable[str]) -> None:
        """Drop locally kept results (they stay at the broker for late watchers)."""
        for j in job_ids:
            self._results.pop(j, None)

    # ------------------------------------------------------------- deployment

    async def status(self) -> StatusReport:
        header, _ = await self.request(Op.STATUS)
        return StatusReport.from_wire(header["status"])

    async def ping(self, timeout_s: float | None = None) -> dict[str, Any]:
        header, _ = await self.request(Op.PING, timeout_s=timeout_s)
        return header

    async def add_backend(self, url: str, model: str | None = None) -> BackendStatus:
        """Register a plain HTTP OpenAI-compatible backend (the paper's add_llm_server)."""
        fields: dict[str, Any] = {"url": url}
        if model:
            fields["model"] = model
        header, _ = await self.request(Op.ADD_LLM_SERVER, **fields)
        return BackendStatus.from_wire(header["backend"])

    async def clear_backends(self, url: str | None = None) -> list[str]:
        """Stop routing new jobs to one backend, or to all; jobs already using them finish."""
        fields: dict[str, Any] = {"url": url} if url else {}
        header, _ = await self.request(Op.CLEAR_LLM_SERVER, **fields)
        return list(header["cleared"])

    async def list_backends(self) -> list[BackendStatus]:
        header, _ = await self.request(Op.LIST_LLM_SERVERS)
        return [BackendStatus.from_wire(b) for b in header["backends"]]

    async def pause_generation(self) -> None:
        """Hold new generate calls at the broker (weight sync); in-flight ones drain."""
        await self.request(Op.PAUSE_GENERATION)

    async def resume_generation(self) -> None:
        await self.request(Op.RESUME_GENERATION)

    async def hold(self) -> None:
        """Stop placing queued jobs on nodes (running ones go on)."""
        await self.request(Op.HOLD)

    async def start(self) -> None:
        """(Re)open job placement (the paper's /start)."""
        await self.request(Op.START)

    async def stop(self) -> None:
        """Stop the deployment: cancel all jobs, shut nodes and bridges down, stop the broker."""
        await self.request(Op.STOP)


