"""The broker's loop: one ZeroMQ ROUTER socket, one poll loop, no threads; and the client job ops.

Every message is checked against its op's schema (:mod:`prorl_cli.protocol`)
before any handler runs, then goes by one table lookup (``Broker.handlers``)
to its handler: the client job ops here (submit, watch, cancel, forget,
list_jobs, status, ping, start/hold/stop), the node ops to the members
(``broker/members.py``), generate calls, backends and weight sync to the
router (``broker/routing.py``). The job table (``broker/jobs.py``) decides;
what follows for peers is batched in the outbox (``broker/outbox.py``) and
sent at the turn's end, once the journal is durable. The socket itself and
the rendezvous file: ``broker/endpoint.py``.

Rules: bad input is answered with an error naming the op and field; it
never stops the loop. Nothing on the loop blocks for long: journal
compaction runs in a thread, and liveness is judged only once the inbox is drained.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
import uuid
from collections.abc import Callable
from typing import Any, cast

import zmq

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.broker.allocator import fix_mmap_threshold
from prorl_cli.broker.endpoint import Endpoint, serve_metrics
from prorl_cli.broker.jobs import JobTable
from prorl_cli.broker.journal import JOURNAL_NAME, Journal
from prorl_cli.broker.members import Members
from prorl_cli.broker.outbox import Outbox
from prorl_cli.broker.routing import Router
from prorl_cli.broker.state import Job, Node, instance_digest
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import JournalWriteError, ProtocolError
from prorl_cli.observe.logs import OncePerPeer
from prorl_cli.observe.metrics import (
    DeploymentCollector,
    MetricSet,
    MetricsServer,
    gauges_from_status,
    jobs_by_task,
)
from prorl_cli.protocol import ErrorCode, JobSpec, Op
from prorl_cli.protocol import headers as H

log = logging.getLogger(__name__)

# How many messages one loop turn reads before flushing batched output.
_MAX_BATCH = 2000
# Plain ints: pyzmq's send_multipart builds a Flag enum (``zmq.SNDMORE | flags``) per frame, which
# cost as much as the send itself (benchmarks/broker_scale.py, docs/benchmarks.md).
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
# After the journal's disk refused a write, the next try waits this long (not one per message at full rate).
JOURNAL_RETRY_S = 1.0
# Frames at least this big go zero-copy; smaller ones are cheaper to copy (pyzmq's own threshold).
_ZERO_COPY_BYTES = 65536


def _other_work(known: Job, spec: JobSpec, instance: bytes | memoryview) -> str | None:
    """How a submitted job differs from the job its id already names (``None``: the same work)."""
    if known.spec.task != spec.task:
        return f"task {spec.task!r} (it ran {known.spec.task!r})"
    if known.spec.sampling != spec.sampling:
        return "other sampling"
    if known.instance_digest and known.instance_digest != instance_digest(bytes(instance)):
        return "another instance"
    return None


class Broker:
    """The deployment's broker. ``serve_forever()`` runs until ``stop`` (clean) or SIGTERM/SIGUSR2 (leave, journal kept)."""

    def __init__(self, config: ProrlConfig, ctx: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        """``ctx``: the ZeroMQ context to open the socket in (default: the process's shared one)."""
        # Before anything big is allocated (a journal replay holds results): big buffers then stay out of
        # the heap, so memory freed by retention goes back to the system (broker/allocator.py).
        fix_mmap_threshold()
        self.config = config
        bc = config.broker
        self.heartbeat_interval_s = bc.heartbeat_interval_s
        self.dead_after_s = bc.heartbeat_interval_s * bc.heartbeat_liveness
        self.ctx: zmq.Context[zmq.Socket[bytes]] = ctx if ctx is not None else zmq.Context.instance()
        self.endpoint = Endpoint(self.ctx, config)
        self.sock, self.address, self.curve_public_key = self.endpoint.sock, self.endpoint.address, self.endpoint.curve_public_key
        self.started_at = timebase.now()

        #: Changes each time a broker starts: clients that see it change watch their jobs again.
        self.boot_id = uuid.uuid4().hex
        self.journal: Journal | None = None
        #: Prometheus figures: the broker's own, and every peer's from its heartbeats (served when metrics_port is set).
        self.metrics = MetricSet()
        self.collector = DeploymentCollector(self.metrics)
        self.metrics_server: MetricsServer | None = None
        self.outbox = Outbox(self._send, self.collector)
        self.router = Router(
            self._send, self._live_node, self._running_node,
            policy=bc.routing_policy, cancel_propagation=bc.cancel_propagation,
            kv_admission=bc.kv_admission, kv_admission_max_wait_s=bc.kv_admission_max_wait_s,
            heartbeat_interval_s=bc.heartbeat_interval_s, heartbeat_liveness=bc.heartbeat_liveness,
            register_reply_fields={"boot_id": self.boot_id},
            record_weights=lambda record: self._journal_append(record, durable=True),
        )
        self.table = JobTable(
            retention_count=bc.result_retention,
            retention_bytes=bc.result_retention_mb * 1024 * 1024,
            record=self._journal_append,
            on_end=self.outbox.job_finished,
            on_detach=self.router.job_ended,  # its generate calls are released (the routing seam)
            on_release=self.outbox.deliver,
            on_requeue=lambda job: self.metrics.inc("prorl_jobs_requeued", (job.spec.task,)),
            partial_grace_s=bc.cancel_result_grace_s,
        )
        # The job table's dicts, under the names the ops and the router's seams read.
        self.jobs: dict[str, Job] = self.table.jobs
        self.queue = self.table.queue
        self.nodes: dict[str, Node] = self.table.nodes
        self.members = Members(
            self.table, self._send, self.collector, self._journal_flush,
            heartbeat_interval_s=bc.heartbeat_interval_s, heartbeat_liveness=bc.heartbeat_liveness, boot_id=self.boot_id,
            bridge_heartbeat=self.router.bridge_heartbeat, bridges=self.router.backend_by_identity,
            bridge_unregister=self.router.unregister,
        )
        self.node_by_identity: dict[bytes, Node] = self.members.node_by_identity
        #: Every op the broker takes, to its handler: the client job ops here, the node ops (members), the router's.
        self.handlers: dict[Op, Callable[[bytes, Any, list[bytes]], None]] = {
            **self.router.handlers, **self.members.handlers,
            Op.SUBMIT: self.on_submit, Op.WATCH: self.on_watch, Op.CANCEL: self.on_cancel, Op.FORGET: self.on_forget,
            Op.STATUS: self.on_status, Op.LIST_JOBS: self.on_list_jobs, Op.PING: self.on_ping,
            Op.START: self.on_start, Op.HOLD: self.on_hold, Op.STOP: self.on_stop,
        }
        self.placing = True
        self.stopping = False
        self._leaving = False  # set by SIGTERM/SIGUSR2: exit without a clean stop
        self._stop_deadline: float | None = None
        self._next_tick = timebase.now()
        self._last_tick = timebase.now()
        # False while messages may be waiting unread: liveness is judged only on a drained inbox.
        self._drained = True
        self._next_gauges_at = 0.0
        self._rejects = OncePerPeer(log)
        #: Why the journal cannot be written now (None: it can); new jobs are refused meanwhile.
        self._journal_error: str | None = None
        self._journal_retry_at = 0.0
        if bc.journal:
            self.journal = Journal(
                config.deployment_dir / JOURNAL_NAME, fsync=bc.journal_fsync, compact_bytes=bc.journal_compact_mb * 1024 * 1024
            )
            self._replay()

    # ------------------------------------------------------------------ journal

    def _replay(self) -> None:
        assert self.journal is not None
        jobs = self.journal.replay().values()
        self.router.weights.restore(self.journal.weights)
        waiting = self.table.load_replayed(jobs, claim_window_s=2 * self.dead_after_s)
        if self.journal.damaged:
            # The compaction below keeps only what was read back: the damaged file stays beside it, for a person.
            try:
                kept = f"kept as {self.journal.keep_aside('damaged')}"
            except OSError as e:
                kept = f"could not be kept ({e}): the broker starts all the same, with what was read back"
            log.error("journal: %d damaged stretch(es) skipped; the file as it was %s", len(self.journal.damaged), kept)
        self.journal.rewrite(self.table.journal_snapshot(self.router.weights.journal_records()))
        if self.jobs:
            log.info("journal replayed: %d job(s), %d unfinished", len(self.jobs), sum(not j.state.terminal for j in self.jobs.values()))
        if waiting:
            # Only jobs a node may still be running wait; new and never-placed jobs are placed at once.
            log.info("%d placed job(s) wait %.1f s for their nodes to claim them", waiting, 2 * self.dead_after_s)

    def _journal_append(self, record: dict[str, Any], durable: bool = False) -> None:
        if self.journal is not None:
            self.journal.append(record)
            if durable:  # on disk now: its reply goes out before this turn's end (the weights record)
                self._journal_flush()

    def _journal_flush(self, probe: bool = False) -> bool:
        """Make what was journaled durable before anyone hears of it; compaction runs off the loop.

        False when the journal cannot be written (a full disk): said once, and the broker goes on (status,
        results, jobs already accepted) with the records kept in memory for the next flush; new jobs are
        refused until a flush succeeds again. After a refusal the disk is tried again at most every
        ``JOURNAL_RETRY_S``, except by a ``probe`` (a submit: its sender asks now, and hears the outcome).
        """
        if self.journal is None:
            return True
        if self._journal_error is not None and not probe and timebase.now() < self._journal_retry_at:
            return False  # a disk that just refused is tried again in a while, not at every message
        try:
            wrote = self.journal.flush()
        except JournalWriteError as e:
            if self._journal_error is None:
                log.error("%s: new jobs are refused until it can be written; what it must record waits in memory", e)
            self._journal_error = str(e)
            self._journal_retry_at = timebase.now() + JOURNAL_RETRY_S
            return False
        if self._journal_error is not None and wrote:  # only a write proves the disk takes records again
            log.warning("journal %s is written again; new jobs are accepted", self.journal.path)
            self._journal_error = None
        self.journal.poll()
        if self.journal.wants_compaction:
            self.journal.compact_in_background(self.table.journal_snapshot(self.router.weights.journal_records()))
        return True

    # ------------------------------------------------------------------ I/O

    def _send(self, identity: bytes, header: dict[str, Any], payload: list[bytes] | tuple[bytes, ...] = ()) -> bool:
        """Send to one peer; False (and the peer forgotten) if it is gone."""
        frames = P.encode(header, payload)
        send = self.sock.send
        try:
            # ROUTER_MANDATORY refuses an unknown peer at the identity frame: nothing partial is queued.
            send(identity, _SNDMORE_NOBLOCK)
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                send(frame, _NOBLOCK if i == last else _SNDMORE_NOBLOCK, copy=len(frame) < _ZERO_COPY_BYTES)
            return True
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                log.debug("peer %r unreachable: %s", identity, e)
                return False
            raise

    def _error(self, identity: bytes, rid: Any, code: ErrorCode, message: str) -> None:
        # Once per peer per minute in the log (a peer sending garbage in a loop must not flood it); all are counted.
        self.metrics.inc("prorl_rejected_frames", (code.value,))
        node = self.node_by_identity.get(identity)
        self._rejects.warn(identity, f"{identity.hex()}" + (f" (node {node.node_id})" if node else ""),
                           f"{code.value}: {message} (rid {rid!r})")
        self._send(identity, P.error_reply(rid, code, message))

    def serve_forever(self, leave_requested: threading.Event | None = None) -> None:
        """Run the loop until stopped. Writes the rendezvous file first, removes it last.

        ``leave_requested`` set by the time the broker's own signal handlers are in (a signal the
        caller's handler caught in the meantime): the broker leaves at once, as on that signal.
        """
        self.metrics_server = serve_metrics(self.collector, self.config.broker)
        if self.metrics_server is not None:
            self._refresh_gauges()
        self.endpoint.publish()
        # SIGTERM/SIGUSR2 (Slurm preemption, time limit, requeue): leave without cancelling
        # anything and keep the journal; the broker started next replays it. Only the
        # ``stop`` op is a clean stop.
        prev: dict[int, Any] = {}

        def on_signal(signum: int, frame: Any) -> None:
            self.leave()
            chained = prev.get(signum)
            if callable(chained):  # e.g. prorl's Slurm role wrapper, which requeues the job on SIGUSR2
                chained(signum, frame)

        prev.update({sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGUSR2)})
        if leave_requested is not None and leave_requested.is_set():
            self.leave()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stopped():
                timeout_ms = max(0, int((self._next_tick - timebase.now()) * 1000))
                if poller.poll(timeout_ms):
                    self._turn()
                if timebase.now() >= self._next_tick:
                    self._tick()
            self.table.expire_partials(math.inf)  # cancelled jobs whose nodes left without a word: the broker's results
            self._flush()
        finally:
            for sig, handler in prev.items():
                signal.signal(sig, handler)
            self.endpoint.unpublish()
            if self.metrics_server is not None:
                self.metrics_server.close()
            if self.journal is not None:
                try:
                    self.journal.close()
                except JournalWriteError as e:
                    log.error("%s at stop: what it had not recorded is lost", e)
                if self.stopping:
                    # A clean stop finished every job and delivered every result: the next broker starts afresh.
                    self.journal.remove()
            # Linger briefly so the last results and replies reach their peers.
            self.close(linger_ms=1000)
            log.info("broker stopped")

    def _turn(self) -> None:
        """One loop turn: handle up to ``_MAX_BATCH`` waiting messages, then place queued jobs and flush."""
        self._drained = False
        recv, more = self.sock.recv, self.sock.get
        for _ in range(_MAX_BATCH):
            try:
                frames = [recv(_NOBLOCK)]
            except zmq.Again:
                self._drained = True
                break
            while more(_RCVMORE):
                frames.append(recv(_NOBLOCK))
            self.handle(frames)
        self._place()
        self._flush()

    async def serve_on_loop(self) -> None:
        """The loop of :meth:`serve_forever` as callbacks on the running asyncio loop, until stopped or cancelled.

        For a replay on simulated time (:mod:`prorl_cli.timebase`), where the
        broker, nodes and bridges share one event loop: the socket's readiness
        runs turns, a timer at the next tick runs ticks, all on the loop's
        clock. It takes no signals and writes no rendezvous file: the replay
        owns the process, and its peers are given the address.
        """
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()
        tick_at: list[asyncio.TimerHandle | None] = [None]

        def waiting() -> bool:
            return bool(cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

        def run() -> None:
            # The socket's descriptor is edge-triggered: read until it says nothing is waiting.
            while waiting():
                self._turn()
            if timebase.now() >= self._next_tick:
                self._tick()
                while waiting():
                    self._turn()
            if self._stopped():
                if not stopped.done():
                    stopped.set_result(None)
                return
            if tick_at[0] is None or tick_at[0].when() != self._next_tick:
                if tick_at[0] is not None:
                    tick_at[0].cancel()
                tick_at[0] = loop.call_at(self._next_tick, run)

        fd = cast(int, self.sock.getsockopt(zmq.FD))
        loop.add_reader(fd, run)
        run()
        try:
            await stopped
        finally:
            loop.remove_reader(fd)
            if tick_at[0] is not None:
                tick_at[0].cancel()

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket and stop the CURVE authenticator's thread (``serve_forever`` does it on its way out)."""
        self.endpoint.close(linger_ms)

    def leave(self) -> None:
        """Exit the loop soon, cancelling nothing: jobs stay in the journal for the next broker."""
        if self._leaving:
            return  # USR2 is followed by a SIGTERM (the Slurm role's requeue): say it once
        log.info("leaving on a signal: %d unfinished job(s) stay in the journal",
                 sum(not j.state.terminal for j in self.jobs.values()))
        self._leaving = True

    def _stopped(self) -> bool:
        if self._leaving:
            return True
        if not self.stopping:
            return False
        if not any(n.alive for n in self.nodes.values()) and not self.router.bridges_alive():
            return True
        return self._stop_deadline is not None and timebase.now() >= self._stop_deadline

    def _place(self) -> None:
        """Place queued jobs on nodes with free credit (unless held); their assignments go out with the flush."""
        if self.placing and (placed := self.table.place()):
            self.outbox.placed(placed)

    def _flush(self) -> None:
        """End of a loop turn: make the journal durable, then send the turn's results and assignments."""
        self._journal_flush()
        self.outbox.flush(self.nodes, self.members.node_lost)

    # ------------------------------------------------------------- dispatch

    def handle(self, frames: list[bytes]) -> None:
        """Handle one message; never raises for bad input.

        The header is checked against its op's schema (every field, type and
        range, and the payload count) here, before any handler runs; errors
        echo the request's ``rid`` whenever it had a usable one.
        """
        identity = frames[0]
        if len(frames) < 2:
            self._error(identity, None, ErrorCode.BAD_FRAME, "message has no header frame")
            return
        rid = None
        try:
            header = P.decode_map(frames[1])
            rid = P.header_rid(header)  # before the envelope checks: a bad version or op still gets its rid back
            op: Op = P.check_envelope(header)["op"]
            handler = self.handlers.get(op)
            if handler is None:
                self._error(identity, rid, ErrorCode.UNKNOWN_OP, f"op {op.value!r} is not accepted by the broker")
                return
            typed = P.parse(header)  # the fields first: they name what is wrong better than a frame count
            payload = P.job_items(op, frames[2:])
            P.check_payload(header, len(payload))
        except ProtocolError as e:
            self._error(identity, rid, ErrorCode(e.code), e.message)
            return
        # A message is a sign of life, whoever sent it (a node, or a bridge: the router's).
        now = timebase.now()
        node = self.node_by_identity.get(identity)
        if node is not None:
            node.last_seen = now
        self.router.touch(identity, now)
        try:
            handler(identity, typed, payload)
        except ProtocolError as e:
            self._error(identity, rid, ErrorCode(e.code), e.message)

    # ---------------------------------------------------------- client ops

    def on_submit(self, identity: bytes, h: H.Submit, payload: list[bytes]) -> None:
        rid = h.rid
        if self.stopping:
            self._error(identity, rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping; no new jobs")
            return
        if not self._journal_flush(probe=True):  # accepted means journaled: not while the journal cannot be written
            self._refuse_unjournaled(identity, rid)
            return
        specs: list[JobSpec] = h.jobs  # checked by the submit schema
        seen: set[str] = set()
        reused: list[tuple[str, str]] = []
        for i, (spec, instance) in enumerate(zip(specs, payload, strict=True)):
            try:
                P.unpack_obj(instance)  # a node must be able to decode it: refuse garbage here
            except ProtocolError as e:
                self._error(identity, rid, ErrorCode(e.code), f"op 'submit': jobs[{i}]: {e.message}")
                return
            if spec.job_id in seen:
                self._error(identity, rid, ErrorCode.BAD_FIELD, f"jobs[{i}]: job id {spec.job_id!r} appears twice in one submit")
                return
            seen.add(spec.job_id)
            known = self.jobs.get(spec.job_id)
            # An id names one job: resubmitting it returns that job (a retry, a resumed run, a client that
            # submits ids to watch them). Other work under it (another task, instance or sampling: a new
            # seed) gets that job's result, an earlier run's perhaps: said here, where it can be seen.
            other = _other_work(known, spec, instance) if known is not None else None
            if other is not None:
                reused.append((spec.job_id, other))
        live_tasks = self.table.live_tasks()
        if live_tasks:
            unknown = sorted({s.task for s in specs if s.job_id not in self.jobs} - live_tasks)
            if unknown:
                self._error(
                    identity, rid, ErrorCode.UNKNOWN_TASK,
                    f"no node serves task(s) {unknown}; served tasks: {sorted(live_tasks)}",
                )
                return
        if reused:
            log.warning("%d job id(s) of a submit already name jobs of other work (e.g. %r, now for %s): those jobs "
                        "and their results are returned, not new ones; new work needs new ids", len(reused),
                        *reused[0])
        accepted, existing = [], []
        mark = self.journal.mark() if self.journal is not None else 0
        for spec, instance in zip(specs, payload, strict=True):
            job = self.jobs.get(spec.job_id)
            if job is not None:
                # Idempotent: the same id returns the existing job, never a second run.
                existing.append(spec.job_id)
                job.watchers.add(identity)
                if job.result is not None and job.partial_until is None:
                    self.outbox.results[identity].append(job)
                continue
            self.table.add(spec, bytes(instance), identity)
            accepted.append(spec.job_id)
        if not self._journal_flush(probe=True):  # accepted means journaled: a submit the disk could not take is undone whole
            assert self.journal is not None
            self.journal.discard_since(mark)
            self.table.withdraw(accepted)
            self._refuse_unjournaled(identity, rid)
            return
        new_ids = set(accepted)
        for spec in specs:
            if spec.job_id in new_ids:
                self.metrics.inc("prorl_jobs_submitted", (spec.task,))
        self._send(identity, P.reply(rid, accepted=accepted, existing=existing, boot_id=self.boot_id))

    def _refuse_unjournaled(self, identity: bytes, rid: Any) -> None:
        self._error(identity, rid, ErrorCode.JOURNAL_UNWRITABLE, f"{self._journal_error}; no job of this submit was "
                    "accepted: submit it again once the broker's disk has room")

    def _watch_named(self, identity: bytes, job_ids: list[str]) -> tuple[list[Job], list[str]]:
        """The named jobs this broker knows, now watched by ``identity``, and the ids it does not know."""
        jobs, unknown = [], []
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None:
                unknown.append(job_id)
            else:
                job.watchers.add(identity)
                jobs.append(job)
        return jobs, unknown

    def on_watch(self, identity: bytes, h: H.JobIds, payload: list[bytes]) -> None:
        jobs, unknown = self._watch_named(identity, h.job_ids)
        self.outbox.results[identity].extend(job for job in jobs if job.result is not None and job.partial_until is None)
        self._send(identity, P.reply(h.rid, unknown=unknown, boot_id=self.boot_id))

    def on_cancel(self, identity: bytes, h: H.JobIds, payload: list[bytes]) -> None:
        """Cancel the named jobs: per-id states for the known ones, ``unknown`` for the rest."""
        self._watch_named(identity, h.job_ids)
        out = self.table.cancel(h.job_ids)
        self._cancel_on_nodes(out.by_node)
        self._journal_flush()
        self._send(identity, P.reply(h.rid, states=out.states, unknown=out.unknown))

    def _cancel_on_nodes(self, by_node: dict[str, list[str]]) -> None:
        for node_id, job_ids in by_node.items():
            node = self.nodes.get(node_id)
            if node is None or not node.alive:
                continue
            self._send(node.identity, H.CancelJob(job_ids).to_wire())

    def on_forget(self, identity: bytes, h: H.JobIds, payload: list[bytes]) -> None:
        """Drop the retained results of finished jobs the caller has taken; unfinished ones are kept."""
        self._send(identity, P.reply(h.rid, **self.table.forget(h.job_ids).to_wire()))

    def on_list_jobs(self, identity: bytes, h: H.ListJobs, payload: list[bytes]) -> None:
        """Ids and states of the held jobs that match, one page at a time (``next`` is the ``after`` of the next page)."""
        found, after = self.table.find(h.prefix, h.group_id, h.after or 0)
        self._send(identity, P.reply(h.rid, jobs=found, **({"next": after} if after is not None else {})))

    def on_status(self, identity: bytes, h: H.Request, payload: list[bytes]) -> None:
        self._send(identity, P.reply(h.rid, status=self.status().to_wire()))

    def status(self) -> P.StatusReport:
        return P.StatusReport(
            deployment=self.config.deployment,
            jobs=self.table.counts(),
            queued=len(self.queue) + len(self.table.awaiting_claim),
            nodes=[n.status() for n in self.nodes.values()],
            placing=self.placing,
            uptime_s=timebase.now() - self.started_at,
            retained_results=self.table.retained_count,
            finished_total=self.table.finished_total,
            journal_error=self._journal_error,
            retained_bytes=self.table.retained_bytes,
            metrics_url=self.metrics_server.url if self.metrics_server is not None else None,
            by_task=jobs_by_task(self.jobs.values()),
            failures=self.collector.failure_groups(),
            tokens=self.collector.token_totals(),
            **self.router.status_fields(),
        )

    def on_ping(self, identity: bytes, h: H.Request, payload: list[bytes]) -> None:
        self._send(identity, P.reply(h.rid, address=self.address, deployment=self.config.deployment, boot_id=self.boot_id))

    def on_start(self, identity: bytes, h: H.Request, payload: list[bytes]) -> None:
        self.placing = True
        self._send(identity, P.reply(h.rid, placing=True))

    def on_hold(self, identity: bytes, h: H.Request, payload: list[bytes]) -> None:
        self.placing = False
        self._send(identity, P.reply(h.rid, placing=False))

    def on_stop(self, identity: bytes, h: H.Request, payload: list[bytes]) -> None:
        self._send(identity, P.reply(h.rid, stopping=True))
        self.begin_stop()

    def begin_stop(self) -> None:
        """Cancel every job, tell nodes and bridges to shut down, and exit once they left."""
        if self.stopping:
            return
        log.info("stopping: cancelling %d unfinished job(s)", sum(not j.state.terminal for j in self.jobs.values()))
        self.stopping = True
        self.placing = False
        # Before anyone is told: a peer still starting (a bridge loading its model) reads it and does not wait
        # for a broker that is not coming. Signals (a requeue, a time limit) leave without it: a successor comes.
        self.endpoint.record_stop()
        self._stop_deadline = timebase.now() + self.config.node.stop_grace_s + 2 * self.dead_after_s
        self.table.cancel_all(P.ErrorInfo(stage="broker", type="DeploymentStopped",
                                          message="the deployment was stopped (prorl stop or down) before the job ended"))
        self.members.stop()
        self.router.stop()
        self._flush()

    # ---------------------------------------------------------- the router's seams

    def _live_node(self, identity: bytes) -> Node | None:
        node = self.node_by_identity.get(identity)
        return node if node is not None and node.alive else None

    def _running_node(self, job_id: str) -> str | None:
        """The node a job is placed on while it is unfinished (the router routes only such jobs' calls)."""
        job = self.jobs.get(job_id)
        return job.node_id if job is not None and not job.state.terminal else None

    # ------------------------------------------------------------ liveness and gauges

    def _tick(self) -> None:
        now = timebase.now()
        self._next_tick = now + self.heartbeat_interval_s / 2
        # A turn that overran (a long batch, a slow disk) must not count against peers: their heartbeats
        # were waiting in our inbox. Credit the overrun, and judge only once the inbox is drained.
        overrun_s = now - self._last_tick - self.heartbeat_interval_s
        self._last_tick = now
        if overrun_s > 0:
            for backend in self.router.backends.values():
                backend.last_seen = min(now, backend.last_seen + overrun_s)
        judge = self._drained
        self.members.tick(now, overrun_s, judge)
        if judge:
            self.router.tick(now)
        self.router.check_waiters(now)
        self.members.prune(self.config.broker.dead_nodes_kept)
        self.table.expire_partials(now)
        if self.metrics_server is not None and now >= self._next_gauges_at:
            self._next_gauges_at = now + 1.0
            self._refresh_gauges()
        self._place()
        self._flush()

    def _refresh_gauges(self) -> None:
        """The gauges that describe the broker's state now (about once a second, on the loop)."""
        journal_bytes = self.journal.size_bytes if self.journal is not None else 0
        self.metrics.gauges = gauges_from_status(self.status(), journal_bytes)
