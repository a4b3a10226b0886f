"""Inference backends and the policies that pick one for a generate call.

A :class:`Backend` is a bridge peer (registered with ``register_backend``)
or a plain HTTP address (``add_llm_server``); the router
(``broker/routing.py``) keeps them and changes their records. Rules: a
backend's in-flight count is never stored here, it is computed from the
router's pending calls and handed to the policy (``inflight``); ``jobs`` is
the live jobs routed to it, ``assigned`` the jobs ever routed to it (never
decremented).

The policy that picks a backend is a named choice (``broker.routing_policy``),
and picks only among live, uncleared backends that are not loading weights
nor resting:

- An HTTP backend that fails :data:`FAULTS_TO_REST` calls in a row (the node
  could not reach it, it did not answer in time, or it answered 5xx) rests:
  new calls avoid it for :data:`REST_FIRST_S`. The faults of calls routed
  to it before its rest began do not count again. After its rest one call
  at a time goes to it (a probe): an answer ends the run of faults, a fault
  starts a rest twice as long, up to :data:`REST_MAX_S`. A call given up by
  its node (cancelled) counts neither way. When every backend rests, calls
  go to them anyway, and a job keeps its backend: failing fast beats
  waiting for ever.

- ``least_loaded_sticky`` (default): a job's first call goes to the live
  backend with the fewest live jobs, then fewest in-flight calls, then on
  the requesting node's host; its later calls follow it there.
- ``round_robin``: every call goes to the next backend in turn (no
  stickiness: a multi-turn job's prefix cache is lost on every hop).
- ``ever_assigned``: the paper's server: sticky, and a new job goes to the
  backend that was ever assigned the fewest jobs (a count never decremented).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field

from prorl_cli import protocol as P

ROUTING_POLICIES = ("least_loaded_sticky", "round_robin", "ever_assigned")
#: Calls in a row a backend fails before new calls avoid it, the first rest, and the longest.
FAULTS_TO_REST = 3
REST_FIRST_S = 5.0
REST_MAX_S = 120.0


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
    #: The weights version the bridge serves (``None``: the weights it was started on; HTTP backends: unknown).
    policy_version: int | None = None
    #: Loading the deployment's current weights after it (re)joined on others: no call is routed to it meanwhile.
    loading: bool = False
    #: Calls in a row the backend failed (counted as :meth:`note_fault` says), the last fault, when its latest
    #: rest began and until when it lasts (``timebase`` s).
    faults_in_a_row: int = 0
    last_fault: str | None = None
    rest_began: float = 0.0
    resting_until: float = 0.0

    def note_fault(self, fault: str, now: float, routed_at: float) -> float | None:
        """A call routed at ``routed_at`` failed at the backend: the rest (s) it starts now, or None.

        A call routed before the latest rest began failed in the outage that rest answers: it is not counted.
        """
        self.last_fault = fault
        if self.faults_in_a_row >= FAULTS_TO_REST and routed_at < self.rest_began:
            return None
        self.faults_in_a_row += 1
        if self.faults_in_a_row < FAULTS_TO_REST:
            return None
        rest_s = min(REST_MAX_S, REST_FIRST_S * 2 ** min(self.faults_in_a_row - FAULTS_TO_REST, 16))
        self.rest_began, self.resting_until = now, now + rest_s
        return rest_s

    def note_answer(self) -> bool:
        """A call was answered (or the backend was added again): the run of faults ends. True if it had rested."""
        rested = self.faults_in_a_row >= FAULTS_TO_REST
        self.faults_in_a_row, self.last_fault, self.rest_began, self.resting_until = 0, None, 0.0, 0.0
        return rested

    def avoided(self, now: float, inflight: int) -> bool:
        """New calls go elsewhere: it rests, or its rest is over and a call is trying it (one probe at a time)."""
        return self.resting_until > now or (self.faults_in_a_row >= FAULTS_TO_REST and inflight > 0)

    def status(self, inflight: int, now: float) -> P.BackendStatus:
        """The backend as ``status`` shows it (``now``: ``timebase`` seconds, for the rest left)."""
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
            policy_version=self.policy_version,
            loading=self.loading,
            resting_s=round(max(0.0, self.resting_until - now), 1),
            last_fault=self.last_fault,
        )


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


class GoneBridges:
    """Bridges that went away and have not registered again, for ``status`` (the latest ``kept``)."""

    def __init__(self, kept: int = 32) -> None:
        self.kept = kept
        self._by_id: dict[str, P.BackendStatus] = {}

    def add(self, status: P.BackendStatus, why: str) -> None:
        """``status`` as it was when it went, marked not alive with ``why`` (``left ...`` or the loss)."""
        status.alive, status.gone_reason = False, why
        self._by_id.pop(status.backend_id, None)
        self._by_id[status.backend_id] = status
        while len(self._by_id) > self.kept:
            self._by_id.pop(next(iter(self._by_id)))

    def back(self, backend_id: str) -> None:
        """It registered again."""
        self._by_id.pop(backend_id, None)

    def statuses(self) -> list[P.BackendStatus]:
        """Latest last."""
        return list(self._by_id.values())
