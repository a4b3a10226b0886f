"""Generate routing: which inference backend serves each model call of a job.

The broker's loop owns one :class:`Router`. It hands the router the
generate-related ops (``generate``, ``generate_reply``, ``generate_done``,
``generate_cancel``, backend registration, ``add/clear/list_llm_server``,
``pause/resume_generation``, ``update_weights``), tells it when a job ends or loses its node
(:meth:`Router.job_ended`, the seam with the job table), and calls
:meth:`Router.tick` for bridge liveness. The router sends through the
function it was given and asks the broker only two things: which node a
peer is, and which node a job runs on.

A backend's in-flight count is computed from the calls the router holds
for it (forwarded to a bridge, or redirected to an HTTP backend and not yet
reported done); nothing is counted by hand. The policy that picks a backend
is a named choice (``broker.routing_policy``):

- ``least_loaded_sticky`` (default): a job's first call goes to the live
  backend with the fewest live jobs, then fewest in-flight calls, then on
  the requesting node's host; its later calls follow it there.
- ``round_robin``: every call goes to the next backend in turn (no
  stickiness: a multi-turn job's prefix cache is lost on every hop).
- ``ever_assigned``: the paper's server: sticky, and a new job goes to the
  backend that was ever assigned the fewest jobs (a count never decremented).

With a sticky policy, a new job's first call also passes KV-cache admission
(:mod:`prorl_cli.broker.admission`, ``broker.kv_admission``): it goes only to
a backend whose live jobs' contexts leave room for it in the KV cache the
backend reports, and waits at the broker while none has room.
"""

from __future__ import annotations

import abc
import itertools
import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prorl_cli import protocol as P
from prorl_cli.broker.admission import KvAdmission, WaitingCall, call_tokens
from prorl_cli.exceptions import ConfigError
from prorl_cli.protocol import ErrorCode, Op
from prorl_cli.protocol import headers as H

log = logging.getLogger(__name__)

#: ``send(identity, header, payload) -> bool``: False when the peer is gone.
SendFn = Callable[[bytes, dict[str, Any], "list[bytes] | tuple[bytes, ...]"], bool]

ROUTING_POLICIES = ("least_loaded_sticky", "round_robin", "ever_assigned")


class NodeLike(Protocol):
    """What the router needs to know of a registered node."""

    node_id: str
    host: str


# ---------------------------------------------------------------------- tables


@dataclass
class PendingGenerate:
    """A generate call routed to a backend and not yet over.

    Bridge calls (``redirect`` false) wait for the bridge's ``generate_reply``;
    redirected calls (an HTTP backend the node calls itself) wait for the
    node's ``generate_done``.
    """

    requester: bytes
    rid: object
    job_id: str
    backend_id: str
    redirect: bool = False
    #: The policy version current when the call went to its backend (the weights that serve it).
    policy_version: int = 0
    #: When it went to its backend (monotonic s): a drain that times out says how long each call ran.
    since: float = field(default_factory=time.monotonic)


class PendingGenerates:
    """Routed calls by call id, indexed by job and by backend."""

    def __init__(self) -> None:
        self._by_id: dict[int, PendingGenerate] = {}
        self._by_job: dict[str, set[int]] = {}
        self._by_backend: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, call_id: int, pend: PendingGenerate) -> None:
        self._by_id[call_id] = pend
        self._by_job.setdefault(pend.job_id, set()).add(call_id)
        self._by_backend.setdefault(pend.backend_id, set()).add(call_id)

    def on_backend(self, backend_id: str) -> int:
        """How many calls ``backend_id`` is serving now."""
        return len(self._by_backend.get(backend_id, ()))

    def backend_of(self, call_id: object) -> str | None:
        """The backend a pending call went to (None if no such call is pending)."""
        pend = self._by_id.get(call_id) if isinstance(call_id, int) and not isinstance(call_id, bool) else None
        return pend.backend_id if pend is not None else None

    def pop(self, call_id: object) -> PendingGenerate | None:
        pend = self._by_id.pop(call_id, None) if isinstance(call_id, int) and not isinstance(call_id, bool) else None
        if pend is None:
            return None
        for index, key in ((self._by_job, pend.job_id), (self._by_backend, pend.backend_id)):
            ids = index[key]
            ids.discard(call_id)
            if not ids:
                del index[key]
        return pend

    def find(self, job_id: str, match: Callable[[PendingGenerate], bool]) -> list[int]:
        """Call ids of ``job_id`` whose record ``match``es, oldest first."""
        return sorted(c for c in self._by_job.get(job_id, ()) if match(self._by_id[c]))

    def pop_job(self, job_id: str) -> list[tuple[int, PendingGenerate]]:
        """Remove and return every call of ``job_id``."""
        return [(c, pend) for c in sorted(self._by_job.get(job_id, ())) if (pend := self.pop(c)) is not None]

    def pop_backend(self, backend_id: str) -> list[tuple[int, PendingGenerate]]:
        """Remove and return every call routed to ``backend_id``."""
        return [(c, pend) for c in sorted(self._by_backend.get(backend_id, ())) if (pend := self.pop(c)) is not None]

    def items(self) -> list[tuple[int, PendingGenerate]]:
        """Every pending call, oldest first."""
        return sorted(self._by_id.items())

    def pop_all(self) -> list[tuple[int, PendingGenerate]]:
        out = sorted(self._by_id.items())
        self._by_id.clear()
        self._by_job.clear()
        self._by_backend.clear()
        return out


