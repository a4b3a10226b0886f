"""Node membership: which node servers belong to the deployment, and whether they are alive.

The broker's loop owns one :class:`Members` and hands it the node ops
(``register``, ``heartbeat``, ``unregister``, ``release``, ``job_stage``,
``job_done``; its ``handlers``); on each tick it calls :meth:`Members.tick`
to judge the nodes' liveness. Members keeps the nodes in the job table's
``nodes`` (by node id) and its own ``node_by_identity`` (by peer; a node
declared lost leaves it); what a node's jobs become is the job table's
business (claims, stages, results, requeueing a lost node's jobs).
Rules:

- Only a live registered node may speak for jobs (``job_stage``,
  ``job_done``, ``release``); any other peer is told to register again.
- A node id registering from a new connection means the old process is
  gone: that node is lost first. Registering again on the same connection
  (a missed reply) keeps what the node holds. A register from the very
  connection an id was taken from proves two live processes share the id:
  that one is refused and told to shut down.
- A heartbeat carrying a node's liveness token from another connection (its
  sidecar) refreshes that node and is never answered. A bridge's heartbeats
  and goodbyes are the router's (``bridge_heartbeat``, ``bridge_unregister``).
- A node silent for ``heartbeat_interval_s * heartbeat_liveness`` is lost,
  judged only when the loop says so (a drained inbox); a loop turn that
  overran is credited to every node first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.broker.backends import Backend
from prorl_cli.broker.jobs import JobTable
from prorl_cli.broker.state import Node, SendFn
from prorl_cli.observe.metrics import DeploymentCollector
from prorl_cli.protocol import ErrorCode, Op
from prorl_cli.protocol import headers as H
from prorl_cli.protocol.records import NODE_LEFT as LEFT

log = logging.getLogger(__name__)


class Members:
    """The deployment's node servers: registration, heartbeats, draining, results intake and liveness.

    ``table``: the job table (its ``nodes``, claims, stages, results, node loss);
    ``send``: one message to a peer; ``collector``: where nodes' and bridges'
    heartbeat figures go; ``journal_flush()``: make what was journaled durable;
    ``bridge_heartbeat(identity, h)``: True if a live bridge sent it (the
    router's); ``bridges``: the router's backends by bridge peer;
    ``bridge_unregister(identity)``: a bridge's goodbye (the router's).
    """

    def __init__(
        self,
        table: JobTable,
        send: SendFn,
        collector: DeploymentCollector,
        journal_flush: Callable[[], object],
        *,
        heartbeat_interval_s: float,
        heartbeat_liveness: int,
        boot_id: str,
        bridge_heartbeat: Callable[[bytes, H.Heartbeat], bool],
        bridges: dict[bytes, Backend],
        bridge_unregister: Callable[[bytes, str | None], None],
    ) -> None:
        self.table = table
        self.nodes: dict[str, Node] = table.nodes
        self.node_by_identity: dict[bytes, Node] = {}
        self._send = send
        self.collector = collector
        self._journal_flush = journal_flush
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_liveness = heartbeat_liveness
        self.dead_after_s = heartbeat_interval_s * heartbeat_liveness
        self.boot_id = boot_id
        #: The unserved tasks of queued jobs last warned about (:meth:`_warn_unserved`).
        self._warned_unserved: frozenset[str] = frozenset()
        #: Per node id, the connection its last replacement displaced (:meth:`_note_replaced`).
        self._displaced: dict[str, bytes] = {}
        self._bridge_heartbeat = bridge_heartbeat
        self._bridges = bridges
        self._bridge_unregister = bridge_unregister
        self.stopping = False
        self.handlers: dict[Op, Callable[[bytes, Any, list[bytes]], None]] = {
            Op.REGISTER: self.on_register,
            Op.HEARTBEAT: self.on_heartbeat,
            Op.UNREGISTER: self.on_unregister,
            Op.RELEASE: self.on_release,
            Op.JOB_STAGE: self.on_job_stage,
            Op.JOB_DONE: self.on_job_done,
        }

    # ------------------------------------------------------------------ node ops

    def on_register(self, identity: bytes, h: H.Register, payload: list[bytes]) -> None:
        node_id = h.node_id
        if self.stopping:
            self._send(identity, H.Shutdown().to_wire(), ())
            return
        old = self.nodes.get(node_id)
        if old is not None and old.alive and old.identity != identity:
            if identity == self._displaced.get(node_id):
                self._refuse_twin(identity, old, h)
                return
            # Same node id from a new connection: the old process is gone.
            self._note_replaced(old, identity, h)
            self.node_lost(old, "re-registered from a new connection")
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
        self._warn_unserved()
        self._send(
            identity,
            P.reply(h.rid, heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_liveness=self.heartbeat_liveness,
                    drop=drop, boot_id=self.boot_id),
            (),
        )

    def _note_replaced(self, old: Node, identity: bytes, h: H.Register) -> None:
        """A live node's id registered from another connection: the old process is taken for gone.

        A restarted node is the common case. The old connection is remembered: a register from it
        later proves that process alive (a dead one sends nothing), so two processes share the id
        (:meth:`_refuse_twin`).
        """
        log.info("node %s registered again from pid %d on %s (was pid %d on %s): the old process is taken for gone",
                 old.node_id, h.pid or 0, h.host, old.pid, old.host)
        self._displaced[old.node_id] = old.identity

    def _refuse_twin(self, identity: bytes, holder: Node, h: H.Register) -> None:
        """The process a node id was taken from registers again while the taker lives: two processes share the id.

        Left alone, each would take the id from the other at every heartbeat, and every take requeues
        the other's jobs (their attempts run out). The one that holds the id keeps it; the other is
        refused, naming both, and told to shut down.
        """
        why = (f"node id {holder.node_id!r} is used by two live processes: pid {holder.pid} on {holder.host} holds it, "
               f"so pid {h.pid or 0} on {h.host} is told to shut down; give each node its own --node-id")
        log.error("%s", why)
        self._send(identity, P.error_reply(h.rid, ErrorCode.BAD_FIELD, why), ())
        self._send(identity, H.Shutdown().to_wire(), ())

    def _warn_unserved(self) -> None:
        """Jobs accepted before any node served (a submit checks task names only against live nodes) may be for a
        task no node serves, a misspelt one: said when a node registers, once per set of such tasks."""
        live = self.table.live_tasks()
        unserved = {task: n for task, n in self.table.queue.waiting().items() if task not in live}
        if unserved and frozenset(unserved) != self._warned_unserved:
            log.warning("%d queued job(s) are for task(s) %s that no live node serves (served: %s): they wait for "
                        "a node that serves them", sum(unserved.values()), sorted(unserved), sorted(live))
        self._warned_unserved = frozenset(unserved)

    def _node_of(self, identity: bytes, h: Any) -> Node | None:
        """The live node on ``identity``; else the peer (``h``: its header) is told to register, and None."""
        node = self.node_by_identity.get(identity)
        if node is None or not node.alive:
            # Tell the peer to register again (e.g. after it was declared dead).
            self._send(identity, P.error_reply(getattr(h, "rid", None), ErrorCode.UNKNOWN_PEER, "not registered; send register"), ())
            return None
        return node

    def on_heartbeat(self, identity: bytes, h: H.Heartbeat, payload: list[bytes]) -> None:
        token = h.liveness_token
        sidecar = self.nodes.get(h.node_id or "")
        if token is not None and (sidecar is None or sidecar.identity != identity):
            # A node's liveness sidecar (its own connection): refresh that node, never answer.
            node = sidecar
            if node is not None and node.alive and node.liveness_token is not None and node.liveness_token == token:
                node.last_seen = timebase.now()
                if h.stages is not None:
                    node.stages = h.stages
            else:
                log.debug("heartbeat with a liveness token for node %r that does not match; ignored", h.node_id)
            return
        if self._bridge_heartbeat(identity, h):
            backend = self._bridges.get(identity)
            if backend is not None and h.metrics is not None:
                self.collector.update_peer("bridge", backend.backend_id, h.metrics)
            return
        if h.backend_id is not None:
            self._send(identity, P.error_reply(h.rid, ErrorCode.UNKNOWN_PEER, "not registered; send register_backend"), ())
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
            # Only a node that means to go sends this (a drain, a scale-down, `down`): it left, it was not lost.
            self.node_lost(node, f"{LEFT} (drained)" if node.draining else LEFT, planned=True)
        self._bridge_unregister(identity, h.reason)  # a bridge: left, unless it says what broke

    def on_release(self, identity: bytes, h: H.JobIds, payload: list[bytes]) -> None:
        """A node drains: nothing more is placed on it; the jobs it names (never started there) are queued again."""
        node = self._node_of(identity, h)
        if node is None:
            return
        node.draining = True
        released = self.table.release(node, h.job_ids)
        log.info("node %s is draining: %d job(s) handed back, %d running on", node.node_id, len(released), len(node.inflight))
        self._journal_flush()
        self._send(identity, P.reply(h.rid, released=released), ())

    def on_job_stage(self, identity: bytes, h: H.JobStage, payload: list[bytes]) -> None:
        node = self._node_of(identity, h)
        if node is not None:
            self.table.stage(node, h.updates)

    def on_job_done(self, identity: bytes, h: H.JobDone, payload: list[bytes]) -> None:
        node = self._node_of(identity, h)
        if node is not None:
            self.table.done(node, h.jobs, payload)

    # ------------------------------------------------------------------ liveness

    def node_lost(self, node: Node, why: str, *, planned: bool = False) -> None:
        """Declare a node dead and put its jobs back in the queue with a new attempt (``planned``: it left)."""
        self.node_by_identity.pop(node.identity, None)
        self.table.node_lost(node, why, planned=planned)

    def tick(self, now: float, overrun_s: float, judge: bool) -> None:
        """Credit an overrun loop turn to every node; if ``judge``, declare silent nodes lost; heartbeat the others."""
        if overrun_s > 0:
            for node in self.nodes.values():
                node.last_seen = min(now, node.last_seen + overrun_s)
        for node in list(self.nodes.values()):
            if not node.alive:
                continue
            if judge and now - node.last_seen > self.dead_after_s:
                self.node_lost(node, f"silent for {now - node.last_seen:.1f} s")
            else:
                self._send(node.identity, H.Heartbeat().to_wire(), ())

    def prune(self, kept: int) -> None:
        """Forget the oldest dead nodes beyond ``kept`` (and their figures)."""
        for node_id in self.table.prune_dead_nodes(kept):
            self.collector.forget_peer("node", node_id)
            self._displaced.pop(node_id, None)

    def stop(self) -> None:
        """The broker is stopping: tell every live node to shut down; a node that registers now is told the same."""
        self.stopping = True
        for node in self.nodes.values():
            if node.alive:
                self._send(node.identity, H.Shutdown().to_wire(), ())
