"""The node server: a DEALER to the broker, the stage pipeline, heartbeats.

The broker assigns jobs up to the node's credit; the node runs each through
INIT → RUN → EVAL locally and reports stage changes and results (batched per
event-loop turn). ``SHUTDOWN`` from the broker, SIGTERM or SIGINT cancel
everything, clean up, unregister (so the broker re-queues what was running,
unless it is stopping) and exit.

Liveness does not depend on the event loop: a sidecar thread heartbeats for
the node (:mod:`prorl_cli.node.liveness`), and the node runs on a loop that
refuses non-finite timers (:mod:`prorl_cli.node.loop`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import (
    BrokerRestarted,
    BrokerUnavailable,
    HandlerError,
    ProtocolError,
    SlurmError,
)
from prorl_cli.node.liveness import LivenessSidecar, LoopStamp, new_liveness_token
from prorl_cli.node.loop import run_checked
from prorl_cli.node.pipeline import Pipeline
from prorl_cli.node.registry import HandlerRegistry, discover
from prorl_cli.node.services import NodeServices
from prorl_cli.peer import BrokerPeer
from prorl_cli.protocol import ErrorCode, JobResult, JobSpec, Op
from prorl_cli.protocol import headers as H
from prorl_cli.protocol.framing import INT_MAX, INT_MIN
from prorl_cli.rendezvous import read_rendezvous

if TYPE_CHECKING:
    from prorl_cli.inference.node_client import NodeInference

log = logging.getLogger(__name__)

#: How many fields a JobResult has (a result whose ``__dict__`` holds more is packed the general way).
_RESULT_FIELDS = len(dataclasses.fields(JobResult))


class ResultPacker:
    """Packs results into payload frames: the bytes of ``P.pack_obj(result.to_wire())``, for a third of the CPU.

    The pipeline fills a result's fields with plain values, so its ``__dict__``
    is its wire map as it is, and one msgpack packer is reused (use it from one
    thread). Anything else takes the general path: an attribute that is no
    field, or a value msgpack refuses (a record or a plain enum, which
    ``to_wire`` converts; a ``str`` or ``int`` enum packs as its value either way).
    """

    def __init__(self) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)

    def pack(self, result: JobResult) -> bytes:
        fields = vars(result)
        if len(fields) == _RESULT_FIELDS:
            try:
                return bytes(self._packer.pack(fields))
            except (TypeError, OverflowError, ValueError):
                pass  # the packer reset its buffer; to_wire converts what it refused
        wire = result.to_wire()
        try:
            return P.pack_obj(wire)
        except (TypeError, OverflowError, ValueError) as e:
            # Handler output is anyone's data (a model's tool call can hold a 100-digit integer): the result
            # still goes out, with what msgpack cannot carry as text, rather than failing its delivery.
            log.warning("job %s: its result holds values msgpack cannot carry (%s); they are sent as text",
                        result.job_id, e)
        try:
            return P.pack_obj(_carriable(wire))
        except (RecursionError, ValueError, TypeError, OverflowError) as e:
            # Not even as text (a cycle, nesting deeper than msgpack goes): the job fails without its output,
            # rather than take its batch of results down with it. The result itself changes, so the header
            # that goes with it, and a later resend, say the same.
            problem = (f"the {result.task!r} handler's final_result returned an output no wire format carries "
                       f"({type(e).__name__}: {e}); a cycle, or nesting deeper than msgpack allows? It was dropped")
            log.error("job %s: %s", result.job_id, problem)
            result.state = P.JobState.FAILED.value
            result.critical_error = "final_result"
            result.error = P.ErrorInfo(stage="final_result", type="HandlerError", message=problem).to_wire()
            result.output = None
            result.reward = None
            return P.pack_obj(result.to_wire())


def _carriable(value: Any) -> Any:
    """``value`` with every integer msgpack cannot carry, and every object it does not know, as text."""
    if isinstance(value, dict):
        return {_carriable(k): _carriable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_carriable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, float | str | bytes):
        return value
    if isinstance(value, int):
        return value if INT_MIN <= value <= INT_MAX else str(value)
    return repr(value)

#: ``node.drain_grace_s`` when the config leaves it unset (and no Slurm launch set it from signal_delay_s).
DEFAULT_DRAIN_GRACE_S = 90.0
#: Left at the end of a Slurm job's time for stopping what still runs and requeueing (as ``prorl launch`` leaves),
#: where the job has at least twice that left (see :func:`drain_margin_s`).
DRAIN_MARGIN_S = 30.0


def drain_margin_s(left_s: float) -> float:
    """What a drain keeps of the ``left_s`` its Slurm job has left for stopping the jobs still running,
    unregistering and the requeue: ``DRAIN_MARGIN_S``, or half of ``left_s`` when that is less.

    The margin scales down for short ends rather than eat them whole: a preemption's GraceTime of 20 s would
    leave no drain at all after 30 s. Half of it still lets a job a few seconds from done deliver, and the
    other half (10 s there, twice the default ``node.stop_grace_s``) is enough to stop the rest and leave:
    stopping takes ``stop_grace_s`` at most, unregistering one broker round trip, the requeue two ``scontrol``
    calls. Slurm's SIGTERM at the end only repeats the stop already under way (the quick drain); its SIGKILL
    comes ``KillWait`` later still.
    """
    return max(0.0, min(DRAIN_MARGIN_S, left_s / 2))


@dataclasses.dataclass(frozen=True)
class DrainGrace:
    """How long a drain lets running jobs finish, and what decided it (said in the node's log)."""

    grace_s: float
    #: ``node.drain_grace_s`` (``DEFAULT_DRAIN_GRACE_S`` where unset).
    configured_s: float
    #: The Slurm job's time left when the drain began; None outside Slurm, with no end, or unread.
    left_s: float | None = None
    margin_s: float = 0.0
    #: Whether ``configured_s`` came from ``node.drain_grace_s`` (else the default).
    configured: bool = True

    @property
    def by_job_end(self) -> bool:
        """Whether the Slurm job's end, not the configured grace, bounds the drain."""
        return self.grace_s < self.configured_s

    def describe(self) -> str:
        source = "node.drain_grace_s" if self.configured else "the default, node.drain_grace_s being unset"
        if not self.by_job_end:
            left = "" if self.left_s is None else f"; the Slurm job ends in {self.left_s:.0f} s"
            return f"draining with a grace of {self.grace_s:.0f} s ({source}{left})"
        return (f"draining with a grace of {self.grace_s:.0f} s, not the {self.configured_s:.0f} s of {source}: "
                f"the Slurm job ends in {self.left_s:.0f} s (its time limit, or a preemption's GraceTime), "
                f"{self.margin_s:.0f} s of which are kept for stopping what still runs and the requeue")


def drain_grace_within(configured_s: float, left_s: float | None, configured: bool = True) -> DrainGrace:
    """The drain's grace: ``configured_s``, at most what the Slurm job's ``left_s`` leaves after its margin.

    A preemption (``preempt_send_user_signal``) sets the job's end to now + the partition's GraceTime; at the
    time-limit warning it is the time limit, which ``prorl launch``'s grace (``signal_delay_s`` - 30 s) fits
    already. A drain past that end is stopped by Slurm, so it is cut here, to 0 s where little or nothing is
    left (the drain then hands back at once what has not started and stops the rest). ``left_s`` None: no end.
    """
    if left_s is None:
        return DrainGrace(configured_s, configured_s, None, 0.0, configured)
    margin_s = drain_margin_s(left_s)
    return DrainGrace(max(0.0, min(configured_s, left_s - margin_s)), configured_s, left_s, margin_s, configured)


def _slurm_drain_grace(configured_s: float | None) -> DrainGrace:
    """The drain's grace in this process's Slurm job, read from its end time now (a blocking ``scontrol``);
    outside Slurm, or where ``scontrol`` fails (with a warning), the configured grace as it is."""
    from prorl_cli.slurm.identity import SlurmIdentity
    from prorl_cli.slurm.squeue import time_left_s

    grace_s = DEFAULT_DRAIN_GRACE_S if configured_s is None else configured_s
    ref = SlurmIdentity.from_env().task_ref
    if ref is None:
        return drain_grace_within(grace_s, None, configured_s is not None)
    try:
        left_s = time_left_s(ref)
    except (OSError, SlurmError) as e:
        log.warning("could not read Slurm job %s's time left (%s): draining for the configured %.0f s, "
                    "which Slurm cuts short if the job ends first (a preemption's GraceTime)", ref, e, grace_s)
        left_s = None
    return drain_grace_within(grace_s, left_s, configured_s is not None)


class NodeServer(BrokerPeer):
    """One node: serves the tasks its registry holds, for one deployment."""

    kind = "node"

    def __init__(
        self,
        config: ProrlConfig,
        node_id: str | None = None,
        address: str | None = None,
        registry: HandlerRegistry | None = None,
        on_preempt: Callable[[], None] | None = None,
        leave_requested: threading.Event | None = None,
    ) -> None:
        host = socket.gethostname()
        super().__init__(
            address=address,
            host=host,
            deployment_dir=config.deployment_dir,
            heartbeat_interval_s=config.broker.heartbeat_interval_s,
            heartbeat_liveness=config.broker.heartbeat_liveness,
        )
        self.config = config
        self.node_id = node_id or f"{host}-{os.getpid()}"
        self.registry = registry or discover(config.node.handler_paths, config.node.tasks or None)
        # A broken handler file must not leave a node serving without it (its jobs would queue forever),
        # nor bad handler settings fail every one of its jobs.
        errors = self.registry.start_errors(config)
        if errors:
            raise HandlerError("cannot serve: " + "; ".join(errors))
        if not self.registry.handlers:
            raise ProtocolError(ErrorCode.UNKNOWN_TASK, "no handlers found; nothing to serve")
        nc = config.node
        self.credit = nc.credit or (nc.n_init + nc.n_run + nc.n_eval)
        self.run_dir = config.deployment_dir / "nodes" / self.node_id
        self.services = NodeServices(
            node_id=self.node_id,
            sandbox=config.sandbox,
            image_cache_dir=str(config.images.cache_path),
            image_search_dirs=config.images.search_dirs,
            run_dir=self.run_dir,
            image_of=lambda task: self.registry.get(task).image,
            make_inference=self._make_inference,
        )
        self.pipeline = Pipeline(
            config, self.registry, self.services, self.node_id, self.run_dir, self._report_stage, self._report_done
        )
        self.pipeline.hand_back_before_run = self._hand_back_before_run
        self._stage_out: dict[str, tuple[int, str]] = {}  # job id -> (attempt, its latest stage) this turn
        self._done_out: list[JobResult] = []
        self._flush_scheduled = False
        self._stop = asyncio.Event()
        # Results sent but maybe never read: the broker may have died before reading them (or read them
        # as a stranger's after it restarted). They go again after each registration; the broker ignores repeats.
        self._unconfirmed: collections.deque[tuple[float, JobResult]] = collections.deque()
        self.liveness_token = new_liveness_token()
        self._stamp = LoopStamp(min(0.25, config.broker.heartbeat_interval_s / 2), on_stall=self._after_stall)
        self._sidecar: LivenessSidecar | None = None
        #: Heartbeat from a thread too, so a blocked loop does not look dead (off on a simulated-time loop,
        #: where only the loop's own timers may send: a thread's real-time heartbeats would land at random instants).
        self.liveness_sidecar = True
        self._loop: asyncio.AbstractEventLoop | None = None  # set in serve(); the sidecar reads its current task
        self._heartbeats = 0
        self._failures_sent = 0
        #: Called on SIGUSR2 (the Slurm role requeues the task once the node has left).
        self.on_preempt = on_preempt
        #: Set by a signal handler that ran before ``serve`` took the signals over (the Slurm role's).
        self.leave_requested = leave_requested
        self._draining = False
        #: Jobs handed back to the broker unstarted: their (cancelled) results are not reported.
        self._handed_back: set[str] = set()
        #: Packs result frames (on the loop's thread).
        self._pack_result = ResultPacker().pack

    def _make_inference(self) -> NodeInference:
        from prorl_cli.inference import NodeInference

        return NodeInference(self.request, self.config.inference, self.host, notify=self.send, rejoin=self.rejoin,
                             on_hold=self.pipeline.hold_clock)

    def _blocker(self) -> str:
        """What the event loop is running now (read from the sidecar thread while the loop is blocked)."""
        if self._loop is None:
            return "the node starting up"
        try:
            task = asyncio.current_task(self._loop)
        except RuntimeError:
            return "no task (between tasks)"
        name = task.get_name() if task is not None else None
        job = self.pipeline.stage_of(name)
        if job is not None:
            return f"job {job[0]} (stage {job[1]})"
        return f"task {name}" if name else "a callback outside any task"

    # ------------------------------------------------------------- the peer

    def register_header(self) -> dict[str, Any]:
        return H.Register(
            rid=H.NEW_RID,
            node_id=self.node_id,
            host=self.host,
            pid=os.getpid(),
            credit=self.credit,
            tasks=self.registry.tasks,
            # What this node still runs: a broker that lost track of it (declared us dead, or restarted) takes it back.
            running=[H.StageUpdate(j, r.attempt, r.stage) for j, r in self.pipeline.jobs.items()],
            # Heartbeats carrying this token, from any socket, vouch for this node (the liveness sidecar's).
            liveness_token=self.liveness_token,
            # Shown by `prorl status`: which isolation this node's sandboxes really get.
            sandbox_runtime=self.services.runtime_name,
            # Draining: a broker that restarted must place nothing more here either.
            draining=self._draining,
        ).to_wire()

    def heartbeat_header(self) -> dict[str, Any]:
        # A result is confirmed once the broker has been heard from a whole interval after it went out.
        while self._unconfirmed and self._unconfirmed[0][0] < self._last_heard - self._interval_s:
            self._unconfirmed.popleft()
        header = H.Heartbeat(node_id=self.node_id, stages=self.pipeline.stats(), metrics=self.pipeline.metrics.to_wire())
        # Failure groups go when they changed, and every 30th heartbeat (a restarted broker learns them again).
        failed = sum(c for c, _ in self.pipeline.failures.values())
        self._heartbeats += 1
        if failed != self._failures_sent or self._heartbeats % 30 == 0:
            self._failures_sent = failed
            header.failures = [{"task": t, "stage": s, "type": e, "count": c, "sample": m}
                               for (t, s, e), (c, m) in list(self.pipeline.failures.items())[-256:]]
        return header.to_wire()

    def unregister_header(self) -> dict[str, Any]:
        return H.Unregister(node_id=self.node_id).to_wire()

    def on_registered(self, reply: dict[str, Any]) -> None:
        log.info("node %s registered with %s: tasks %s, credit %d, running %d, sandbox runtime %s",
                 self.node_id, self.address, self.registry.tasks, self.credit, len(self.pipeline.jobs),
                 self.services.runtime_name or "none")
        for job_id in reply.get("drop") or []:
            if self.pipeline.cancel(job_id):
                log.warning("job %s ended or moved to another node meanwhile; dropping it", job_id)
        if self._unconfirmed:
            log.info("sending %d recent result(s) again", len(self._unconfirmed))
            self.spawn(self._send_results([r for _, r in self._unconfirmed]))

    def on_shutdown(self) -> None:
        self._stop.set()

    def on_message(self, op: Op, header: dict[str, Any], payload: list[bytes]) -> None:
        if op not in (Op.ASSIGN, Op.CANCEL_JOB, Op.GENERATE_HELD):
            log.warning("unexpected op %s from the broker", op.value)
            return
        # Checked and typed by the op's schema (a bad one raises ProtocolError, which the reader logs);
        # an assignment's payload is paired with its jobs one by one, so one missing frame fails one job.
        h = P.parse(header)
        if isinstance(h, H.Assign):
            self._on_assign(h, payload)
        elif isinstance(h, H.CancelJob):
            for job_id in h.job_ids:
                self.pipeline.cancel(job_id)
        elif isinstance(h, H.GenerateHeld):
            self.services.generate_held(h.job_id, h.held)

    # ------------------------------------------------------------- results

    def _report_stage(self, spec: JobSpec, stage: str) -> None:
        self._stage_out[spec.job_id] = (spec.attempt, stage)
        if not self._flush_scheduled:
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush()))

    async def _flush(self) -> None:
        """Send the stage updates and results gathered during this loop turn, batched."""
        self._flush_scheduled = False
        stages_by_job, self._stage_out = self._stage_out, {}
        done, self._done_out = self._done_out, []
        # Short jobs pass several stages in one turn: report only the latest,
        # and nothing for jobs whose result goes out in this same flush.
        finished = {r.job_id for r in done}
        stages = [H.StageUpdate(j, a, st) for j, (a, st) in stages_by_job.items() if j not in finished]
        if stages:
            await self.send(H.JobStage(stages).to_wire())
        if done:
            now = timebase.now()
            self._unconfirmed.extend((now, r) for r in done)
            await self._send_results(done)

    async def _send_results(self, done: list[JobResult]) -> None:
        pack = self._pack_result
        frames = [pack(r) for r in done]  # first: packing may turn a result into a failure (the header follows)
        await self.send(H.JobDone([H.JobEnd(r.job_id, r.attempt, r.state) for r in done]).to_wire(), frames)

    # ------------------------------------------------------------- lifecycle

    async def serve(self, *, take_signals: bool = True) -> None:
        """Connect, register and serve until told to stop.

        ``take_signals``: SIGTERM/SIGINT stop the node and SIGUSR2 drains it (off where the process is not
        the node's: a replay with every role on one loop keeps its own handlers, and stops the node itself).
        """
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2) if take_signals else ()
        if take_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
            loop.add_signal_handler(signal.SIGUSR2, self._on_usr2)
        try:
            if self.leave_requested is not None and self.leave_requested.is_set():
                # The signal came before this loop could take it: leave before connecting.
                log.info("asked to leave before serving: not registering")
                return
            await self._serve(loop)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.address is None:
            self.address = read_rendezvous(self.config.deployment_dir).address
            self.follow_rendezvous = True
        self.connect(linger_ms=2000, unbounded=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        await self.services.start()
        self._loop = loop
        self._stamp.start()
        if self.liveness_sidecar:
            self._start_sidecar()
        self.start_loops()
        try:
            try:
                await self.register()
            except BrokerRestarted as e:
                # The broker moved while this register was out (a restart on a new address, followed through the
                # rendezvous file): the register sent to its successor, under way already, takes over.
                log.info("node %s: the first register went to a broker that is gone (%s); registering with the new "
                         "one", self.node_id, e)
                # A stop (a signal, the broker's Shutdown) ends this wait too: the new broker may never answer.
                registered = asyncio.ensure_future(self.registered.wait())
                stopped = asyncio.ensure_future(self._stop.wait())
                try:
                    await asyncio.wait((registered, stopped), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    registered.cancel()
                    stopped.cancel()
            await self._stop.wait()
        finally:
            await self._shutdown()

    def _start_sidecar(self) -> None:
        self._sidecar = LivenessSidecar(
            node_id=self.node_id,
            token=self.liveness_token,
            address=lambda: self.address,
            deployment_dir=self.deployment_dir,
            interval_s=lambda: self._interval_s,
            stamp=self._stamp,
            stall_limit_s=self.config.node.loop_stall_limit_s,
            blocker=self._blocker,
        )
        self._sidecar.start()

    async def _shutdown(self) -> None:
        """Cancel every job, clean up, unregister."""
        self._leaving = True
        tasks = [job.task for job in self.pipeline.jobs.values()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.node.stop_grace_s)
        await self.services.stop()
        self._stamp.stop()
        if self._sidecar is not None:
            # Stop vouching before saying goodbye, so the broker cannot see us alive after unregister.
            await asyncio.to_thread(self._sidecar.stop)
        await self.close()
        log.info("node %s stopped", self.node_id)

    # ------------------------------------------------------------- draining

    def _on_usr2(self) -> None:
        log.info("SIGUSR2 (time limit or preemption): draining")
        if self.on_preempt is not None:
            self.on_preempt()
        self.drain(self.config.node.drain_grace_s)

    def stop(self) -> None:
        """Leave at once, as on SIGTERM (the quick drain)."""
        self._stop.set()

    def drain(self, grace_s: float | None) -> None:
        """Take no new jobs, hand back the queued ones now, let running ones finish for up to ``grace_s``, then leave.

        ``None``: the default. In a Slurm job either is cut to what the job has left when the drain begins, less a
        margin (:func:`drain_grace_within`): a preemption leaves only the partition's GraceTime. That is read off
        the event loop (``scontrol`` may take seconds when a whole array is signalled at once).

        A job that ends its INIT meanwhile is handed back too, rather than start a RUN the grace may cut short.

        Jobs that finish within the grace are delivered as usual; what still
        runs after it is stopped and re-queued by the broker (the quick drain
        of SIGTERM).
        """
        if self._draining or self._stop.is_set():
            return
        self._draining = True
        self.spawn(self._drain(grace_s))

    def _hand_back(self, job_ids: list[str]) -> None:
        """Stop jobs that never started here (or only did their INIT), without a result: the broker queues them
        again, same attempt, for another node."""
        self._handed_back.update(job_ids)
        for job_id in job_ids:
            self.pipeline.cancel(job_id)
        if job_ids or self.registered.is_set():
            self.spawn(self._release(job_ids))

    def _hand_back_before_run(self, job_id: str) -> bool:
        """While draining, a job done with INIT goes back to the broker (same attempt) instead of starting RUN."""
        if not self._draining or self._stop.is_set():
            return False
        log.info("draining: job %s goes back to the broker after its INIT, rather than start a RUN here", job_id)
        self._handed_back.add(job_id)
        self.spawn(self._release([job_id]))
        return True

    async def _release(self, job_ids: list[str]) -> None:
        assert self.conn is not None
        try:
            reply, _ = await self.conn.call(H.JobIds(H.NEW_RID, job_ids).to_wire(Op.RELEASE), timeout_s=10.0)
        except (BrokerUnavailable, ProtocolError) as e:
            # Not taken: the unregister at the end of the drain re-queues them as well.
            log.warning("the broker did not take the drain notice: %s", e)
            return
        log.info("handed back %d queued job(s) to the broker", len(reply.get("released") or []))

    async def _drain(self, grace_s: float | None) -> None:
        # Jobs not started, and those between INIT and a RUN slot: a RUN begun late in the grace would be cut short
        # and run again as a new attempt; handed back, they keep theirs.
        self._hand_back(self.pipeline.not_started() + self.pipeline.waiting_for_run())
        bound = await asyncio.to_thread(_slurm_drain_grace, grace_s)
        log.info("%s", bound.describe())
        deadline = timebase.now() + bound.grace_s
        while self.pipeline.jobs and (left_s := deadline - timebase.now()) > 0:
            log.info("draining: %d running job(s) have %.0f s left to finish", len(self.pipeline.jobs), left_s)
            await asyncio.wait([j.task for j in self.pipeline.jobs.values()], timeout=left_s)
        if self.pipeline.jobs:
            log.info("drain grace over%s: stopping %d job(s); the broker re-queues them",
                     " (the Slurm job's end is near)" if bound.by_job_end else "", len(self.pipeline.jobs))
        self._stop.set()

    def _on_assign(self, h: H.Assign, payload: list[bytes]) -> None:
        timing = h.timing or []
        for i, raw in enumerate(h.jobs):
            try:
                if i >= len(payload):
                    raise ProtocolError(ErrorCode.MISSING_FIELD, f"assignment has no instance frame for job {i}")
                spec = JobSpec.from_wire(raw, f"jobs[{i}]")  # the one check of this record, which types it
                instance = P.unpack_obj(payload[i])
            except ProtocolError as e:
                # Report it FAILED, so the trainer learns why and the broker gets the node's credit back.
                result = self.pipeline.rejected(raw, f"the node cannot decode this assignment: {e}")
                log.error("bad assignment%s: %s", f" of job {result.job_id}" if result else "", e)
                if result is not None:
                    self._report_done(result)
                continue
            # False: a repeated delivery of a running job
            self.pipeline.start(spec, instance, timing[i] if i < len(timing) else None)
        if self._draining:
            # Placed before the broker heard we drain: back they go, unstarted.
            self._hand_back(self.pipeline.not_started())

    def _report_done(self, result: JobResult) -> None:
        if result.job_id in self._handed_back and result.state == P.JobState.CANCELLED.value:
            self._handed_back.discard(result.job_id)
            return  # handed back unstarted: the broker placed it elsewhere
        if not self._leaving:
            self._done_out.append(result)
            self._schedule_flush()

    def _after_stall(self, stalled_s: float) -> None:
        # The broker's messages wait unread while our loop is blocked: that silence is ours, not the broker's.
        self._last_heard = max(self._last_heard, timebase.now())


def run_node(
    config: ProrlConfig, node_id: str | None = None, address: str | None = None,
    on_preempt: Callable[[], None] | None = None, leave_requested: threading.Event | None = None,
) -> None:
    """Run a node server in the foreground until it is stopped (on a loop that refuses NaN timers).

    SIGTERM and SIGINT: the quick drain. SIGUSR2: the drain with grace (``on_preempt`` is called first).
    ``leave_requested`` set before the loop takes the signals over (a signal caught by the caller's
    handler in the meantime): the node leaves without registering.
    """
    async def main() -> None:
        await NodeServer(config, node_id=node_id, address=address, on_preempt=on_preempt,
                         leave_requested=leave_requested).serve()

    run_checked(main())