@dataclass
class HeldGenerate:
    """A generate call held while generation is paused or no backend is up."""

    requester: bytes
    header: H.Generate
    payload: list[bytes]

    @property
    def job_id(self) -> str:
        return self.header.job_id


class HeldGenerates:
    """Held calls in arrival order, indexed by job (a job that ends drops its own in O(its calls))."""

    def __init__(self) -> None:
        self._by_id: dict[int, HeldGenerate] = {}  # insertion order is arrival order
        self._by_job: dict[str, set[int]] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, item: HeldGenerate) -> None:
        hid = next(self._ids)
        self._by_id[hid] = item
        self._by_job.setdefault(item.job_id, set()).add(hid)

    def pop_job(self, job_id: str, match: Callable[[HeldGenerate], bool] | None = None) -> list[HeldGenerate]:
        hids = sorted(self._by_job.get(job_id, ()))
        out = []
        for hid in hids:
            item = self._by_id[hid]
            if match is None or match(item):
                del self._by_id[hid]
                self._by_job[job_id].discard(hid)
                out.append(item)
        if not self._by_job.get(job_id, True):
            del self._by_job[job_id]
        return out

    def pop_all(self) -> list[HeldGenerate]:
        out = list(self._by_id.values())
        self._by_id.clear()
        self._by_job.clear()
        return out


@dataclass
class Waiter:
    """A client waiting for an answer that the router gives later (a drain, a weight update)."""

    identity: bytes
    rid: object
    deadline: float


@dataclass
class WeightUpdate:
    """An ``update_weights`` forwarded to bridges: answered once each has loaded (or failed, or went away)."""

    waiter: Waiter
    policy_version: int
    #: Forward id -> backend id of the bridges that have not answered yet.
    waiting: dict[int, str] = field(default_factory=dict)
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    #: HTTP backends (``backends add``): the broker cannot reload them.
    skipped: list[str] = field(default_factory=list)


@dataclass
class Backend:
    """An inference backend: a bridge peer (``identity``) or a plain HTTP address (``url``)."""

    backend_id: str
    kind: str  # "bridge" | "http"
    identity: bytes | None = None
    url: str | None = None
    host: str | None = None
    model: str | None = None
    max_model_len: int | None = None
    capacity: int = 0
    jobs: set[str] = field(default_factory=set)  # live jobs routed here (sticky policies)
    #: Jobs ever routed here; never decremented (the ``ever_assigned`` policy's count).
    assigned: int = 0
    served: int = 0
    cleared: bool = False
    alive: bool = True
    last_seen: float = 0.0
    #: The bridge's engine figures from its last heartbeat (the sim engine: busy fraction, tokens/s, hit rate).
    stats: dict[str, float] = field(default_factory=dict)

    def status(self, inflight: int) -> P.BackendStatus:
        return P.BackendStatus(
            backend_id=self.backend_id,
            kind=self.kind,
            url=self.url,
            host=self.host,
            model=self.model,
            max_model_len=self.max_model_len,
            inflight=inflight,
            jobs=len(self.jobs),
            served=self.served,
            cleared=self.cleared,
            alive=self.alive,
            stats=dict(self.stats),
        )


