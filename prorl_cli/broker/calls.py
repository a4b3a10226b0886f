"""The router's generate call tables: calls routed to a backend (pending) and calls held at the broker.

Plain containers, no sockets and no decisions: the router (``broker/routing.py``)
adds and removes calls; the weight sync (``broker/weights.py``) only reads them.
Rules: a pending call is keyed by the id the broker gave it when it forwarded
it, and indexed by job and by backend, so that a job that ends or a backend
that is lost drops its own calls in O(its calls); a backend's in-flight count
is the number of its pending calls, never counted by hand. Held calls keep
their arrival order (they are routed again in it) and are indexed by job.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from prorl_cli import timebase
from prorl_cli.protocol import headers as H


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
    since: float = field(default_factory=timebase.monotonic)
    #: A bridge call's request as the node sent it (its frames are the same bytes, not copies): what is routed
    #: again when its bridge leaves before answering. None for redirected calls, which the node makes itself.
    request: H.Generate | None = None
    payload: list[bytes] = field(default_factory=list)
    #: Backends lost under it so far (:data:`~prorl_cli.broker.routing.LOST_MOVES_MAX` bounds them).
    moves: int = 0


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
    #: As :attr:`PendingGenerate.moves`: a call held after its backend was lost keeps the count.
    moves: int = 0

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
