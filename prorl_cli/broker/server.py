"""The broker: one ZeroMQ ROUTER socket, one poll loop, no threads.

The job table (:mod:`prorl_cli.broker.jobs`) holds jobs, placement and
claims; this file is the loop: it checks every message against its op's
schema (:mod:`prorl_cli.protocol`) before any handler runs, hands generate
calls and backends to its router (``broker/routing.py``), pushes results to
the clients that watch them, and keeps every peer's liveness with heartbeats. Bad input
is answered with an error naming the op and field; it never stops the loop.
Nothing on the loop blocks for long: journal compaction runs in a thread,
and liveness is judged only once the inbox is drained.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import defaultdict
from typing import Any

import zmq

from prorl_cli import protocol as P
from prorl_cli.broker.allocator import fix_mmap_threshold
from prorl_cli.broker.jobs import JobTable
from prorl_cli.broker.journal import JOURNAL_NAME, Journal
from prorl_cli.broker.routing import Router
from prorl_cli.broker.state import Job, Node
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import ProtocolError
from prorl_cli.observe.logs import OncePerPeer
from prorl_cli.observe.metrics import (
    DeploymentCollector,
    MetricSet,
    MetricsServer,
    gauges_from_status,
    jobs_by_task,
)
from prorl_cli.protocol import ErrorCode, JobSpec, JobState, Op
from prorl_cli.protocol import headers as H
from prorl_cli.rendezvous import Rendezvous, remove_rendezvous, write_rendezvous
from prorl_cli.security import curve_wanted, secure_server

log = logging.getLogger(__name__)

# How many messages one loop turn reads before flushing batched output.
_MAX_BATCH = 2000
# Plain ints: pyzmq's send_multipart builds a Flag enum (``zmq.SNDMORE | flags``) per frame, which
# cost as much as the send itself (benchmarks/broker_scale.py, docs/benchmarks.md).
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
# Frames at least this big go zero-copy; smaller ones are cheaper to copy (pyzmq's own threshold).
_ZERO_COPY_BYTES = 65536


class Broker:
    """The deployment's broker. ``serve_forever()`` runs until ``stop`` (clean) or SIGTERM/SIGUSR2 (leave, journal kept)."""

    def __init__(self, config: ProrlConfig) -> None:
        # Before anything big is allocated (a journal replay holds results): big buffers then stay out of
        # the heap, so memory freed by retention goes back to the system (broker/allocator.py).
        fix_mmap_threshold()
        self.config = config
        bc = config.broker
        self.heartbeat_interval_s = bc.heartbeat_interval_s
        self.dead_after_s = bc.heartbeat_interval_s * bc.heartbeat_liveness
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        # Bounded per peer (libzmq then stops reading that connection): unread input cannot outgrow memory
        # when nodes send results faster than the loop reads them; the backlog waits in the senders.
        self.sock.setsockopt(zmq.RCVHWM, bc.receive_window_messages)
        # Oversized frames are refused by libzmq itself (the sender is disconnected).
        self.sock.setsockopt(zmq.MAXMSGSIZE, bc.max_message_bytes)
        self.curve_public_key: str | None = None
        self._auth = None
        if curve_wanted(bc.curve, bc.bind_host):
            self.curve_public_key, self._auth = secure_server(self.ctx, self.sock, config.deployment_dir)
        if bc.port:
            self.sock.bind(f"tcp://{bc.bind_host}:{bc.port}")
        else:
            self.sock.bind(f"tcp://{bc.bind_host}:*")
        bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # Peers on other hosts cannot dial a wildcard: publish this host's name instead.
        self.address = bound.replace("0.0.0.0", socket.getfqdn(), 1) if "://0.0.0.0:" in bound else bound
        self.started_at = time.monotonic()

        #: Changes each time a broker starts: clients that see it change watch their jobs again.
        self.boot_id = uuid.uuid4().hex
        self.journal: Journal | None = None
        self.table = JobTable(
            retention_count=bc.result_retention,
            retention_bytes=bc.result_retention_mb * 1024 * 1024,
            record=self._journal_append,
            on_end=self._job_finished,
            on_detach=self._job_ended,
            on_release=self._deliver,
            partial_grace_s=bc.cancel_result_grace_s,
        )
        # The job table's dicts, under the names the routing code reads.
        self.jobs: dict[str, Job] = self.table.jobs
        self.queue = self.table.queue
        self.nodes: dict[str, Node] = self.table.nodes
        self.node_by_identity: dict[bytes, Node] = {}
        self.router = Router(
            self._send, self._live_node, self._running_node,
            policy=bc.routing_policy, cancel_propagation=bc.cancel_propagation,
            kv_admission=bc.kv_admission, kv_admission_max_wait_s=bc.kv_admission_max_wait_s,
            heartbeat_interval_s=bc.heartbeat_interval_s, heartbeat_liveness=bc.heartbeat_liveness,
            register_reply_fields={"boot_id": self.boot_id},
        )
        self.placing = True
        self.stopping = False
        self._leaving = False  # set by SIGTERM/SIGUSR2: exit without a clean stop
        self._stop_deadline: float | None = None
        # Output batched within one loop turn, flushed at its end.
        self._results_out: dict[bytes, list[Job]] = defaultdict(list)
        self._assign_out: dict[str, list[Job]] = defaultdict(list)
        self._next_tick = time.monotonic()
        self._last_tick = time.monotonic()
        # False while messages may be waiting unread: liveness is judged only on a drained inbox.
        self._drained = True
        #: Prometheus figures: the broker's own, and every peer's from its heartbeats (served when metrics_port is set).
        self.metrics = MetricSet()
        self.collector = DeploymentCollector(self.metrics)
        self.metrics_server: MetricsServer | None = None
        self._next_gauges_at = 0.0
        self._rejects = OncePerPeer(log)
        if bc.journal:
            self.journal = Journal(
                config.deployment_dir / JOURNAL_NAME, fsync=bc.journal_fsync, compact_bytes=bc.journal_compact_mb * 1024 * 1024
            )
            self._replay()

    # ------------------------------------------------------------------ journal

    def _replay(self) -> None:
        assert self.journal is not None
        jobs = self.journal.replay().values()
        waiting = self.table.load_replayed(jobs, claim_window_s=2 * self.dead_after_s)
        self.journal.rewrite(self.table.journal_snapshot())
        if self.jobs:
            log.info("journal replayed: %d job(s), %d unfinished", len(self.jobs), sum(not j.state.terminal for j in self.jobs.values()))
        if waiting:
            # Only jobs a node may still be running wait; new and never-placed jobs are placed at once.
            log.info("%d placed job(s) wait %.1f s for their nodes to claim them", waiting, 2 * self.dead_after_s)

    def _journal_append(self, record: dict[str, Any]) -> None:
        if self.journal is not None:
            self.journal.append(record)

    def _journal_flush(self) -> None:
        """Make what was journaled durable before anyone hears of it; compaction runs off the loop."""
        if self.journal is None:
            return
        self.journal.flush()
        self.journal.poll()
        if self.journal.wants_compaction:
            self.journal.compact_in_background(self.table.journal_snapshot())

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

    def publish_rendezvous(self) -> None:
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

    def serve_forever(self, leave_requested: threading.Event | None = None) -> None:
        """Run the loop until stopped. Writes the rendezvous file first, removes it last.

        ``leave_requested`` set by the time the broker's own signal handlers are in (a signal the
        caller's handler caught in the meantime): the broker leaves at once, as on that signal.
        """
        self._start_metrics()
        self.publish_rendezvous()
        log.info(
            "broker of deployment %r listening on %s (%s)", self.config.deployment, self.address,
            "CURVE encrypted and authenticated" if self.curve_public_key
            else "plain TCP (broker.curve: off): whoever reaches the port can use it",
        )
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
                timeout_ms = max(0, int((self._next_tick - time.monotonic()) * 1000))
                if poller.poll(timeout_ms):
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
                if time.monotonic() >= self._next_tick:
                    self._tick()
        finally:
            for sig, handler in prev.items():
                signal.signal(sig, handler)
            remove_rendezvous(self.config.deployment_dir, os.getpid())
            if self.metrics_server is not None:
                self.metrics_server.close()
            if self.journal is not None:
                self.journal.close()
                if self.stopping:
                    # A clean stop finished every job and delivered every result: the next broker starts afresh.
                    self.journal.remove()
            # Linger briefly so the last results and replies reach their peers.
            self.close(linger_ms=1000)
            log.info("broker stopped")

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket and stop the CURVE authenticator's thread (``serve_forever`` does it on its way out)."""
        self.sock.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

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
        return self._stop_deadline is not None and time.monotonic() >= self._stop_deadline

    def _flush(self) -> None:
        self._journal_flush()
        for identity, finished in self._results_out.items():
            # Job objects, not ids: a result evicted by retention in this same turn still goes out.
            jobs = list({j.job_id: j for j in finished if j.result is not None}.values())
            if jobs:
                self._send(
                    identity,
                    {"op": Op.RESULT.value, "jobs": [{"job_id": j.job_id, "state": j.state.value} for j in jobs]},
                    [j.result for j in jobs],  # type: ignore[misc]
                )
        self._results_out.clear()
        for node_id, jobs in self._assign_out.items():
            node = self.nodes.get(node_id)
            if node is None or not node.alive:
                continue
            now = time.monotonic()
            # ``timing``: where each job's timeline starts (seconds since it was accepted) and the broker's events.
            timing = [{"since_submit_s": now - j.submitted_at, "events": j.events} for j in jobs]
            if not self._send(
                node.identity,
                {"op": Op.ASSIGN.value, "jobs": [j.spec.to_wire() for j in jobs], "timing": timing},
                [j.instance for j in jobs],
            ):
                self._node_lost(node, "unreachable")
        self._assign_out.clear()

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
            handler = self._handlers.get(op)
            routed = self.router.handlers.get(op) if handler is None else None
            if handler is None and routed is None:
                self._error(identity, rid, ErrorCode.UNKNOWN_OP, f"op {op.value!r} is not accepted by the broker")
                return
            typed = P.parse(header, len(frames) - 2)
        except ProtocolError as e:
            self._error(identity, rid, ErrorCode(e.code), e.message)
            return
        self._touch(identity)
        try:
            if handler is not None:
                handler(self, identity, typed, frames[2:])
            elif routed is not None:
                routed(identity, typed, frames[2:])
        except ProtocolError as e:
            self._error(identity, rid, ErrorCode(e.code), e.message)

    def _touch(self, identity: bytes) -> None:
        now = time.monotonic()
        node = self.node_by_identity.get(identity)
        if node is not None:
            node.last_seen = now
        self.router.touch(identity, now)

    # ---------------------------------------------------------- client ops

    def on_submit(self, identity: bytes, h: H.Submit, payload: list[bytes]) -> None:
        rid = h.rid
        if self.stopping:
            self._error(identity, rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping; no new jobs")
            return
        specs: list[JobSpec] = h.jobs  # checked by the submit schema
        seen: set[str] = set()
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
        live_tasks = self.table.live_tasks()
        if live_tasks:
            unknown = sorted({s.task for s in specs if s.job_id not in self.jobs} - live_tasks)
            if unknown:
                self._error(
                    identity, rid, ErrorCode.UNKNOWN_TASK,
                    f"no node serves task(s) {unknown}; served tasks: {sorted(live_tasks)}",
                )
                return
        accepted, existing = [], []
        for spec, instance in zip(specs, payload, strict=True):
            job = self.jobs.get(spec.job_id)
            if job is not None:
                # Idempotent: the same id returns the existing job, never a second run.
                existing.append(spec.job_id)
                job.watchers.add(identity)
                if job.result is not None and job.partial_until is None:
                    self._results_out[identity].append(job)
                continue
            self.table.add(spec, bytes(instance), identity)
            self.metrics.inc("prorl_jobs_submitted", (spec.task,))
            accepted.append(spec.job_id)
        self._journal_flush()  # accepted means journaled
        self._send(identity, P.reply(rid, accepted=accepted, existing=existing, boot_id=self.boot_id))

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
        self._results_out[identity].extend(job for job in jobs if job.result is not None and job.partial_until is None)
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
            self._send(node.identity, {"op": Op.CANCEL_JOB.value, "job_ids": job_ids})

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
            backends=self.router.backend_statuses(),
            generation_paused=self.router.paused,
            placing=self.placing,
            uptime_s=time.monotonic() - self.started_at,
            held_generates=len(self.router.held),
            retained_results=self.table.retained_count,
            retained_bytes=self.table.retained_bytes,
            policy_version=self.router.policy_version,
            routing_policy=self.router.policy_name,
            metrics_url=self.metrics_server.url if self.metrics_server is not None else None,
            by_task=jobs_by_task(self.jobs.values()),
            failures=self.collector.failure_groups(),
            tokens=self.collector.token_totals(),
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
        self._stop_deadline = time.monotonic() + self.config.node.stop_grace_s + 2 * self.dead_after_s
        self.table.cancel_all()
        for node in self.nodes.values():
            if node.alive:
                self._send(node.identity, {"op": Op.SHUTDOWN.value})
        self.router.stop()
        self._flush()

    # ------------------------------------------------------------ node ops

    def on_register(self, identity: bytes, h: H.Register, payload: list[bytes]) -> None:
        node_id = h.node_id
        if self.stopping:
            self._send(identity, {"op": Op.SHUTDOWN.value})
            return
        old = self.nodes.get(node_id)
        if old is not None and old.alive and old.identity != identity:
            # Same node id from a new connection: the old process is gone.
            self._node_lost(old, "re-registered from a new connection")
        if old is not None and old.alive and old.identity == identity:
            # Registered again on the same connection (it missed our reply): keep what it holds.
            node = old
            node.credit, node.tasks, node.host = h.credit, set(h.tasks), h.host
            node.liveness_token = h.liveness_token
            node.sandbox_runtime = h.sandbox_runtime
            node.draining = bool(h.draining)
        else:
            node = Node(
                node_id=node_id,
                identity=identity,
                host=h.host,
                pid=h.pid or 0,
                credit=h.credit,
                tasks=set(h.tasks),
                liveness_token=h.liveness_token,
                sandbox_runtime=h.sandbox_runtime,
                draining=bool(h.draining),
            )
        self.nodes[node_id] = node
        self.node_by_identity[identity] = node
        drop = self.table.claim(node, h.running or [])
        log.info("node %s registered from %s (credit %d, tasks %s, running %d)", node_id, node.host, node.credit,
                 sorted(node.tasks), len(node.inflight))
        self._send(
            identity,
            P.reply(h.rid, heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_liveness=self.config.broker.heartbeat_liveness,
                    drop=drop, boot_id=self.boot_id),
        )

    def _node_of(self, identity: bytes, h: Any) -> Node | None:
        """The live node on ``identity``; else the peer (``h``: its header) is told to register, and None."""
        node = self.node_by_identity.get(identity)
        if node is None or not node.alive:
            # Tell the peer to register again (e.g. after it was declared dead).
            self._send(identity, P.error_reply(getattr(h, "rid", None), ErrorCode.UNKNOWN_PEER, "not registered; send register"))
            return None
        return node

    def on_heartbeat(self, identity: bytes, h: H.Heartbeat, payload: list[bytes]) -> None:
        token = h.liveness_token
        sidecar = self.nodes.get(h.node_id or "")
        if token is not None and (sidecar is None or sidecar.identity != identity):
            # A node's liveness sidecar (its own connection): refresh that node, never answer.
            node = sidecar
            if node is not None and node.alive and node.liveness_token is not None and node.liveness_token == token:
                node.last_seen = time.monotonic()
                if h.stages is not None:
                    node.stages = h.stages
            else:
                log.debug("heartbeat with a liveness token for node %r that does not match; ignored", h.node_id)
            return
        if self.router.bridge_heartbeat(identity, h):
            backend = self.router.backend_by_identity.get(identity)
            if backend is not None and h.metrics is not None:
                self.collector.update_peer("bridge", backend.backend_id, h.metrics)
            return
        if h.backend_id is not None:
            self._send(identity, P.error_reply(h.rid, ErrorCode.UNKNOWN_PEER, "not registered; send register_backend"))
            return
        node = self._node_of(identity, h)
        if node is not None and h.stages is not None:
            node.stages = h.stages
        if node is not None and h.metrics is not None:
            self.collector.update_peer("node", node.node_id, h.metrics)
        if node is not None and h.failures is not None:
            self.collector.failures[node.node_id] = h.failures

    def on_unregister(self, identity: bytes, h: H.Unregister, payload: list[bytes]) -> None:
        node = self.node_by_identity.get(identity)
        if node is not None and node.alive:
            self._node_lost(node, "unregistered")
        self.router.unregister(identity)

    def on_release(self, identity: bytes, h: H.JobIds, payload: list[bytes]) -> None:
        """A node drains: nothing more is placed on it; the jobs it names (never started there) are queued again."""
        node = self._node_of(identity, h)
        if node is None:
            return
        node.draining = True
        released = self.table.release(node, h.job_ids)
        log.info("node %s is draining: %d job(s) handed back, %d running on", node.node_id, len(released), len(node.inflight))
        self._journal_flush()
        self._send(identity, P.reply(h.rid, released=released))

    def on_job_stage(self, identity: bytes, h: H.JobStage, payload: list[bytes]) -> None:
        node = self._node_of(identity, h)
        if node is not None:
            self.table.stage(node, h.updates)

    def on_job_done(self, identity: bytes, h: H.JobDone, payload: list[bytes]) -> None:
        node = self._node_of(identity, h)
        if node is not None:
            self.table.done(node, h.jobs, payload)

    # ---------------------------------------------------------- inference

    def _live_node(self, identity: bytes) -> Node | None:
        node = self.node_by_identity.get(identity)
        return node if node is not None and node.alive else None

    def _running_node(self, job_id: str) -> str | None:
        """The node a job is placed on while it is unfinished (the router routes only such jobs' calls)."""
        job = self.jobs.get(job_id)
        return job.node_id if job is not None and not job.state.terminal else None

    # ---------------------------------------------------------- placement

    def _place(self) -> None:
        if not self.placing:
            return
        placed = self.table.place()
        if not placed:
            return
        now = time.monotonic()
        for node, job in placed:
            self._assign_out[node.node_id].append(job)
            job.events.append(["assigned", round(now - job.submitted_at, 6), 0.0, {"node": node.node_id, "attempt": job.spec.attempt}])
            self.metrics.observe("prorl_job_queue_seconds", (job.spec.task,), now - job.queued_at)

    def _node_lost(self, node: Node, why: str) -> None:
        """Declare a node dead and put its jobs back in the queue with a new attempt."""
        self.node_by_identity.pop(node.identity, None)
        self.table.node_lost(node, why)

    # ------------------------------------------------------------ finishing

    def _job_finished(self, job: Job) -> None:
        """A job reached a terminal state: push its result to its watchers."""
        self.metrics.inc("prorl_jobs_finished", (job.spec.task, job.state.value, str(job.spec.attempt)))
        if job.state is JobState.FAILED and job.node_id is None and job.result is not None:
            # Failed by the broker itself (its nodes kept dying): no node will list it among its failures.
            error = P.unpack_obj(job.result).get("error")
            self.collector.note_broker_failure(job.spec.task, error if isinstance(error, dict) else {})
        if job.partial_until is None:  # else it waits for its node's partial result (JobTable.cancel)
            self._deliver(job)

    def _deliver(self, job: Job) -> None:
        """Push a job's final result to its watchers."""
        for w in job.watchers:
            self._results_out[w].append(job)

    def _job_ended(self, job_id: str) -> None:
        """A job ended or lost its node: its generate calls are released (the routing seam)."""
        self.router.job_ended(job_id)

    # ------------------------------------------------------------ liveness

    def _tick(self) -> None:
        now = time.monotonic()
        self._next_tick = now + self.heartbeat_interval_s / 2
        # A turn that overran (a long batch, a slow disk) must not count against peers: their heartbeats
        # were waiting in our inbox. Credit the overrun, and judge only once the inbox is drained.
        overrun_s = now - self._last_tick - self.heartbeat_interval_s
        self._last_tick = now
        if overrun_s > 0:
            for node in self.nodes.values():
                node.last_seen = min(now, node.last_seen + overrun_s)
            for backend in self.router.backends.values():
                backend.last_seen = min(now, backend.last_seen + overrun_s)
        judge = self._drained
        for node in list(self.nodes.values()):
            if not node.alive:
                continue
            if judge and now - node.last_seen > self.dead_after_s:
                self._node_lost(node, f"silent for {now - node.last_seen:.1f} s")
            else:
                self._send(node.identity, {"op": Op.HEARTBEAT.value})
        if judge:
            self.router.tick(now)
        self.router.check_waiters(now)
        for node_id in self.table.prune_dead_nodes(self.config.broker.dead_nodes_kept):
            self.collector.forget_peer("node", node_id)
        self.table.expire_partials(now)
        if self.metrics_server is not None and now >= self._next_gauges_at:
            self._next_gauges_at = now + 1.0
            self._refresh_gauges()
        self._place()
        self._flush()

    # ------------------------------------------------------------ metrics

    def _start_metrics(self) -> None:
        bc = self.config.broker
        if bc.metrics_port is None:
            return
        try:
            self.metrics_server = MetricsServer(self.collector, bc.metrics_host, bc.metrics_port)
        except ImportError as e:
            log.error("broker.metrics_port is set but prometheus-client is missing (pip install 'prorl[observe]'): %s; "
                      "the broker runs without metrics", e)
            return
        except OSError as e:
            log.error("cannot serve metrics on %s:%s: %s; the broker runs without them", bc.metrics_host, bc.metrics_port, e)
            return
        self._refresh_gauges()
        log.info("Prometheus metrics at %s", self.metrics_server.url)

    def _refresh_gauges(self) -> None:
        """The gauges that describe the broker's state now (about once a second, on the loop)."""
        journal_bytes = self.journal.size_bytes if self.journal is not None else 0
        self.metrics.gauges = gauges_from_status(self.status(), journal_bytes)

    #: The broker's own ops; generate routing, backends and pause/resume are the router's (``router.handlers``).
    _handlers: dict[Op, Any] = {
        Op.SUBMIT: on_submit,
        Op.WATCH: on_watch,
        Op.CANCEL: on_cancel,
        Op.FORGET: on_forget,
        Op.STATUS: on_status,
        Op.LIST_JOBS: on_list_jobs,
        Op.PING: on_ping,
        Op.START: on_start,
        Op.HOLD: on_hold,
        Op.STOP: on_stop,
        Op.REGISTER: on_register,
        Op.HEARTBEAT: on_heartbeat,
        Op.UNREGISTER: on_unregister,
        Op.RELEASE: on_release,
        Op.JOB_STAGE: on_job_stage,
        Op.JOB_DONE: on_job_done,
    }