# ---------------------------------------------------------------------- policies


class RoutingPolicy(abc.ABC):
    """Picks a backend for a job's call among live, uncleared ``candidates`` (never empty)."""

    #: Whether a job's later calls follow its first one.
    sticky = True

    def __init__(self, inflight: Callable[[Backend], int]) -> None:
        self.inflight = inflight

    @abc.abstractmethod
    def choose(self, candidates: list[Backend], host: str | None) -> Backend:
        """The backend for a new job (sticky policies) or for this call (others)."""


class LeastLoadedSticky(RoutingPolicy):
    """Fewest live jobs, then fewest in-flight calls, then same host, then fewest served."""

    def choose(self, candidates: list[Backend], host: str | None) -> Backend:
        def key(b: Backend) -> tuple[int, int, int, int]:
            return (len(b.jobs), self.inflight(b), 0 if host and host == b.host else 1, b.served)

        return min(candidates, key=key)


class RoundRobin(RoutingPolicy):
    """Each call to the next backend in turn, whatever job it belongs to."""

    sticky = False

    def __init__(self, inflight: Callable[[Backend], int]) -> None:
        super().__init__(inflight)
        self._turn = 0

    def choose(self, candidates: list[Backend], host: str | None) -> Backend:
        backend = candidates[self._turn % len(candidates)]
        self._turn += 1
        return backend


class EverAssigned(RoutingPolicy):
    """The paper's server: the backend ever assigned the fewest jobs (first registered on a tie)."""

    def choose(self, candidates: list[Backend], host: str | None) -> Backend:
        return min(candidates, key=lambda b: b.assigned)


POLICY_CLASSES: dict[str, type[RoutingPolicy]] = {
    "least_loaded_sticky": LeastLoadedSticky,
    "round_robin": RoundRobin,
    "ever_assigned": EverAssigned,
}


# ---------------------------------------------------------------------- the router


