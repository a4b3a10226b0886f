"""The broker's router as a plain object: two real ``Node`` records, a job table, and recorded sends.

No sockets: the router sends through a function that records what it sent,
and asks a table of real ``Node`` records which node a peer is and where a
job runs. Tests drive it with the same handler calls the broker makes.
"""

from __future__ import annotations

from typing import Any

from prorl_cli import protocol as P
from prorl_cli.broker.routing import Router
from prorl_cli.broker.state import Node
from prorl_cli.protocol import Op, pack_tokens

#: A generate call's payload: three prompt token ids.
PROMPT = [pack_tokens([1, 2, 3])]
#: The two nodes' ZeroMQ identities.
N1, N2 = b"node-1", b"node-2"


def hdr(op: Op, fields: dict[str, Any]) -> Any:
    """The typed header the broker's dispatch hands the router for ``fields`` (checked by the op's schema)."""
    return P.parse({"op": op, **fields})


class Cluster:
    """Two nodes, a job table (job id -> node id) and a router whose sends are recorded."""

    def __init__(self, policy: str = "least_loaded_sticky", cancel_propagation: bool = True) -> None:
        self.sent: list[tuple[bytes, dict[str, Any], list[bytes]]] = []
        self.nodes = {
            N1: Node(node_id="n1", identity=N1, host="h1", pid=1, credit=8, tasks={"t"}),
            N2: Node(node_id="n2", identity=N2, host="h2", pid=2, credit=8, tasks={"t"}),
        }
        self.jobs: dict[str, str] = {}  # running job -> node id
        self.router = Router(
            self.send, self.nodes.get, self.jobs.get, policy=policy, cancel_propagation=cancel_propagation,
            heartbeat_interval_s=1.0, heartbeat_liveness=3,
        )
        self._rid = 0
        #: Peers a send to fails, as ZeroMQ's router fails one to a peer that disconnected (killed): nothing recorded.
        self.unreachable: set[bytes] = set()

    def send(self, identity: bytes, header: dict[str, Any], payload: Any = ()) -> bool:
        if identity in self.unreachable:
            return False
        self.sent.append((identity, header, list(payload)))
        return True

    def take(self, identity: bytes | None = None) -> list[dict[str, Any]]:
        """Headers sent (to ``identity``) since the last take."""
        out = [h for who, h, _ in self.sent if identity is None or who == identity]
        self.sent = [s for s in self.sent if identity is not None and s[0] != identity]
        return out

    def bridge(self, backend_id: str, host: str = "h9") -> bytes:
        identity = f"bridge-{backend_id}".encode()
        self.router.on_register_backend(identity, hdr(Op.REGISTER_BACKEND, {"rid": 1, "backend_id": backend_id, "host": host, "model": "m"}), [])
        (ack,) = [s for s in self.sent if s[0] == identity and s[1]["op"] == Op.REPLY.value]
        assert ack[1]["ok"]
        self.sent.remove(ack)
        return identity

    def generate(self, job_id: str, requester: bytes = N1) -> int:
        self._rid += 1
        self.router.on_generate(requester, hdr(Op.GENERATE, {"rid": self._rid, "job_id": job_id}), PROMPT)
        return self._rid

    def routed(self, job_id: str, requester: bytes = N1) -> str:
        """Make one call for ``job_id`` and return the backend it was forwarded to."""
        self.generate(job_id, requester)
        ((who, header, _),) = [s for s in self.sent if s[1].get("op") == Op.GENERATE.value]
        self.sent.clear()
        assert header["job_id"] == job_id
        return who.decode().removeprefix("bridge-")

    def reply(self, bridge: bytes, call_id: int, **fields: Any) -> None:
        self.router.on_generate_reply(bridge, hdr(Op.GENERATE_REPLY, {"rid": call_id, "finish_reason": "stop", **fields}),
                                      PROMPT + PROMPT)

    def inflight(self) -> dict[str, int]:
        return {s.backend_id: s.inflight for s in self.router.backend_statuses()}

    def live_jobs(self) -> dict[str, int]:
        return {s.backend_id: s.jobs for s in self.router.backend_statuses()}


def run(c: Cluster, *job_ids: str, node: str = "n1") -> None:
    """Mark ``job_ids`` as running on ``node`` (as the broker does when it assigns them)."""
    for j in job_ids:
        c.jobs[j] = node


def end(c: Cluster, *job_ids: str) -> None:
    """End ``job_ids`` (done or cancelled) and tell the router, as the broker does."""
    for j in job_ids:
        del c.jobs[j]
        c.router.job_ended(j)
