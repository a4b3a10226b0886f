"""The broker: one ZeroMQ ROUTER socket, one poll loop, no threads.

It holds the job table, places queued jobs on nodes with free credit, hands
generate calls and backends to its router (``broker/routing.py``), pushes
results to the clients that watch them, and keeps every peer's liveness
with heartbeats.
Bad frames are logged and answered with an error; they never stop the loop.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

import zmq

from prorl_cli import protocol as P
from prorl_cli.broker.journal import JOURNAL_NAME, Journal, attempt_record, end_record, job_record
from prorl_cli.broker.routing import Router
from prorl_cli.broker.state import Job, Node, TaskQueues
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import ProtocolError
from prorl_cli.protocol import ErrorCode, JobResult, JobSpec, JobState, Op
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
        self.config = config
        bc = config.broker
        self.heartbeat_interval_s = bc.heartbeat_interval_s
        self.dead_after_s = bc.heartbeat_interval_s * bc.heartbeat_liveness
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
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
        self.jobs: dict[str, Job] = {}
        self.finished: deque[str] = deque()  # terminal job ids, oldest first (retention)
        self.queue = TaskQueues()
        self.nodes: dict[str, Node] = {}
        self.node_by_identity: dict[bytes, Node] = {}
        self.router = Router(
            self._send, self._live_node, self._running_node,
            policy=bc.routing_policy, cancel_propagation=bc.cancel_propagation,
            heartbeat_interval_s=bc.heartbeat_interval_s, heartbeat_liveness=bc.heartbeat_liveness,
            register_reply_fields={"boot_id": self.boot_id},
        )
        self.placing = True
        self.stopping = False
        self._leaving = False  # set by SIGTERM/SIGUSR2: exit without a clean stop
        self._stop_deadline: float | None = None
        # Output batched within one loop turn, flushed at its end.
        self._results_out: dict[bytes, list[str]] = defaultdict(list)
        self._assign_out: dict[str, list[str]] = defaultdict(list)
        self._next_tick = time.monotonic()
        # After a replay, unfinished jobs wait this long for their nodes to claim them before being placed anew.
        self._claims_until = 0.0
        self.journal: Journal | None = None
        if bc.journal:
            self.journal = Journal(
                config.deployment_dir / JOURNAL_NAME, fsync=bc.journal_fsync, compact_bytes=bc.journal_compact_mb * 1024 * 1024
            )
            self._replay()

    # ------------------------------------------------------------------ journal

    def _replay(self) -> None:
        assert self.journal is not None
        unfinished = 0
        for job in self.journal.replay().values():
            self.jobs[job.job_id] = job
            if job.state.terminal:
                self.finished.append(job.job_id)
            else:
                job.state = JobState.QUEUED
                self.queue.push(job.spec.task, job.job_id)
                unfinished += 1
        while len(self.finished) > self.config.broker.result_retention:
            self.jobs.pop(self.finished.popleft(), None)
        self.journal.rewrite(self._journal_snapshot())
        if self.jobs:
            log.info("journal replayed: %d job(s), %d unfinished", len(self.jobs), unfinished)
        if unfinished:
            # Nodes that ran jobs for the broker before us register again within a few heartbeats.
            self._claims_until = time.monotonic() + 2 * self.dead_after_s
            log.info("unfinished jobs wait %.1f s for their nodes to claim them", 2 * self.dead_after_s)

    def _journal_snapshot(self) -> Iterator[dict[str, Any]]:
        for job in list(self.jobs.values()):
            yield job_record(job.spec, job.instance)
            if job.result is not None:
                yield end_record(job.job_id, job.state, job.result)

    def _journal_flush(self) -> None:
        """Make what was journaled durable before anyone hears of it."""
        if self.journal is None:
            return
        self.journal.flush()
        if self.journal.wants_compaction:
            self.journal.rewrite(self._journal_snapshot())

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
        log.warning("error to %r (rid %r): %s: %s", identity, rid, code.value, message)
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

    def serve_forever(self) -> None:
        """Run the loop until stopped. Writes the rendezvous file first, removes it last."""
        self.publish_rendezvous()
        log.info(
            "broker of deployment %r listening on %s (%s)", self.config.deployment, self.address,
            "CURVE encrypted and authenticated" if self.curve_public_key else "plain TCP: loopback only",
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
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stopped():
                timeout_ms = max(0, int((self._next_tick - time.monotonic()) * 1000))
                if poller.poll(timeout_ms):
                    recv, more = self.sock.recv, self.sock.get
                    for _ in range(_MAX_BATCH):
                        try:
                            frames = [recv(_NOBLOCK)]
                        except zmq.Again:
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
            if self.journal is not None:
                self.journal.close()
                if self.stopping:
                    # A clean stop finished every job and delivered every result: the next broker starts afresh.
                    self.journal.remove()
            # Linger briefly so the last results and replies reach their peers.
            self.sock.close(linger=1000)
            if self._auth is not None:
                self._auth.stop()
            log.info("broker stopped")

    def leave(self) -> None:
        """Exit the loop soon, cancelling nothing: jobs stay in the journal for the next broker."""
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
        for identity, job_ids in self._results_out.items():
            jobs = [self.jobs[j] for j in job_ids if j in self.jobs and self.jobs[j].result is not None]
            if jobs:
                self._send(
                    identity,
                    {"op": Op.RESULT.value, "jobs": [{"job_id": j.job_id, "state": j.state.value} for j in jobs]},
                    [j.result for j in jobs],  # type: ignore[misc]
                )
        self._results_out.clear()
        for node_id, job_ids in self._assign_out.items():
            node = self.nodes.get(node_id)
            jobs = [self.jobs[j] for j in job_ids]
            if node is None or not node.alive:
                continue
            if not self._send(
                node.identity,
                {"op": Op.ASSIGN.value, "jobs": [j.spec.to_wire() for j in jobs]},
                [j.instance for j in jobs],
            ):
                self._node_lost(node, "unreachable")
        self._assign_out.clear()

    # ------------------------------------------------------------- dispatch

    def handle(self, frames: list[bytes]) -> None:
        """Handle one message; never raises for bad input."""
        identity = frames[0]
        if len(frames) < 2:
            self._error(identity, None, ErrorCode.BAD_FRAME, "message has no header frame")
            return
        try:
            header = P.decode_header(frames[1])
            P.require_fields(header)
        except ProtocolError as e:
            rid = None
            self._error(identity, rid, ErrorCode(e.code), e.message)
            return
        op: Op = header["op"]
        handler = self._handlers.get(op)
        if handler is None:
            self._error(identity, header.get("rid"), ErrorCode.UNKNOWN_OP, f"op {op.value!r} is not accepted by the broker")
            return
        self._touch(identity)
        try:
            handler(self, identity, header, frames[2:])
        except ProtocolError as e:
            self._error(identity, header.get("rid"), ErrorCode(e.code), e.message)

    def _touch(self, identity: bytes) -> None:
        now = time.monotonic()
        node = self.node_by_identity.get(identity)
        if node is not None:
            node.last_seen = now
        self.router.touch(identity, now)

    # ---------------------------------------------------------- client ops

    def on_submit(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        rid = h["rid"]
        if self.stopping:
            self._error(identity, rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping; no new jobs")
            return
        raw_jobs = h["jobs"]
        if len(payload) != len(raw_jobs):
            self._error(
                identity, rid, ErrorCode.BAD_FIELD,
                f"submit carries {len(raw_jobs)} job(s) but {len(payload)} instance frame(s); they must match",
            )
            return
        specs: list[JobSpec] = []
        seen: set[str] = set()
        for i, raw in enumerate(raw_jobs):
            try:
                spec = JobSpec.from_wire(raw, what=f"jobs[{i}]")
            except ProtocolError as e:
                self._error(identity, rid, ErrorCode(e.code), f"jobs[{i}]: {e.message}")
                return
            if spec.job_id in seen:
                self._error(identity, rid, ErrorCode.BAD_FIELD, f"jobs[{i}]: job id {spec.job_id!r} appears twice in one submit")
                return
            seen.add(spec.job_id)
            specs.append(spec)
        live_tasks = self._live_tasks()
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
                if job.result is not None:
                    self._results_out[identity].append(job.job_id)
                continue
            spec.attempt = 1
            job = Job(spec=spec, instance=bytes(instance), watchers={identity})
            self.jobs[spec.job_id] = job
            self.queue.push(spec.task, spec.job_id)
            accepted.append(spec.job_id)
            if self.journal is not None:
                self.journal.append(job_record(spec, job.instance))
        self._journal_flush()  # accepted means journaled
        self._send(identity, P.reply(rid, accepted=accepted, existing=existing, boot_id=self.boot_id))

    def _watch_named(self, identity: bytes, job_ids: list[Any]) -> tuple[list[Job], list[Any]]:
        """The named jobs this broker knows, now watched by ``identity``, and the ids it does not know."""
        jobs, unknown = [], []
        for job_id in job_ids:
            job = self.jobs.get(job_id) if isinstance(job_id, str) else None
            if job is None:
                unknown.append(job_id)
            else:
                job.watchers.add(identity)
                jobs.append(job)
        return jobs, unknown

    def on_watch(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        jobs, unknown = self._watch_named(identity, h["job_ids"])
        self._results_out[identity].extend(job.job_id for job in jobs if job.result is not None)
        self._send(identity, P.reply(h["rid"], unknown=unknown, boot_id=self.boot_id))

    def on_cancel(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        states: dict[str, str] = {}
        by_node: dict[str, list[str]] = defaultdict(list)
        jobs, unknown = self._watch_named(identity, h["job_ids"])
        for job in jobs:
            if job.state == JobState.QUEUED:
                self.queue.remove(job.spec.task, job.job_id)
            elif not job.state.terminal and job.node_id is not None:
                by_node[job.node_id].append(job.job_id)
            if not job.state.terminal:
                self._finish_by_broker(job, JobState.CANCELLED, None)
            states[job.job_id] = job.state.value
        for node_id, job_ids in by_node.items():
            node = self.nodes.get(node_id)
            if node is not None and node.alive:
                self._send(node.identity, {"op": Op.CANCEL_JOB.value, "job_ids": job_ids})
        self._journal_flush()
        self._send(identity, P.reply(h["rid"], states=states, unknown=unknown))

    def on_status(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        self._send(identity, P.reply(h["rid"], status=self.status().to_wire()))

    def status(self) -> P.StatusReport:
        counts: dict[str, int] = {s.value: 0 for s in JobState}
        for job in self.jobs.values():
            counts[job.state.value] += 1
        return P.StatusReport(
            deployment=self.config.deployment,
            jobs=counts,
            queued=len(self.queue),
            nodes=[n.status().to_wire() for n in self.nodes.values()],
            backends=[b.to_wire() for b in self.router.backend_statuses()],
            generation_paused=self.router.paused,
            placing=self.placing,
            uptime_s=time.monotonic() - self.started_at,
            held_generates=len(self.router.held),
            policy_version=self.router.policy_version,
            routing_policy=self.router.policy_name,
        )

    def on_ping(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        self._send(identity, P.reply(h["rid"], address=self.address, deployment=self.config.deployment, boot_id=self.boot_id))

    def on_start(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        self.placing = True
        self._send(identity, P.reply(h["rid"], placing=True))

    def on_hold(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        self.placing = False
        self._send(identity, P.reply(h["rid"], placing=False))

    def on_stop(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        self._send(identity, P.reply(h["rid"], stopping=True))
        self.begin_stop()

    def begin_stop(self) -> None:
        """Cancel every job, tell nodes and bridges to shut down, and exit once they left."""
        if self.stopping:
            return
        log.info("stopping: cancelling %d unfinished job(s)", sum(not j.state.terminal for j in self.jobs.values()))
        self.stopping = True
        self.placing = False
        self._stop_deadline = time.monotonic() + self.config.node.stop_grace_s + 2 * self.dead_after_s
        for job in list(self.jobs.values()):
            if not job.state.terminal:
                if job.state == JobState.QUEUED:
                    self.queue.remove(job.spec.task, job.job_id)
                self._finish_by_broker(job, JobState.CANCELLED, None)
        for node in self.nodes.values():
            if node.alive:
                self._send(node.identity, {"op": Op.SHUTDOWN.value})
        self.router.stop()
        self._flush()

    # ------------------------------------------------------------ node ops

    def on_register(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        node_id = h["node_id"]
        if self.stopping:
            self._send(identity, {"op": Op.SHUTDOWN.value})
            return
        old = self.nodes.get(node_id)
        if old is not None and old.alive and old.identity != identity:
            # Same node id from a new connection: the old process is gone.
            self._node_lost(old, "re-registered from a new connection")
        credit = h["credit"]
        if credit < 1:
            self._error(identity, h["rid"], ErrorCode.BAD_FIELD, f"credit must be at least 1, got {credit}")
            return
        node = Node(
            node_id=node_id,
            identity=identity,
            host=h["host"],
            pid=int(h.get("pid", 0)),
            credit=credit,
            tasks={str(t) for t in h["tasks"]},
        )
        self.nodes[node_id] = node
        self.node_by_identity[identity] = node
        drop = self._claim(node, h.get("running"))
        log.info("node %s registered from %s (credit %d, tasks %s, running %d)", node_id, node.host, credit,
                 sorted(node.tasks), len(node.inflight))
        self._send(
            identity,
            P.reply(h["rid"], heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_liveness=self.config.broker.heartbeat_liveness,
                    drop=drop, boot_id=self.boot_id),
        )

    def _claim(self, node: Node, running: Any) -> list[str]:
        """Give a (re-)registering node back the jobs it still runs; return those it should drop.

        A node claims a job that is queued (its node was declared dead, or this
        broker replayed it from the journal) or already its own. A job that
        ended or runs elsewhere meanwhile is dropped by the node: its result
        would be ignored.
        """
        drop: list[str] = []
        for claim in running if isinstance(running, list) else []:
            job_id = claim.get("job_id") if isinstance(claim, dict) else None
            if not isinstance(job_id, str):
                continue
            job = self.jobs.get(job_id)
            attempt = claim.get("attempt")
            if job is None or job.state.terminal or not isinstance(attempt, int) or job.node_id not in (None, node.node_id):
                drop.append(job_id)
                continue
            if job.node_id is None:
                self.queue.remove(job.spec.task, job_id)
                job.node_id = node.node_id
                if job.spec.attempt != attempt:
                    job.spec.attempt = attempt
                    if self.journal is not None:
                        self.journal.append(attempt_record(job_id, attempt))
            try:
                job.state = JobState(claim.get("stage"))
            except ValueError:
                job.state = JobState.RUN
            if job.state not in P.STAGES:
                job.state = JobState.RUN
            node.inflight.add(job_id)
        if drop:
            log.warning("node %s runs %d job(s) that ended or moved meanwhile; it drops them", node.node_id, len(drop))
        return drop

    def _node_of(self, identity: bytes, h: dict[str, Any]) -> Node | None:
        node = self.node_by_identity.get(identity)
        if node is None or not node.alive:
            # Tell the peer to register again (e.g. after it was declared dead).
            self._send(identity, P.error_reply(h.get("rid"), ErrorCode.UNKNOWN_PEER, "not registered; send register"))
            return None
        return node

    def on_heartbeat(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        if self.router.bridge_heartbeat(identity, h):
            return
        if "backend_id" in h:
            self._send(identity, P.error_reply(h.get("rid"), ErrorCode.UNKNOWN_PEER, "not registered; send register_backend"))
            return
        node = self._node_of(identity, h)
        if node is not None and isinstance(h.get("stages"), dict):
            node.stages = h["stages"]

    def on_unregister(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        node = self.node_by_identity.get(identity)
        if node is not None and node.alive:
            self._node_lost(node, "unregistered")
        self.router.unregister(identity)

    def on_job_stage(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        node = self._node_of(identity, h)
        if node is None:
            return
        for upd in h["updates"]:
            if not isinstance(upd, dict):
                continue
            job = self.jobs.get(upd.get("job_id"))  # type: ignore[arg-type]
            if job is None or job.state.terminal or job.node_id != node.node_id or job.spec.attempt != upd.get("attempt"):
                continue
            try:
                stage = JobState(upd.get("stage"))
            except ValueError:
                continue
            if stage in P.STAGES:
                job.state = stage

    def on_job_done(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        node = self._node_of(identity, h)
        if node is None:
            return
        if len(payload) != len(h["jobs"]):
            self._error(identity, None, ErrorCode.BAD_FIELD, "job_done: job count and result frame count differ")
            return
        for info, result in zip(h["jobs"], payload, strict=True):
            job_id = info.get("job_id") if isinstance(info, dict) else None
            job = self.jobs.get(job_id) if isinstance(job_id, str) else None
            if job is None:
                continue
            node.inflight.discard(job.job_id)
            if job.node_id is None and job.state == JobState.QUEUED and job.spec.attempt == info.get("attempt"):
                # A result sent to the broker before it restarted, for a job it replayed: take it.
                self.queue.remove(job.spec.task, job.job_id)
                job.node_id = node.node_id
            if job.state.terminal or job.node_id != node.node_id or job.spec.attempt != info.get("attempt"):
                continue  # stale: cancelled meanwhile, or re-queued elsewhere
            try:
                state = JobState(info.get("state"))
            except ValueError:
                state = JobState.FAILED
            if not state.terminal:
                state = JobState.FAILED
            self._finish(job, state, bytes(result))

    # ---------------------------------------------------------- inference

    def _live_node(self, identity: bytes) -> Node | None:
        node = self.node_by_identity.get(identity)
        return node if node is not None and node.alive else None

    def _running_node(self, job_id: str) -> str | None:
        """The node a job is placed on while it is unfinished (the router routes only such jobs' calls)."""
        job = self.jobs.get(job_id)
        return job.node_id if job is not None and not job.state.terminal else None

    def on_routing_op(self, identity: bytes, h: dict[str, Any], payload: list[bytes]) -> None:
        """Generate routing, backends, pause/resume: the router's ops."""
        self.router.handlers[h["op"]](identity, h, payload)

    # ---------------------------------------------------------- placement

    def _live_tasks(self) -> set[str]:
        return set().union(*(n.tasks for n in self.nodes.values() if n.alive)) if self.nodes else set()

    def _place(self) -> None:
        if not self.placing or not len(self.queue) or time.monotonic() < self._claims_until:
            return
        nodes = [n for n in self.nodes.values() if n.alive and n.free > 0]
        while nodes and len(self.queue):
            # The node with the most free credit takes the oldest job it can run.
            nodes.sort(key=lambda n: n.free, reverse=True)
            node = nodes[0]
            job_id = self.queue.pop_oldest(node.tasks, self.jobs)
            if job_id is None:
                nodes.pop(0)
                continue
            job = self.jobs[job_id]
            job.node_id = node.node_id
            node.inflight.add(job_id)
            self._assign_out[node.node_id].append(job_id)
            if node.free <= 0:
                nodes.pop(0)

    def _node_lost(self, node: Node, why: str) -> None:
        """Declare a node dead and put its jobs back in the queue with a new attempt."""
        log.warning("node %s lost (%s); re-queueing %d job(s)", node.node_id, why, len(node.inflight))
        node.alive = False
        self.node_by_identity.pop(node.identity, None)
        for job_id in sorted(node.inflight, key=lambda j: self.jobs[j].seq if j in self.jobs else 0):
            job = self.jobs.get(job_id)
            if job is None or job.state.terminal or job.node_id != node.node_id:
                continue
            self.router.job_ended(job_id)  # its old attempt's calls answer nobody
            job.node_id = None
            if job.spec.attempt >= job.spec.max_attempts:
                self._finish_by_broker(
                    job, JobState.FAILED,
                    P.ErrorInfo(stage="node", type="NodeLost", message=f"node {node.node_id} {why}; attempt {job.spec.attempt} of {job.spec.max_attempts}"),
                )
                continue
            job.spec.attempt += 1
            if self.journal is not None:
                self.journal.append(attempt_record(job_id, job.spec.attempt))
            job.state = JobState.QUEUED
            self.queue.push(job.spec.task, job_id, front=True)
        node.inflight.clear()

    # ------------------------------------------------------------ finishing

    def _finish(self, job: Job, state: JobState, result: bytes) -> None:
        job.state = state
        job.result = result
        if self.journal is not None:
            self.journal.append(end_record(job.job_id, state, result))
        self.router.job_ended(job.job_id)
        for w in job.watchers:
            self._results_out[w].append(job.job_id)
        self.finished.append(job.job_id)
        retention = self.config.broker.result_retention
        while len(self.finished) > retention:
            old = self.finished.popleft()
            self.jobs.pop(old, None)

    def _finish_by_broker(self, job: Job, state: JobState, error: P.ErrorInfo | None) -> None:
        """Finish a job that no node will report on (cancelled, or lost too often)."""
        result = JobResult(
            job_id=job.job_id,
            task=job.spec.task,
            state=state.value,
            attempt=job.spec.attempt,
            node_id=job.node_id,
            critical_error=error.stage if error else None,
            error=error.to_wire() if error else None,
        )
        self._finish(job, state, P.pack_obj(result.to_wire()))

    # ------------------------------------------------------------ liveness

    def _tick(self) -> None:
        now = time.monotonic()
        self._next_tick = now + self.heartbeat_interval_s / 2
        for node in list(self.nodes.values()):
            if not node.alive:
                continue
            if now - node.last_seen > self.dead_after_s:
                self._node_lost(node, f"silent for {now - node.last_seen:.1f} s")
            else:
                self._send(node.identity, {"op": Op.HEARTBEAT.value})
        self.router.tick(now)
        self._place()
        self._flush()

    _handlers: dict[Op, Any] = {
        Op.SUBMIT: on_submit,
        Op.WATCH: on_watch,
        Op.CANCEL: on_cancel,
        Op.STATUS: on_status,
        Op.PING: on_ping,
        Op.START: on_start,
        Op.HOLD: on_hold,
        Op.STOP: on_stop,
        Op.REGISTER: on_register,
        Op.HEARTBEAT: on_heartbeat,
        Op.UNREGISTER: on_unregister,
        Op.JOB_STAGE: on_job_stage,
        Op.JOB_DONE: on_job_done,
        Op.REGISTER_BACKEND: on_routing_op,
        Op.ADD_LLM_SERVER: on_routing_op,
        Op.CLEAR_LLM_SERVER: on_routing_op,
        Op.LIST_LLM_SERVERS: on_routing_op,
        Op.PAUSE_GENERATION: on_routing_op,
        Op.RESUME_GENERATION: on_routing_op,
        Op.GENERATE: on_routing_op,
        Op.GENERATE_REPLY: on_routing_op,
        Op.GENERATE_DONE: on_routing_op,
        Op.GENERATE_CANCEL: on_routing_op,
    }
