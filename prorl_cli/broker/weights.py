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
  paused); a resume before then answers it with ``drain_timeout``.
- ``update_weights`` goes to every live bridge (HTTP backends are skipped:
  the broker cannot reload them) and is answered once each one has loaded,
  failed, been lost, or run out of ``load_timeout_s``.
- The router calls :meth:`WeightSync.check_waiters` when a call ends while a
  drain waits, and :meth:`WeightSync.backend_lost` when a backend goes; the
  loop calls ``check_waiters`` on each tick for the deadlines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prorl_cli import protocol as P
from prorl_cli.broker.backends import Backend
from prorl_cli.broker.calls import HeldGenerates, PendingGenerates
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


class WeightSync:
    """Pause/resume with drains, and weight updates; one per router.

    ``pending``/``held``: the router's call tables; ``backends`` and
    ``backend_by_identity``: its backends by id and by bridge peer;
    ``next_id()``: a fresh forward id (from the router's call ids);
    ``release_held()``: route the held calls (on resume).
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
    ) -> None:
        self._send = send
        self._pending = pending
        self._held = held
        self._backends = backends
        self._backend_by_identity = backend_by_identity
        self._next_id = next_id
        self._release_held = release_held
        self.paused = False
        #: The trainer's policy (weights) version, set by pause/resume; 0 until told.
        self.policy_version = 0
        #: Clients waiting for in-flight calls to drain (``pause_generation`` with ``drain_timeout_s``).
        self.drains: list[Waiter] = []
        #: Weight updates waiting for their bridges, and forward id -> its update.
        self.updates: list[WeightUpdate] = []
        self._update_of: dict[int, WeightUpdate] = {}
        self.handlers: dict[Op, Callable[[bytes, Any, list[bytes]], None]] = {
            Op.PAUSE_GENERATION: self.on_pause_generation,
            Op.RESUME_GENERATION: self.on_resume_generation,
            Op.UPDATE_WEIGHTS: self.on_update_weights,
            Op.WEIGHTS_UPDATED: self.on_weights_updated,
        }

    # ------------------------------------------------------------------ pause / resume

    def _set_policy_version(self, h: H.PauseGeneration | H.ResumeGeneration) -> None:
        if h.policy_version is not None:
            self.policy_version = h.policy_version

    def on_pause_generation(self, identity: bytes, h: H.PauseGeneration, payload: list[bytes]) -> None:
        self._set_policy_version(h)
        self.paused = True
        wait_s = h.drain_timeout_s
        if wait_s is not None and len(self._pending):
            # A pause that drains: answered once no call is in flight on any backend, or at the deadline.
            self.drains.append(Waiter(identity, h.rid, time.monotonic() + float(wait_s)))
            return
        self._send(identity, P.reply(h.rid, paused=True, inflight=len(self._pending), policy_version=self.policy_version,
                                     drained=not len(self._pending)), ())

    def on_resume_generation(self, identity: bytes, h: H.ResumeGeneration, payload: list[bytes]) -> None:
        self._set_policy_version(h)
        self.paused = False
        for w in self.drains:
            self._send(w.identity, P.error_reply(w.rid, ErrorCode.DRAIN_TIMEOUT, "generation was resumed before the calls "
                                                 "in flight drained: " + self._running_calls_text(),
                                                 running=self._running_calls()), ())
        self.drains = []
        self._send(identity, P.reply(h.rid, paused=False, released=len(self._held), policy_version=self.policy_version), ())
        self._release_held()

    def _running_calls(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"job_id": p.job_id, "backend_id": p.backend_id, "running_s": round(now - p.since, 3)}
                for _, p in self._pending.items()]

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
                if not len(self._pending):
                    self._send(w.identity, P.reply(w.rid, paused=self.paused, inflight=0, drained=True,
                                                   policy_version=self.policy_version), ())
                elif now >= w.deadline:
                    n = len(self._pending)
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
        for b in self._backends.values():
            if not b.alive:
                continue
            if b.kind != "bridge" or b.identity is None:
                update.skipped.append(b.backend_id)
                continue
            fid = self._next_id()
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
        backend = self._backend_by_identity.get(identity)
        if backend is None or not backend.alive:
            message = "not registered; send register_backend"
            log.warning("error to %r (rid %r): %s: %s", identity, h.rid, ErrorCode.UNKNOWN_PEER.value, message)
            self._send(identity, P.error_reply(h.rid, ErrorCode.UNKNOWN_PEER, message), ())
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

    def backend_lost(self, backend_id: str) -> None:
        """A backend went: an update waiting for it counts it failed; a drain may be over (its calls were dropped)."""
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
            self._send(w.identity, P.error_reply(w.rid, ErrorCode.RELOAD_FAILED,
                                                 f"{len(update.failed)} backend(s) did not load the new weights: {why}",
                                                 **fields), ())
            return
        # Calls routed from now on go to the new weights (a bridge also stamps each reply with its own version).
        self.policy_version = max(self.policy_version, update.policy_version)
        self._send(w.identity, P.reply(w.rid, **fields), ())

    def stop(self) -> None:
        """The broker is stopping: answer every drain and weight update that still waits."""
        for w in [*self.drains, *(u.waiter for u in self.updates)]:
            log.debug("%r of %r answered: the broker is stopping", w.rid, w.identity)
            self._send(w.identity, P.error_reply(w.rid, ErrorCode.SHUTTING_DOWN, "the broker is stopping"), ())
        self.drains, self.updates = [], []
        self._update_of.clear()