class Router:
    """Routes generate calls of running jobs to backends; one per broker, driven by its loop.

    ``send(identity, header, payload) -> bool`` sends one message;
    ``node_of(identity)`` is the live registered node behind a peer (or None);
    ``running_node(job_id)`` is the node id a job is placed on while it is
    not finished (None for unknown, queued-unplaced and finished jobs).
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
        self.backend_by_identity: dict[bytes, Backend] = {}
        self.sticky: dict[str, str] = {}  # job id -> backend id
        self.pending = PendingGenerates()
        self.held = HeldGenerates()
        #: New jobs' first calls waiting for KV room on a backend (sticky policies only).
        self.admission = KvAdmission(kv_admission if POLICY_CLASSES[policy].sticky else 0.0, kv_admission_max_wait_s)
        self._call_ids = itertools.count(1)
        self.paused = False
        #: The trainer's policy (weights) version, set by pause/resume; 0 until told.
        self.policy_version = 0
        self.stopping = False
        #: Clients waiting for in-flight calls to drain (``pause_generation`` with ``drain_timeout_s``).
        self.drains: list[Waiter] = []
        #: Weight updates waiting for their bridges, and forward id -> its update.
        self.updates: list[WeightUpdate] = []
        self._update_of: dict[int, WeightUpdate] = {}
        self.handlers: dict[Op, Callable[[bytes, Any, list[bytes]], None]] = {
            Op.REGISTER_BACKEND: self.on_register_backend,
            Op.ADD_LLM_SERVER: self.on_add_llm_server,
            Op.CLEAR_LLM_SERVER: self.on_clear_llm_server,
            Op.LIST_LLM_SERVERS: self.on_list_llm_servers,
            Op.PAUSE_GENERATION: self.on_pause_generation,
            Op.RESUME_GENERATION: self.on_resume_generation,
            Op.GENERATE: self.on_generate,
            Op.GENERATE_REPLY: self.on_generate_reply,
            Op.GENERATE_DONE: self.on_generate_done,
            Op.GENERATE_CANCEL: self.on_generate_cancel,
            Op.UPDATE_WEIGHTS: self.on_update_weights,
            Op.WEIGHTS_UPDATED: self.on_weights_updated,
        }

    # ------------------------------------------------------------------ queries

    def inflight(self, backend: Backend) -> int:
        """Calls ``backend`` serves now: computed from the calls routed to it."""
        return self.pending.on_backend(backend.backend_id)

    def backend_statuses(self) -> list[P.BackendStatus]:
        return [b.status(self.inflight(b)) for b in self.backends.values()]

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
        self._prune_backends()
        self._admit_waiting()  # its share of KV is free
        if self.drains:
            self.check_waiters()

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
                self._send(backend.identity, {"op": Op.HEARTBEAT.value}, ())

    def unregister(self, identity: bytes) -> None:
        """A bridge said goodbye."""
        backend = self.backend_by_identity.get(identity)
        if backend is not None and backend.alive:
            self._backend_lost(backend, "unregistered")

    def stop(self) -> None:
        """The broker is stopping: answer every call, tell bridges to shut down."""
        self.stopping = True
        for backend in self.backends.values():
            if backend.alive and backend.identity is not None:
                self._send(backend.identity, {"op": Op.SHUTDOWN.value}, ())
        for item in self.held.pop_all():
            self._answer_dropped(item.requester, item.header.rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping")
        for waiting in self.admission.take_all():
            self._answer_dropped(waiting.requester, waiting.header.rid, ErrorCode.SHUTTING_DOWN,
                                 "the broker is stopping")
        for _, pend in self.pending.pop_all():
            if not pend.redirect:
                self._answer_dropped(pend.requester, pend.rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping")
        for w in [*self.drains, *(u.waiter for u in self.updates)]:
            self._answer_dropped(w.identity, w.rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping")
        self.drains, self.updates = [], []
        self._update_of.clear()

    # ------------------------------------------------------------------ backends

    def on_register_backend(self, identity: bytes, h: H.RegisterBackend, payload: list[bytes]) -> None:
        bid = h.backend_id
        capacity = h.capacity or 0
        max_model_len = h.max_model_len
        old = self.backends.get(bid)
        if old is not None and old.alive and old.identity not in (None, identity):
            self._backend_lost(old, "re-registered from a new connection")
        backend = Backend(
            backend_id=bid, kind="bridge", identity=identity, host=h.host, model=h.model,
            max_model_len=max_model_len, capacity=capacity, last_seen=time.monotonic(),
        )
        if old is not None and old.alive and old.identity == identity:
            # The same bridge registering again (it thought us dead): its calls and jobs stay.
            backend.jobs, backend.assigned, backend.served = old.jobs, old.assigned, old.served
        self.backends[bid] = backend
        self.backend_by_identity[identity] = backend
        log.info("backend %s registered (model %s on %s)", bid, backend.model, backend.host)
        self._send(
            identity,
            P.reply(h.rid, heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_liveness=self.heartbeat_liveness,
                    **self.register_reply_fields),
            (),
        )
        self._release_held()
        self._admit_waiting()

    def on_add_llm_server(self, identity: bytes, h: H.AddLlmServer, payload: list[bytes]) -> None:
        url = h.url.rstrip("/")
        model = h.model
        backend = self.backends.get(url)
        if backend is None or not backend.alive:
            host = urllib.parse.urlsplit(url).hostname or url  # the schema checked it has one
            backend = Backend(backend_id=url, kind="http", url=url, host=host, model=model)
            self.backends[url] = backend
        backend.cleared = False
        self._send(identity, P.reply(h.rid, backend=backend.status(self.inflight(backend)).to_wire()), ())
        self._release_held()

    def on_clear_llm_server(self, identity: bytes, h: H.ClearLlmServer, payload: list[bytes]) -> None:
        url = h.url
        targets = [b for b in self.backends.values() if url is None or b.backend_id == url.rstrip("/")]
        if url is not None and not targets:
            self._reply_error(identity, h.rid, ErrorCode.BAD_FIELD, f"no backend {url!r}")
            return
        for b in targets:
            b.cleared = True  # no new jobs; jobs already routed here keep it
        self._prune_backends()
        self._send(identity, P.reply(h.rid, cleared=[b.backend_id for b in targets]), ())

    def on_list_llm_servers(self, identity: bytes, h: H.Request, payload: list[bytes]) -> None:
        self._send(identity, P.reply(h.rid, backends=[s.to_wire() for s in self.backend_statuses()]), ())

    def _prune_backends(self) -> None:
        """Drop cleared HTTP backends that no job and no call uses any more."""
        for b in [b for b in self.backends.values() if b.kind == "http" and b.cleared and not b.jobs and not self.inflight(b)]:
            del self.backends[b.backend_id]

    def _backend_lost(self, backend: Backend, why: str) -> None:
        log.warning("backend %s lost: %s", backend.backend_id, why)
        backend.alive = False
        if backend.identity is not None:
            self.backend_by_identity.pop(backend.identity, None)
        for _, pend in self.pending.pop_backend(backend.backend_id):
            if not pend.redirect:
                self._answer_dropped(pend.requester, pend.rid, ErrorCode.BACKEND_ERROR, f"backend {backend.backend_id} {why}",
                                     backend_id=backend.backend_id)
        for job_id in backend.jobs:
            self.sticky.pop(job_id, None)
        backend.jobs.clear()
        if self.stopping or backend.kind == "bridge":
            self.backends.pop(backend.backend_id, None)
        self._update_backend_lost(backend.backend_id)
        if self.drains:
            self.check_waiters()

    # ------------------------------------------------------------------ pause / resume

    def _set_policy_version(self, h: H.PauseGeneration | H.ResumeGeneration) -> None:
        if h.policy_version is not None:
            self.policy_version = h.policy_version

    def on_pause_generation(self, identity: bytes, h: H.PauseGeneration, payload: list[bytes]) -> None:
        self._set_policy_version(h)
        self.paused = True
        wait_s = h.drain_timeout_s
        if wait_s is not None and len(self.pending):
            # A pause that drains: answered once no call is in flight on any backend, or at the deadline.
            self.drains.append(Waiter(identity, h.rid, time.monotonic() + float(wait_s)))
            return
        self._send(identity, P.reply(h.rid, paused=True, inflight=len(self.pending), policy_version=self.policy_version,
                                     drained=not len(self.pending)), ())

    def on_resume_generation(self, identity: bytes, h: H.ResumeGeneration, payload: list[bytes]) -> None:
        self._set_policy_version(h)
        self.paused = False
        for w in self.drains:
            self._send(w.identity, P.error_reply(w.rid, ErrorCode.DRAIN_TIMEOUT, "generation was resumed before the calls "
                                                 "in flight drained: " + self._running_calls_text(),
                                                 running=self._running_calls()), ())
        self.drains = []
        self._send(identity, P.reply(h.rid, paused=False, released=len(self.held), policy_version=self.policy_version), ())
        self._release_held()

    def _running_calls(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"job_id": p.job_id, "backend_id": p.backend_id, "running_s": round(now - p.since, 3)}
                for _, p in self.pending.items()]

    def _running_calls_text(self, limit: int = 20) -> str:
        calls = self._running_calls()
        text = ", ".join(f"job {c['job_id']} on {c['backend_id']} ({c['running_s']:.1f} s)" for c in calls[:limit])
        return text + (f" and {len(calls) - limit} more" if len(calls) > limit else "")

    def check_waiters(self, now: float | None = None) -> None:
        """Answer drains that are over (nothing in flight) or out of time, and weight updates out of time."""
        now = time.monotonic() if now is None else now
        if self.drains:
            keep = []
            for w in self.drains:
                if not len(self.pending):
                    self._send(w.identity, P.reply(w.rid, paused=self.paused, inflight=0, drained=True,
                                                   policy_version=self.policy_version), ())
                elif now >= w.deadline:
                    n = len(self.pending)
                    self._send(w.identity, P.error_reply(
                        w.rid, ErrorCode.DRAIN_TIMEOUT,
                        f"{n} generate call(s) still in flight (generation stays paused): {self._running_calls_text()}",
                        running=self._running_calls()), ())
                else:
                    keep.append(w)
            self.drains = keep
        for update in [u for u in self.updates if now >= u.waiter.deadline]:
            for fid, bid in list(update.waiting.items()):
                update.failed[bid] = "did not answer in time"
                self._update_of.pop(fid, None)
            update.waiting.clear()
            self._finish_update(update)

    # ------------------------------------------------------------------ weight updates

    def on_update_weights(self, identity: bytes, h: H.UpdateWeights, payload: list[bytes]) -> None:
        """Forward the new weights to every live bridge; answer once each one has loaded them (or failed)."""
        version = h.policy_version
        timeout_s = float(h.load_timeout_s or 600.0)
        update = WeightUpdate(Waiter(identity, h.rid, time.monotonic() + timeout_s), version)
        for b in self.backends.values():
            if not b.alive:
                continue
            if b.kind != "bridge" or b.identity is None:
                update.skipped.append(b.backend_id)
                continue
            fid = next(self._call_ids)
            header = {"op": Op.UPDATE_WEIGHTS.value, "rid": fid, "checkpoint": h.checkpoint, "policy_version": version}
            if self._send(b.identity, header, ()):
                update.waiting[fid] = b.backend_id
                self._update_of[fid] = update
            else:
                update.failed[b.backend_id] = "unreachable"
        self.updates.append(update)
        if not update.waiting:
            self._finish_update(update)

    def on_weights_updated(self, identity: bytes, h: H.WeightsUpdated, payload: list[bytes]) -> None:
        backend = self.backend_by_identity.get(identity)
        if backend is None or not backend.alive:
            self._reply_error(identity, h.rid, ErrorCode.UNKNOWN_PEER, "not registered; send register_backend")
            return
        fid = h.rid
        if not isinstance(fid, int):
            return  # the broker's forward ids are integers: not an answer to one of its updates
        update = self._update_of.get(fid)
        if update is None or update.waiting.get(fid) != backend.backend_id:
            return  # an update that timed out already (or another bridge's)
        del self._update_of[fid]
        del update.waiting[fid]
        if h.error:
            update.failed[backend.backend_id] = str(h.error["message"])
        else:
            update.updated.append(backend.backend_id)
        if not update.waiting:
            self._finish_update(update)

    def _update_backend_lost(self, backend_id: str) -> None:
        for update in list(self.updates):
            for fid, bid in list(update.waiting.items()):
                if bid == backend_id:
                    del update.waiting[fid]
                    self._update_of.pop(fid, None)
                    update.failed[bid] = "backend lost while loading"
            if not update.waiting:
                self._finish_update(update)

    def _finish_update(self, update: WeightUpdate) -> None:
        if update in self.updates:
            self.updates.remove(update)
        w = update.waiter
        fields = {"updated": update.updated, "skipped": update.skipped, "failed": update.failed,
                  "policy_version": update.policy_version}
        if update.failed:
            why = "; ".join(f"{bid}: {msg}" for bid, msg in sorted(update.failed.items()))
            self._send(w.identity, P.error_reply(w.rid, ErrorCode.RELOAD_FAILED,
                                                 f"{len(update.failed)} backend(s) did not load the new weights: {why}",
                                                 **fields), ())
            return
        # Calls routed from now on go to the new weights (a bridge also stamps each reply with its own version).
        self.policy_version = max(self.policy_version, update.policy_version)
        self._send(w.identity, P.reply(w.rid, **fields), ())

    def _release_held(self) -> None:
        if self.paused or not len(self.held) or not self._candidates():
            return
        for item in self.held.pop_all():
            self._tell_held(item, held=False)
            self._route_call(item.requester, item.header, item.payload)

    def _hold(self, identity: bytes, h: H.Generate, payload: list[bytes]) -> None:
        """Hold a call, and tell its node (whose clocks of that job stand still while it is held)."""
        item = HeldGenerate(identity, h, list(payload))
        self.held.add(item)
        self._tell_held(item, held=True)

    def _tell_held(self, item: HeldGenerate, *, held: bool) -> None:
        self._send(item.requester, {"op": Op.GENERATE_HELD.value, "rid": item.header.rid, "job_id": item.job_id, "held": held}, ())

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
        return [b for b in self.backends.values() if b.alive and not b.cleared]

    def _route_call(
        self, identity: bytes, h: H.Generate, payload: list[bytes], running: bool = False,
        waiting_since: float | None = None,
    ) -> None:
        """Send one validated call to its backend, or hold it (paused, no backend up, or no KV room for a new job).

        ``running``: the caller has just checked that the job runs (else it is checked here).
        ``waiting_since``: a first call coming back from the admission queue (when it started waiting).
        """
        job_id = h.job_id
        if self.paused:
            self._hold(identity, h, payload)
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
                self.admission.wait(WaitingCall(waiting_since or now, identity, h, list(payload)))
                return
        backend = self._route(job_id, identity, h.host, running, tokens)
        if backend is None:
            # Nothing registered yet: hold until a backend appears.
            self._hold(identity, h, payload)
            return
        if self.admission.enabled and running:
            self.admission.note(job_id, backend.backend_id, tokens)
        call_id = next(self._call_ids)
        if backend.kind == "http":
            self.pending.add(call_id, PendingGenerate(identity, h.rid, job_id, backend.backend_id, True, self.policy_version))
            self._send(identity, P.reply(h.rid, redirect=backend.url, backend_id=backend.backend_id,
                                         policy_version=self.policy_version), ())
            return
        header = {"op": Op.GENERATE.value, "rid": call_id, "job_id": job_id,
                  "sampling": h.sampling.to_wire() if h.sampling is not None else {}}
        if backend.identity is None or not self._send(backend.identity, header, payload):
            self._backend_lost(backend, "unreachable")
            self._reply_error(identity, h.rid, ErrorCode.BACKEND_ERROR, f"backend {backend.backend_id} is unreachable")
            return
        self.pending.add(call_id, PendingGenerate(identity, h.rid, job_id, backend.backend_id, False, self.policy_version))

    def _route(self, job_id: str, requester: bytes, host: str | None, running: bool, tokens: int = 0) -> Backend | None:
        if self.policy.sticky:
            bid = self.sticky.get(job_id)
            if bid is not None:
                backend = self.backends.get(bid)
                if backend is not None and backend.alive:
                    return backend
                self.sticky.pop(job_id, None)
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
        if not len(self.admission) or self.paused:
            return
        blocked = False
        for call in self.admission.take_all():
            if blocked:
                self.admission.wait(call)
                continue
            before = len(self.admission)
            self._route_call(call.requester, call.header, call.payload, waiting_since=call.since)
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
                    **({"engine_s": h.engine_s} if h.engine_s is not None else {})),
            payload,
        )
        self._prune_backends_if_cleared(backend)
        if self.drains:
            self.check_waiters()

    def on_generate_done(self, identity: bytes, h: H.GenerateDone, payload: list[bytes]) -> None:
        if self._node_of(identity) is None:
            self._reply_error(identity, None, ErrorCode.UNKNOWN_PEER, "not registered; send register")
            return
        job_id, backend_id = h.job_id, h.backend_id
        calls = self.pending.find(job_id, lambda p: p.redirect and p.backend_id == backend_id and p.requester == identity)
        if not calls:
            return  # the job ended (or the backend went) meanwhile
        self.pending.pop(calls[0])
        backend = self.backends.get(backend_id)
        if backend is not None:
            backend.served += 1
            self._prune_backends_if_cleared(backend)
        if self.drains:
            self.check_waiters()

    def _prune_backends_if_cleared(self, backend: Backend) -> None:
        if backend.cleared:
            self._prune_backends()

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
        for call_id in self.pending.find(job_id, lambda p: p.requester == identity and p.rid == rid):
            pend = self.pending.pop(call_id)
            if pend is not None:
                self._stop_call(call_id, pend, ErrorCode.UNKNOWN_JOB, "the node gave up on this call")
        self._prune_backends()
        if self.drains:
            self.check_waiters()

    # ------------------------------------------------------------------ answering

    def _stop_call(self, call_id: int, pend: PendingGenerate, code: ErrorCode, message: str) -> None:
        """A routed call is dropped: stop it at its bridge's engine and answer its requester."""
        if pend.redirect:
            return  # the node calls that HTTP backend itself, and was answered (redirect) already
        backend = self.backends.get(pend.backend_id)
        if backend is not None and backend.alive and backend.identity is not None:
            self._send(backend.identity, {"op": Op.GENERATE_CANCEL.value, "rid": call_id, "job_id": pend.job_id}, ())
        self._answer_dropped(pend.requester, pend.rid, code, message, backend_id=pend.backend_id)

    def _answer_dropped(self, requester: bytes, rid: object, code: ErrorCode, message: str, **fields: Any) -> None:
        """A call the broker drops is answered at once, so its node never waits out its timeout."""
        log.debug("generate %r of %r dropped: %s", rid, requester, message)
        self._send(requester, P.error_reply(rid, code, message, **fields), ())

    def _reply_error(self, identity: bytes, rid: object, code: ErrorCode, message: str) -> None:
        log.warning("error to %r (rid %r): %s: %s", identity, rid, code.value, message)
        self._send(identity, P.error_reply(rid, code, message), ())
