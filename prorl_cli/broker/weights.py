"""Weight sync: pausing generation, draining the calls in flight, and reloading the bridges' weights.

The router (``broker/routing.py``) owns one :class:`WeightSync` and hands it
the ops ``pause_generation``, ``resume_generation``, ``update_weights`` and
``weights_updated`` (its ``handlers``). It reads the router's call tables and
backends, never changes them, and sends through the function it was given.
Rules:

- While ``paused``, the router holds every generate call; resume releases
  them (``release_held``). ``policy_version`` is the trainer's weights
  version (0 until told): pause/resume may set it, and a weight update that
  every bridge loaded raises it; the router stamps it on every call it routes.
- A pause with ``drain_timeout_s`` is answered once no call is in flight,
  or at its deadline with the calls still running (generation stays
  paused); a resume before then answers it with ``drain_timeout``. Its
  ``policy_version`` is taken only once the drain is over: a drain that
  times out (or that a resume cut short) leaves the version as it was.
- ``update_weights`` goes to every live bridge (HTTP backends are skipped:
  the broker cannot reload them) and is answered once each one has loaded,
  failed, been lost, or run out of ``load_timeout_s``.
- An update that every bridge loaded (also one answered while no bridge was
  up) becomes the deployment's current weights (:class:`CurrentWeights`);
  ``verified`` says whether any bridge has loaded them yet (an update no
  bridge loaded is not, until the first bridge catches up on it). A
  bridge that registers on other weights (a requeued or preempted bridge
  coming back on its start checkpoint, a new one from a scale-up) is sent
  them first (a catch-up) and is ``loading`` until it has them: no call is
  routed to it meanwhile. One that registers while an update is in flight
  catches up on that update's weights. A bridge that cannot load them (an
  error, or no answer within the update's ``load_timeout_s``) is told to
  shut down and dropped, with a log line saying why: it would serve a policy
  the trainer has left.
- The router calls :meth:`WeightSync.check_waiters` when a call ends while a
  drain waits, :meth:`WeightSync.backend_registered` when a bridge registers
  and :meth:`WeightSync.backend_lost` when a backend goes; the loop calls
  ``check_waiters`` on each tick for the deadlines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.broker.backends import Backend
from prorl_cli.broker.calls import HeldGenerates, PendingGenerates
from prorl_cli.broker.journal import weights_record
from prorl_cli.broker.state import SendFn
from prorl_cli.protocol import ErrorCode, Op
from prorl_cli.protocol import headers as H

log = logging.getLogger(__name__)


@dataclass
class Waiter:
    """A client waiting for an answer that the router gives later (a drain, a weight update)."""

    identity: bytes
    rid: object
    deadline: float
    #: A drain's ``policy_version``, taken once the drain is over: until then the weights have not changed.
    policy_version: int | None = None


@dataclass(frozen=True)
class CurrentWeights:
    """A checkpoint and its policy version: what every bridge serves, or is being sent (an update in flight)."""

    checkpoint: str
    policy_version: int
    #: How long a bridge may take to load them (the update's ``load_timeout_s``).
    load_timeout_s: float
    #: A bridge has loaded them (or registered serving their version). False for an update answered with no bridge
    #: to load it: nothing has shown that the checkpoint loads, until the first bridge catches up on it.
    verified: bool = False


@dataclass
class CatchUp:
    """The current weights sent to one bridge that (re)joined on others; it serves nothing until it answers."""

    backend_id: str
    weights: CurrentWeights
    deadline: float


@dataclass
class WeightUpdate:
    """An ``update_weights`` forwarded to bridges: answered once each has loaded (or failed, or went away)."""

    waiter: Waiter
    policy_version: int
    checkpoint: str = ""
    load_timeout_s: float = 600.0
    #: Forward id -> backend id of the bridges that have not answered yet.
    waiting: dict[int, str] = field(default_factory=dict)
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    #: HTTP backends (``backends add``): the broker cannot reload them.
    skipped: list[str] = field(default_factory=list)


class WeightSync:
    """Pause/resume with drains, and weight updates; one per router.

    ``pending``/``held``: the router's call tables; ``backends`` and
    ``backend_by_identity``: its backends by id and by bridge peer;
    ``next_id()``: a fresh forward id (from the router's call ids);
    ``release_held()``: route the held calls (on resume, and when a bridge has caught up);
    ``drop_backend(backend, why)``: the router forgets a backend (one that cannot load the current weights);
    ``record(record)``: where new current weights are written (the broker's journal, so a restarted broker
    still knows them), before the update is answered.
    """

    def __init__(
        self,
        send: SendFn,
        pending: PendingGenerates,
        held: HeldGenerates,
        backends: dict[str, Backend],
        backend_by_identity: dict[bytes, Backend],
        next_id: Callable[[], int],
        release_held: Callable[[], None],
        drop_backend: Callable[[Backend, str], None],
        record: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._send = send
        self._pending = pending
        self._held = held
        self._backends = backends
        self._backend_by_identity = backend_by_identity
        self._next_id = next_id
        self._release_held = release_held
        self._drop_backend = drop_backend
        self.paused = False
        #: The trainer's policy (weights) version, set by pause/resume; 0 until told.
        self.policy_version = 0
        self._warned_older: int | None = None  # the lower version last warned about (_warn_if_older)
        #: Clients waiting for in-flight calls to drain (``pause_generation`` with ``drain_timeout_s``).
        self.drains: list[Waiter] = []
        #: Weight updates waiting for their bridges, and forward id -> its update.
        self.updates: list[WeightUpdate] = []
        self._update_of: dict[int, WeightUpdate] = {}
        #: The last update every bridge loaded (None until one did): what a (re)joining bridge loads first.
        self.current: CurrentWeights | None = None
        #: Forward id -> the catch-up it carries, for bridges loading the current weights.
        self._catch_ups: dict[int, CatchUp] = {}
        self._record = record
        self.handlers: dict[Op, Callable[[bytes, Any, list[bytes]], None]] = {
            Op.PAUSE_GENERATION: self.on_pause_generation,
            Op.RESUME_GENERATION: self.on_resume_generation,
            Op.UPDATE_WEIGHTS: self.on_update_weights,
            Op.WEIGHTS_UPDATED: self.on_weights_updated,
        }

    # ------------------------------------------------------------------ pause / resume

    def _set_policy_version(self, version: int | None) -> None:
        if version is not None:
            self._warn_if_older(version)
            self.policy_version = version

    def _warn_if_older(self, version: int) -> None:
        """A trainer's versions only grow: a lower one (a resumed run counting from 0 again) makes staleness figures
        and the versions stamped on tokens meaningless, so it is said (once per version)."""
        if version < self.policy_version and version != self._warned_older:
            self._warned_older = version
            log.warning("policy version %d is lower than the current %d: versions should only grow (a trainer resumed "
                        "from a checkpoint passes its step on, not 0); staleness figures across the drop mean nothing",
                        version, self.policy_version)

    def on_pause_generation(self, identity: bytes, h: H.PauseGeneration, payload: list[bytes]) -> None:
        self.paused = True
        wait_s = h.drain_timeout_s
        if wait_s is not None and len(self._pending):
            # A pause that drains: answered once no call is in flight on any backend, or at the deadline. Its
            # version waits for the drain: a trainer told drain_timeout has loaded nothing and may give the step
            # up (resume without a version), and the calls released then must not carry weights never loaded.
            self.drains.append(Waiter(identity, h.rid, timebase.now() + float(wait_s), h.policy_version))
            return
        self._set_policy_version(h.policy_version)
        self._send(identity, P.reply(h.rid, paused=True, inflight=len(self._pending), policy_version=self.policy_version,
                                     drained=not len(self._pending)), ())

    def on_resume_generation(self, identity: bytes, h: H.ResumeGeneration, payload: list[bytes]) -> None:
        self._set_policy_version(h.policy_version)
        self.paused = False
        for w in self.drains:
            self._send(w.identity, P.error_reply(w.rid, ErrorCode.DRAIN_TIMEOUT, "generation was resumed before the calls "
                                                 f"in flight drained (policy version {self.policy_version}): "
                                                 + self._running_calls_text(),
                                                 running=self._running_calls()), ())
        self.drains = []
        self._send(identity, P.reply(h.rid, paused=False, released=len(self._held), policy_version=self.policy_version), ())
        self._release_held()

    def _running_calls(self) -> list[dict[str, Any]]:
        now = timebase.now()
        return [{"job_id": p.job_id, "backend_id": p.backend_id, "running_s": round(now - p.since, 3)}
                for _, p in self._pending.items()]

    def _running_calls_text(self, limit: int = 20) -> str:
        calls = self._running_calls()
        text = ", ".join(f"job {c['job_id']} on {c['backend_id']} ({c['running_s']:.1f} s)" for c in calls[:limit])
        return text + (f" and {len(calls) - limit} more" if len(calls) > limit else "")

    def check_waiters(self, now: float | None = None) -> None:
        """Answer drains that are over (nothing in flight) or out of time, and weight updates out of time."""
        now = timebase.now() if now is None else now
        if self.drains:
            keep = []
            for w in self.drains:
                if not len(self._pending):
                    self._set_policy_version(w.policy_version)
                    self._send(w.identity, P.reply(w.rid, paused=self.paused, inflight=0, drained=True,
                                                   policy_version=self.policy_version), ())
                elif now >= w.deadline:
                    n = len(self._pending)
                    self._send(w.identity, P.error_reply(
                        w.rid, ErrorCode.DRAIN_TIMEOUT,
                        f"{n} generate call(s) still in flight (generation stays paused, policy version stays "
                        f"{self.policy_version}): {self._running_calls_text()}",
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
        for fid, catch_up in list(self._catch_ups.items()):
            # Popped, not deleted: dropping a bridge below also drops its other catch-ups (one that re-registered).
            if now >= catch_up.deadline and self._catch_ups.pop(fid, None) is not None:
                backend = self._backends.get(catch_up.backend_id)
                if backend is not None and backend.alive:
                    self._cannot_load(backend, catch_up.weights, f"no answer within {catch_up.weights.load_timeout_s:g} s")

    # ------------------------------------------------------------------ weight updates

    def on_update_weights(self, identity: bytes, h: H.UpdateWeights, payload: list[bytes]) -> None:
        """Forward the new weights to every live bridge; answer once each one has loaded them (or failed)."""
        version = h.policy_version
        self._warn_if_older(version)
        timeout_s = float(h.load_timeout_s or 600.0)
        update = WeightUpdate(Waiter(identity, h.rid, timebase.now() + timeout_s), version, h.checkpoint, timeout_s)
        for b in self._backends.values():
            if not b.alive:
                continue
            if b.kind != "bridge" or b.identity is None:
                update.skipped.append(b.backend_id)
                continue
            fid = self._next_id()
            header = H.UpdateWeights(fid, h.checkpoint, version).to_wire()
            if self._send(b.identity, header, ()):
                update.waiting[fid] = b.backend_id
                self._update_of[fid] = update
            else:
                update.failed[b.backend_id] = "unreachable"
        self.updates.append(update)
        if not update.waiting and not update.failed:
            # Nothing to try the checkpoint: the next bridge to join must load it, and is told to go if it cannot.
            log.warning("policy version %d (%s) taken unverified, with no bridge up to load it: each bridge that "
                        "joins loads it first", version, h.checkpoint)
        if not update.waiting:
            self._finish_update(update)

    def on_weights_updated(self, identity: bytes, h: H.WeightsUpdated, payload: list[bytes]) -> None:
        backend = self._backend_by_identity.get(identity)
        if backend is None or not backend.alive:
            message = "not registered; send register_backend"
            log.warning("error to %r (rid %r): %s: %s", identity, h.rid, ErrorCode.UNKNOWN_PEER.value, message)
            self._send(identity, P.error_reply(h.rid, ErrorCode.UNKNOWN_PEER, message), ())
            return
        fid = h.rid
        if not isinstance(fid, int):
            return  # the broker's forward ids are integers: not an answer to one of its updates
        catch_up = self._catch_ups.get(fid)
        if catch_up is not None:
            if catch_up.backend_id == backend.backend_id:  # another bridge's answer leaves it waiting for its own
                del self._catch_ups[fid]
                self._caught_up(backend, catch_up, h.error)
            return
        update = self._update_of.get(fid)
        if update is None or update.waiting.get(fid) != backend.backend_id:
            return  # an update that timed out already (or another bridge's)
        del self._update_of[fid]
        del update.waiting[fid]
        if h.error:
            update.failed[backend.backend_id] = str(h.error["message"])
        else:
            update.updated.append(backend.backend_id)
            backend.policy_version = update.policy_version
        if not update.waiting:
            self._finish_update(update)
        if backend.loading:
            self._settle(backend)  # it (re)joined before this update: it caught up through it

    def backend_lost(self, backend_id: str) -> None:
        """A backend went: an update waiting for it counts it failed; a drain may be over (its calls were dropped)."""
        for fid in [fid for fid, c in self._catch_ups.items() if c.backend_id == backend_id]:
            del self._catch_ups[fid]
        for update in list(self.updates):
            for fid, bid in list(update.waiting.items()):
                if bid == backend_id:
                    del update.waiting[fid]
                    self._update_of.pop(fid, None)
                    update.failed[bid] = "backend lost while loading"
            if not update.waiting:
                self._finish_update(update)
        if self.drains:
            self.check_waiters()

    def _finish_update(self, update: WeightUpdate) -> None:
        if update in self.updates:
            self.updates.remove(update)
        w = update.waiter
        fields = {"updated": update.updated, "skipped": update.skipped, "failed": update.failed,
                  "policy_version": update.policy_version}
        if update.failed:
            why = "; ".join(f"{bid}: {msg}" for bid, msg in sorted(update.failed.items()))
            log.error("weights of policy version %d (%s) not loaded: %s", update.policy_version, update.checkpoint, why)
            self._send(w.identity, P.error_reply(w.rid, ErrorCode.RELOAD_FAILED,
                                                 f"{len(update.failed)} backend(s) did not load the new weights: {why}",
                                                 **fields), ())
            return
        # Calls routed from now on go to the new weights (a bridge also stamps each reply with its own version).
        self.policy_version = max(self.policy_version, update.policy_version)
        # Also with no bridge to load them (none up at the moment, or HTTP backends only): calls are stamped
        # with this version from now on, so a bridge that joins later must load these weights before it serves.
        # Nothing has then shown that the checkpoint loads at all: the reply and status say so (verified: false).
        verified = bool(update.updated)
        self.current = CurrentWeights(update.checkpoint, update.policy_version, update.load_timeout_s, verified)
        self._journal_current()
        log.info("weights of policy version %d (%s) loaded by %s", update.policy_version, update.checkpoint,
                 ", ".join(update.updated) or "no bridge (unverified)")
        self._send(w.identity, P.reply(w.rid, verified=verified, **fields), ())

    def _verified_by(self, backend: Backend, weights: CurrentWeights) -> None:
        """``backend`` serves ``weights``: current weights no bridge had loaded are verified from now on."""
        w = self.current
        if w is None or w.verified or (w.checkpoint, w.policy_version) != (weights.checkpoint, weights.policy_version):
            return
        self.current = replace(w, verified=True)
        self._journal_current()  # a restarted broker must not call them unverified again
        log.info("weights of policy version %d (%s) verified: backend %s loaded them", w.policy_version, w.checkpoint,
                 backend.backend_id)

    def status(self) -> P.WeightsStatus | None:
        """The current weights as ``status`` shows them (None before any update)."""
        w = self.current
        return None if w is None else P.WeightsStatus(w.checkpoint, w.policy_version, w.verified)

    def _journal_current(self) -> None:
        """Append the current weights to the journal (when there is one)."""
        w = self.current
        if self._record is not None and w is not None:
            self._record(weights_record(w.checkpoint, w.policy_version, w.load_timeout_s, w.verified))

    def journal_records(self) -> list[dict[str, Any]]:
        """The current weights as journal records (none before an update every bridge loaded)."""
        w = self.current
        return [] if w is None else [weights_record(w.checkpoint, w.policy_version, w.load_timeout_s, w.verified)]

    def restore(self, record: dict[str, Any] | None) -> None:
        """Take back the current weights a journal recorded (a restarted broker): rejoining bridges load them."""
        if record is None:
            return
        self.current = CurrentWeights(record["checkpoint"], record["policy_version"], record["load_timeout_s"],
                                      record["verified"])
        self.policy_version = max(self.policy_version, self.current.policy_version)
        log.info("current weights from the journal: %s (policy version %d%s)", self.current.checkpoint,
                 self.current.policy_version, "" if self.current.verified else ", unverified: no bridge loaded them yet")

    # ------------------------------------------------------------------ bridges (re)joining

    def _target(self) -> CurrentWeights | None:
        """The weights a bridge joining now must serve: the newest update in flight's, else the current ones."""
        if self.updates:
            u = self.updates[-1]
            return CurrentWeights(u.checkpoint, u.policy_version, u.load_timeout_s)
        return self.current

    def backend_registered(self, backend: Backend, policy_version: int | None) -> None:
        """A bridge registered serving ``policy_version`` (None: its start weights): on other weights, it catches up."""
        backend.policy_version = policy_version
        target = self._target()
        if backend.kind != "bridge" or backend.identity is None or target is None:
            return
        if policy_version == target.policy_version:
            backend.loading = False
            self._verified_by(backend, target)  # it loaded that version before (a broker restart, a reconnect)
            return
        backend.loading = True
        fid = self._next_id()
        log.info("backend %s joined on %s: it loads %s (policy version %d) before it serves", backend.backend_id,
                 "its start weights" if policy_version is None else f"policy version {policy_version}",
                 target.checkpoint, target.policy_version)
        header = H.UpdateWeights(fid, target.checkpoint, target.policy_version).to_wire()
        if not self._send(backend.identity, header, ()):
            self._cannot_load(backend, target, "unreachable")
            return
        self._catch_ups[fid] = CatchUp(backend.backend_id, target, timebase.now() + target.load_timeout_s)

    def _caught_up(self, backend: Backend, catch_up: CatchUp, error: dict[str, Any] | None) -> None:
        if error:
            self._cannot_load(backend, catch_up.weights, str(error.get("message")))
            return
        backend.policy_version = catch_up.weights.policy_version
        self._verified_by(backend, catch_up.weights)
        self._settle(backend)

    def _settle(self, backend: Backend) -> None:
        """A loading bridge answered a load: it serves once it has the newest weights and none is on its way."""
        bid = backend.backend_id
        if any(c.backend_id == bid for c in self._catch_ups.values()) or any(bid in u.waiting.values() for u in self.updates):
            return  # more weights are on their way to it (it re-registered, or an update came meanwhile)
        target = self._target()
        if target is not None and target.policy_version != backend.policy_version:
            self.backend_registered(backend, backend.policy_version)  # newer weights came meanwhile: those too
            return
        backend.loading = False
        log.info("backend %s serves policy version %s", bid, backend.policy_version)
        self._release_held()

    def _cannot_load(self, backend: Backend, weights: CurrentWeights, why: str) -> None:
        """A bridge that cannot load the current weights would serve a policy the trainer left: it goes."""
        message = (f"backend {backend.backend_id} could not load the current weights ({weights.checkpoint}, "
                   f"policy version {weights.policy_version}): {why}; it is told to shut down")
        log.error("%s", message)
        if backend.identity is not None:
            self._send(backend.identity, H.Shutdown().to_wire(), ())
        self._drop_backend(backend, message)

    def stop(self) -> None:
        """The broker is stopping: answer every drain and weight update that still waits."""
        for w in [*self.drains, *(u.waiter for u in self.updates)]:
            log.debug("%r of %r answered: the broker is stopping", w.rid, w.identity)
            self._send(w.identity, P.error_reply(w.rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping"), ())
        self.drains, self.updates = [], []
        self._update_of.clear()
        self._catch_ups.clear()
