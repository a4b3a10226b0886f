"""Generate routing: which inference backend serves each model call of a job.

The broker's loop owns one :class:`Router` and hands it the generate ops
(``generate``, ``generate_reply``, ``generate_done``, ``generate_cancel``),
the backend ops (``register_backend``; ``add/clear/list_llm_server`` through
``broker/http_servers.py``) and
the weight-sync ops of its :class:`~prorl_cli.broker.weights.WeightSync`.
It tells the router when a job ends or loses its node (:meth:`Router.job_ended`,
the seam with the job table) and calls :meth:`Router.tick` for bridge
liveness. The router sends through the function it was given and asks the
broker only two things: which node a peer is, and which node a job runs on.

Rules: a call is routed only for a job placed on the requesting node and not
finished; every call the router drops is answered at once. Its calls live in
the tables of ``broker/calls.py``, and a backend's in-flight count is computed
from them, never counted by hand. The backends and the named policies that
pick one (``broker.routing_policy``) are in ``broker/backends.py``. With a
sticky policy, a new job's first call also passes KV-cache admission
(``broker/admission.py``, ``broker.kv_admission``): it waits at the broker
while no backend's KV cache has room for it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.broker.admission import KvAdmission, WaitingCall, call_tokens
from prorl_cli.broker.backends import POLICY_CLASSES, Backend, GoneBridges
from prorl_cli.broker.calls import HeldGenerate, HeldGenerates, PendingGenerate, PendingGenerates
from prorl_cli.broker.http_servers import HttpServers
from prorl_cli.broker.state import SendFn
from prorl_cli.broker.weights import WeightSync
from prorl_cli.exceptions import ConfigError
from prorl_cli.protocol import ErrorCode, Op, SamplingParams
from prorl_cli.protocol import headers as H
from prorl_cli.protocol.records import NODE_LEFT as LEFT  # a planned exit, for bridges as for nodes

log = logging.getLogger(__name__)


class NodeLike(Protocol):
    """What the router needs to know of a registered node."""

    node_id: str
    host: str


#: Backends lost under one call before it is answered ``backend_error`` instead of routed again: a crash or a
#: lost machine is rarely the call's doing, and a prompt that does kill engines takes at most this many more.
LOST_MOVES_MAX = 1


class Router:
    """Routes generate calls of running jobs to backends; one per broker, driven by its loop.

    ``send(identity, header, payload) -> bool`` sends one message;
    ``node_of(identity)`` is the live registered node behind a peer (or None);
    ``running_node(job_id)`` is the node id a job is placed on while it is
    not finished (None for unknown, queued-unplaced and finished jobs);
    ``record_weights(record)`` writes new current weights where a restarted broker finds them.
    """

    def __init__(
        self,
        send: SendFn,
        node_of: Callable[[bytes], NodeLike | None],
        running_node: Callable[[str], str | None],
        *,
        policy: str = "least_loaded_sticky",
        cancel_propagation: bool = True,
        heartbeat_interval_s: float,
        heartbeat_liveness: int,
        register_reply_fields: dict[str, Any] | None = None,
        kv_admission: float = 0.0,
        kv_admission_max_wait_s: float = 120.0,
        record_weights: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if policy not in POLICY_CLASSES:
            raise ConfigError(f"broker.routing_policy: {policy!r} is not one of {list(POLICY_CLASSES)}")
        self._send = send
        self._node_of = node_of
        self._running_node = running_node
        self.policy_name = policy
        self.policy = POLICY_CLASSES[policy](self.inflight)
        self.cancel_propagation = cancel_propagation
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_liveness = heartbeat_liveness
        self.dead_after_s = heartbeat_interval_s * heartbeat_liveness
        #: Fields the broker adds to every ``register_backend`` reply (its boot id).
        self.register_reply_fields = register_reply_fields or {}
        self.backends: dict[str, Backend] = {}
        #: Bridges gone and not registered again (a scale-down of a large array lists its last few).
        self.gone = GoneBridges(kept=32)
        self.backend_by_identity: dict[bytes, Backend] = {}
        self.sticky: dict[str, str] = {}  # job id -> backend id
        self.pending = PendingGenerates()
        self.held = HeldGenerates()
        #: New jobs' first calls waiting for KV room on a backend (sticky policies only).
        self.admission = KvAdmission(kv_admission if POLICY_CLASSES[policy].sticky else 0.0, kv_admission_max_wait_s)
        self._call_ids = itertools.count(1)
        self.stopping = False
        #: Pause/resume, drains and weight updates; its ops are reachable here too (``handlers``, ``on_...``).
        self.weights = w = WeightSync(send, self.pending, self.held, self.backends, self.backend_by_identity,
                                      self._call_ids.__next__, self._release_held, self._backend_lost,
                                      record=record_weights)
        #: OpenAI-compatible servers the broker redirects calls to (``add/clear/list_llm_server``).
        self.http = HttpServers(send, self.backends, self.inflight, self.backend_statuses, self._release_held)
        self.on_pause_generation, self.on_resume_generation = w.on_pause_generation, w.on_resume_generation
        self.on_update_weights, self.on_weights_updated = w.on_update_weights, w.on_weights_updated
        self.check_waiters = w.check_waiters
        self.handlers: dict[Op, Callable[[bytes, Any, list[bytes]], None]] = {
            Op.REGISTER_BACKEND: self.on_register_backend,
            **self.http.handlers,
            Op.GENERATE: self.on_generate,
            Op.GENERATE_REPLY: self.on_generate_reply,
            Op.GENERATE_DONE: self.on_generate_done,
            Op.GENERATE_CANCEL: self.on_generate_cancel,
            **w.handlers,
        }

    # ------------------------------------------------------------------ queries

    @property
    def paused(self) -> bool:
        """Generation is paused (new calls are held): the weight sync's state."""
        return self.weights.paused

    @property
    def policy_version(self) -> int:
        """The weights version stamped on calls routed now: the weight sync's state."""
        return self.weights.policy_version

    def inflight(self, backend: Backend) -> int:
        """Calls ``backend`` serves now: computed from the calls routed to it."""
        return self.pending.on_backend(backend.backend_id)

    def backend_statuses(self) -> list[P.BackendStatus]:
        now = timebase.now()
        return [b.status(self.inflight(b), now) for b in self.backends.values()]

    def status_fields(self) -> dict[str, Any]:
        """The router's part of the broker's ``StatusReport``."""
        return {"backends": self.backend_statuses(), "gone_backends": self.gone.statuses(),
                "generation_paused": self.paused, "held_generates": len(self.held),
                "policy_version": self.policy_version, "routing_policy": self.policy_name,
                "weights": self.weights.status()}

    def bridges_alive(self) -> bool:
        return any(b.alive and b.kind == "bridge" for b in self.backends.values())

    def bridge_heartbeat(self, identity: bytes, h: H.Heartbeat) -> bool:
        """A heartbeat from ``identity``: True if it is a live bridge (its engine figures are kept)."""
        backend = self.backend_by_identity.get(identity)
        if backend is None or not backend.alive:
            return False
        if h.stats is not None:
            backend.stats = h.stats
        return True

    def touch(self, identity: bytes, now: float) -> None:
        """A message came from ``identity``: a bridge that sent it is alive."""
        backend = self.backend_by_identity.get(identity)
        if backend is not None:
            backend.last_seen = now

    # ------------------------------------------------------------------ seams with the broker

    def job_ended(self, job_id: str) -> None:
        """``job_id`` finished or lost its node: forget its backend, and stop and answer its calls.

        Each call is stopped at its engine (the bridge cancels it; a node's own
        HTTP call is closed by the node when its job's task is cancelled), and
        its requester is answered with an error at once. With
        ``cancel_propagation`` off (an ablation), the calls are left running:
        the engine still serves them and their replies go to the node, which
        ignores them.
        """
        self._release_sticky(job_id)
        if not self.cancel_propagation:
            self._admit_waiting()
            return
        for item in self.held.pop_job(job_id):
            self._answer_dropped(item.requester, item.header.rid, ErrorCode.UNKNOWN_JOB, f"job {job_id} ended")
        for waiting in self.admission.pop_job(job_id):
            self._answer_dropped(waiting.requester, waiting.header.rid, ErrorCode.UNKNOWN_JOB, f"job {job_id} ended")
        for call_id, pend in self.pending.pop_job(job_id):
            self._stop_call(call_id, pend, ErrorCode.UNKNOWN_JOB, f"job {job_id} ended")
        self.http.prune()
        self._admit_waiting()  # its share of KV is free
        if self.weights.drains:
            self.weights.check_waiters()

    def tick(self, now: float) -> None:
        """Bridge liveness: declare silent bridges lost, heartbeat the others; route first calls waited long enough."""
        if self.admission.overdue():
            self._admit_waiting()
        for backend in list(self.backends.values()):
            if backend.kind != "bridge" or not backend.alive:
                continue
            if now - backend.last_seen > self.dead_after_s:
                self._backend_lost(backend, f"silent for {now - backend.last_seen:.1f} s")
            elif backend.identity is not None:
                self._send(backend.identity, H.Heartbeat().to_wire(), ())

    def unregister(self, identity: bytes, reason: str | None = None) -> None:
        """A bridge said goodbye: it left (a signal, a scale-down, ``down``), or it says what broke (``reason``)."""
        backend = self.backend_by_identity.get(identity)
        if backend is not None and backend.alive:
            self._backend_lost(backend, reason or LEFT, planned=reason is None)

    def stop(self) -> None:
        """The broker is stopping: answer every call, tell bridges to shut down."""
        self.stopping = True
        for backend in self.backends.values():
            if backend.alive and backend.identity is not None:
                self._send(backend.identity, H.Shutdown().to_wire(), ())
        for item in self.held.pop_all():
            self._answer_dropped(item.requester, item.header.rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping")
        for waiting in self.admission.take_all():
            self._answer_dropped(waiting.requester, waiting.header.rid, ErrorCode.SHUTTING_DOWN,
                                 "the broker is stopping")
        for _, pend in self.pending.pop_all():
            if not pend.redirect:
                self._answer_dropped(pend.requester, pend.rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping")
        self.weights.stop()

    # ------------------------------------------------------------------ backends

    def on_register_backend(self, identity: bytes, h: H.RegisterBackend, payload: list[bytes]) -> None:
        if self.stopping:
            # As a node registering now is: told to shut down, not taken on by a broker about to exit (it would
            # register again for ever, and the stop would wait for it until its deadline).
            self._send(identity, H.Shutdown().to_wire(), ())
            return
        bid = h.backend_id
        old = self.backends.get(bid)
        if old is not None and old.alive and old.identity not in (None, identity):
            self._backend_lost(old, "re-registered from a new connection")
        backend = Backend(backend_id=bid, kind="bridge", identity=identity, host=h.host, model=h.model,
                          max_model_len=h.max_model_len, capacity=h.capacity or 0, last_seen=timebase.now())
        if old is not None and old.alive and old.identity == identity:
            # The same bridge registering again (it thought us dead): its calls and jobs stay.
            backend.jobs, backend.assigned, backend.served = old.jobs, old.assigned, old.served
        self.backends[bid] = backend
        self.backend_by_identity[identity] = backend
        self.gone.back(bid)
        log.info("backend %s registered (model %s on %s, policy version %s)", bid, backend.model, backend.host, h.policy_version)
        self._send(identity, P.reply(h.rid, heartbeat_interval_s=self.heartbeat_interval_s,
                                     heartbeat_liveness=self.heartbeat_liveness, **self.register_reply_fields), ())
        self.weights.backend_registered(backend, h.policy_version)  # on other weights: it loads them first
        if backend.loading:
            # No call goes to it before it has loaded them, nor to the jobs it kept (their KV is of the old weights).
            self._release_jobs(backend)
        self._release_held()
        self._admit_waiting()

    def _backend_lost(self, backend: Backend, why: str, *, planned: bool = False) -> None:
        """A backend is gone: forget its jobs, and route its calls again or answer them.

        Each call it had not answered goes to another backend (or is held until one registers), its work so far
        lost but not its job. ``planned``: it left (a signal, a scale-down, a time limit's warning), which is
        never the calls' fault. A backend lost (silent: a crash, its machine gone; unreachable; its engine dead)
        may have been killed by a call: a call goes on after :data:`LOST_MOVES_MAX` such losses, and is then
        answered ``backend_error``, so a prompt that kills engines cannot go on to kill them all.
        """
        calls = self.inflight(backend)
        if self.stopping:
            log.info("backend %s %s; answering its %d call(s) in flight", backend.backend_id, why, calls)
        elif planned:
            log.info("backend %s %s; its %d call(s) in flight go to other backends", backend.backend_id, why, calls)
        else:
            log.warning("backend %s lost: %s; its %d call(s) in flight go to other backends (each once)",
                        backend.backend_id, why, calls)
        backend.alive = False
        if backend.identity is not None:
            self.backend_by_identity.pop(backend.identity, None)
        again: list[tuple[PendingGenerate, H.Generate, int]] = []
        for _, pend in self.pending.pop_backend(backend.backend_id):
            if pend.redirect:
                continue
            moves = pend.moves if planned else pend.moves + 1
            if not self.stopping and pend.request is not None and moves <= LOST_MOVES_MAX:
                again.append((pend, pend.request, moves))
            else:
                self._answer_dropped(pend.requester, pend.rid, ErrorCode.BACKEND_ERROR, f"backend {backend.backend_id} {why}",
                                     backend_id=backend.backend_id)
        self._release_jobs(backend)
        if backend.kind == "bridge":
            # Shown as it is now, serving no call and no job (its calls were answered or run elsewhere).
            self.gone.add(backend.status(0, timebase.now()), why)
        if self.stopping or backend.kind == "bridge":
            self.backends.pop(backend.backend_id, None)
        self.weights.backend_lost(backend.backend_id)
        for pend, request, moves in again:  # after it is unbound from its jobs: none goes back to it
            self._route_call(pend.requester, request, pend.payload, moves=moves)

    def _release_jobs(self, backend: Backend) -> None:
        """``backend`` serves its jobs no more (it went, or it loads other weights): unbind them, free their KV.

        Each job's next call is routed like a first call, through KV admission, to a backend that serves.
        """
        for job_id in backend.jobs:
            if self.sticky.get(job_id) == backend.backend_id:
                del self.sticky[job_id]
        backend.jobs.clear()
        self.admission.forget_backend(backend.backend_id)

    def _release_held(self) -> None:
        if self.weights.paused or not len(self.held) or not self._candidates():
            return
        for item in self.held.pop_all():
            self._tell_held(item, held=False)
            self._route_call(item.requester, item.header, item.payload, moves=item.moves)

    def _hold(self, identity: bytes, h: H.Generate, payload: list[bytes], moves: int = 0) -> None:
        """Hold a call, and tell its node (whose clocks of that job stand still while it is held)."""
        item = HeldGenerate(identity, h, payload, moves)
        self.held.add(item)
        self._tell_held(item, held=True)

    def _tell_held(self, item: HeldGenerate, *, held: bool) -> None:
        self._send(item.requester, H.GenerateHeld(item.header.rid, item.job_id, held).to_wire(), ())

    # ------------------------------------------------------------------ generate

    def on_generate(self, identity: bytes, h: H.Generate, payload: list[bytes]) -> None:
        node = self._node_of(identity)
        if node is None:
            # Nothing is held for a peer the broker does not know.
            self._reply_error(identity, h.rid, ErrorCode.UNKNOWN_PEER, "not registered; send register")
            return
        # The schema checked the fields and that one prompt frame came; its length is the payload's own.
        if len(payload[0]) % 4:
            self._reply_error(identity, h.rid, ErrorCode.BAD_FRAME, "prompt frame is not a whole number of int32")
            return
        if not self._job_runs_on(identity, h, node):
            return
        # ``payload`` is the list its message arrived in and belongs to this call alone: the records that
        # keep the call (pending, held, waiting for KV room) keep that list, never a copy.
        self._route_call(identity, h, payload, running=True)

    def _job_runs_on(self, identity: bytes, h: H.Generate, node: NodeLike) -> bool:
        """Only a job placed on the requesting node, and not finished, may call the model."""
        job_id = h.job_id
        where = self._running_node(job_id)
        if where == node.node_id:
            return True
        why = "is not running" if where is None else f"runs on node {where}, not {node.node_id}"
        self._reply_error(identity, h.rid, ErrorCode.UNKNOWN_JOB, f"job {job_id!r} {why}; its generate call is refused")
        return False

    def _candidates(self) -> list[Backend]:
        """Live, uncleared backends not loading weights; of those, the ones not avoided (resting, or a probe of
        one that rested in flight), unless every one of them is."""
        up = [b for b in self.backends.values() if b.alive and not b.cleared and not b.loading]
        now = timebase.now()
        return [b for b in up if not b.avoided(now, self.inflight(b))] or up

    def _route_call(
        self, identity: bytes, h: H.Generate, payload: list[bytes], running: bool = False,
        waiting_since: float | None = None, moves: int = 0,
    ) -> None:
        """Send one validated call to its backend, or hold it (paused, no backend up, or no KV room for a new job).

        ``running``: the caller has just checked that the job runs (else it is checked here).
        ``waiting_since``: a first call coming back from the admission queue (when it started waiting).
        ``moves``: backends lost under this call so far (it is one of their calls, routed again).
        """
        job_id = h.job_id
        if self.weights.paused:
            self._hold(identity, h, payload, moves)
            return
        running = running or self._running_node(job_id) is not None
        if not running and self.cancel_propagation:
            # Held while its job ended (a node that lost the job meanwhile): answer, never route.
            self._answer_dropped(identity, h.rid, ErrorCode.UNKNOWN_JOB, f"job {job_id} ended")
            return
        tokens = call_tokens(h, payload)
        if self.admission.enabled and running and job_id not in self.sticky:
            now = self.admission.clock()
            overdue = waiting_since is not None and now - waiting_since >= self.admission.max_wait_s
            candidates = self._candidates()
            if candidates and not overdue and not any(
                self.admission.has_room(b.backend_id, b.stats, tokens) for b in candidates
            ):
                self.admission.wait(WaitingCall(waiting_since or now, identity, h, payload, moves))
                return
        backend = self._route(job_id, identity, h.host, running, tokens)
        if backend is None:
            # Nothing registered yet: hold until a backend appears.
            self._hold(identity, h, payload, moves)
            return
        if self.admission.enabled and running:
            self.admission.note(job_id, backend.backend_id, tokens)
        call_id = next(self._call_ids)
        if backend.kind == "http":
            self.pending.add(call_id, PendingGenerate(identity, h.rid, job_id, backend.backend_id, True, self.weights.policy_version))
            # The model goes too: a server with several (vLLM serving LoRA adapters) serves the first it lists
            # to a call that names none, not the one ``backends add --model`` named (H.GenerateAnswer).
            model = {"model": backend.model} if backend.model else {}
            self._send(identity, P.reply(h.rid, redirect=backend.url, backend_id=backend.backend_id,
                                         policy_version=self.weights.policy_version, **model), ())
            return
        # Forwarded with the sampling the caller gave (none: an empty map, the engine's defaults).
        sampling = h.sampling if h.sampling is not None else SamplingParams.from_given()
        header = H.Generate(call_id, job_id, sampling).to_wire()
        if backend.identity is None or not self._send(backend.identity, header, payload):
            self._backend_lost(backend, "unreachable")
            if self.stopping:
                self._reply_error(identity, h.rid, ErrorCode.BACKEND_ERROR, f"backend {backend.backend_id} is unreachable")
            else:
                # Never delivered, so it cannot have harmed the backend: it goes on as it came, to another backend
                # or held for the next one (the lost backend is no candidate any more).
                self._route_call(identity, h, payload, running=running, moves=moves)
            return
        self.pending.add(call_id, PendingGenerate(identity, h.rid, job_id, backend.backend_id, False,
                                                  self.weights.policy_version, request=h, payload=payload,
                                                  moves=moves))

    def _route(self, job_id: str, requester: bytes, host: str | None, running: bool, tokens: int = 0) -> Backend | None:
        if self.policy.sticky:
            bid = self.sticky.get(job_id)
            if bid is not None:
                backend = self.backends.get(bid)
                if backend is not None and backend.alive and (
                        not backend.avoided(timebase.now(), self.inflight(backend)) or backend in self._candidates()):
                    return backend  # not avoided, or every backend is: a job keeps its prefix cache
                self.sticky.pop(job_id, None)
                if backend is not None:
                    backend.jobs.discard(job_id)  # moved off a resting backend: its prefix cache is lost, not the job
                    if backend.cleared:
                        self.http.prune()
        candidates = self._candidates()
        if not candidates:
            return None
        if self.admission.enabled and running:
            roomy = [b for b in candidates if self.admission.has_room(b.backend_id, b.stats, tokens)]
            candidates = roomy or candidates  # none: the call waited its longest; the policy's choice
        if host is None:
            node = self._node_of(requester)
            host = node.host if node else None
        backend = self.policy.choose(candidates, host)
        # A call of a finished job (cancel propagation off) runs without binding its job to a backend.
        if self.policy.sticky and running:
            self.sticky[job_id] = backend.backend_id
            backend.jobs.add(job_id)
            backend.assigned += 1
        return backend

    def _admit_waiting(self) -> None:
        """Route the first calls waiting for KV room, oldest first; the rest keep waiting behind one that still fits nowhere."""
        if not len(self.admission) or self.weights.paused:
            return
        blocked = False
        for call in self.admission.take_all():
            if blocked:
                self.admission.wait(call)
                continue
            before = len(self.admission)
            self._route_call(call.requester, call.header, call.payload, waiting_since=call.since, moves=call.moves)
            blocked = len(self.admission) > before

    def _release_sticky(self, job_id: str) -> None:
        self.admission.forget(job_id)
        bid = self.sticky.pop(job_id, None)
        backend = self.backends.get(bid) if bid is not None else None
        if backend is not None:
            backend.jobs.discard(job_id)

    def on_generate_reply(self, identity: bytes, h: H.GenerateReply, payload: list[bytes]) -> None:
        backend = self.backend_by_identity.get(identity)
        if backend is None or not backend.alive:
            self._reply_error(identity, h.rid, ErrorCode.UNKNOWN_PEER, "not registered; send register_backend")
            return
        call_id = h.rid
        if self.pending.backend_of(call_id) != backend.backend_id:
            return  # late reply for a call already failed over or cancelled (or another bridge's call)
        pend = self.pending.pop(call_id)
        assert pend is not None
        backend.served += 1
        if h.error:
            self._send(pend.requester, P.error_reply(pend.rid, h.error["code"], h.error["message"], backend_id=pend.backend_id), ())
            return
        version = h.policy_version
        self._send(
            pend.requester,
            P.reply(pend.rid, backend_id=pend.backend_id, finish_reason=h.finish_reason,
                    policy_version=version if version is not None else pend.policy_version,
                    **({"engine_s": h.engine_s} if h.engine_s is not None else {}),
                    **({"stop_string": h.stop_string} if h.stop_string is not None else {})),
            payload,
        )
        if backend.cleared:
            self.http.prune()
        if self.weights.drains:
            self.weights.check_waiters()

    def on_generate_done(self, identity: bytes, h: H.GenerateDone, payload: list[bytes]) -> None:
        if self._node_of(identity) is None:
            self._reply_error(identity, None, ErrorCode.UNKNOWN_PEER, "not registered; send register")
            return
        job_id, backend_id = h.job_id, h.backend_id
        calls = self.pending.find(job_id, lambda p: p.redirect and p.backend_id == backend_id and p.requester == identity)
        if not calls:
            return  # the job ended (or the backend went) meanwhile
        call = self.pending.pop(calls[0])
        backend = self.backends.get(backend_id)
        if backend is not None and call is not None:
            if h.fault is not None:
                self._note_fault(backend, h.fault, call.since)
            elif not h.abandoned:  # a call its node gave up says nothing of the backend
                backend.served += 1
                if backend.note_answer():
                    log.warning("backend %s answers again: calls go to it as to the others", backend_id)
            if backend.cleared:
                self.http.prune()
        if self.weights.drains:
            self.weights.check_waiters()

    def _note_fault(self, backend: Backend, fault: str, routed_at: float) -> None:
        """A call failed at ``backend``; past a few in a row it rests (``broker/backends.py``), and says so."""
        rest_s = backend.note_fault(fault, timebase.now(), routed_at)
        if rest_s is not None:
            others = sum(1 for b in self._candidates() if b is not backend)
            log.warning("backend %s failed %d calls in a row (last: %s): new calls avoid it for %.0f s%s",
                        backend.backend_id, backend.faults_in_a_row, fault, rest_s,
                        "" if others else "; no other backend is up, so calls still go to it")

    def on_generate_cancel(self, identity: bytes, h: H.GenerateCancel, payload: list[bytes]) -> None:
        """A node gave up on one of its calls (its own timeout, or its job's task was cancelled)."""
        if self._node_of(identity) is None:
            self._reply_error(identity, h.rid, ErrorCode.UNKNOWN_PEER, "not registered; send register")
            return
        if not self.cancel_propagation:
            return  # the ablation: the engine keeps serving the call; its reply goes to the node, which ignores it
        job_id, rid = h.job_id, h.rid
        for item in self.held.pop_job(job_id, lambda it: it.requester == identity and it.header.rid == rid):
            self._answer_dropped(item.requester, rid, ErrorCode.UNKNOWN_JOB, "the node gave up on this call")
        # A first call waiting for KV room (the node timed out first): never routed to an engine afterwards.
        for waiting in self.admission.pop_job(job_id, lambda w: w.requester == identity and w.header.rid == rid):
            self._answer_dropped(waiting.requester, rid, ErrorCode.UNKNOWN_JOB, "the node gave up on this call")
        for call_id in self.pending.find(job_id, lambda p: p.requester == identity and p.rid == rid):
            pend = self.pending.pop(call_id)
            if pend is not None:
                self._stop_call(call_id, pend, ErrorCode.UNKNOWN_JOB, "the node gave up on this call")
        self.http.prune()
        if self.weights.drains:
            self.weights.check_waiters()

    # ------------------------------------------------------------------ answering

    def _stop_call(self, call_id: int, pend: PendingGenerate, code: ErrorCode, message: str) -> None:
        """A routed call is dropped: stop it at its bridge's engine and answer its requester."""
        if pend.redirect:
            return  # the node calls that HTTP backend itself, and was answered (redirect) already
        backend = self.backends.get(pend.backend_id)
        if backend is not None and backend.alive and backend.identity is not None:
            self._send(backend.identity, H.GenerateCancel(call_id, pend.job_id).to_wire(), ())
        self._answer_dropped(pend.requester, pend.rid, code, message, backend_id=pend.backend_id)

    def _answer_dropped(self, requester: bytes, rid: object, code: ErrorCode, message: str, **fields: Any) -> None:
        """A call the broker drops is answered at once, so its node never waits out its timeout."""
        log.debug("generate %r of %r dropped: %s", rid, requester, message)
        self._send(requester, P.error_reply(rid, code, message, **fields), ())

    def _reply_error(self, identity: bytes, rid: object, code: ErrorCode, message: str) -> None:
        log.warning("error to %r (rid %r): %s: %s", identity, rid, code.value, message)
        self._send(identity, P.error_reply(rid, code, message), ())
