"""The INIT → RUN → EVAL pipeline of one node: three pools, phase-aware timeouts.

Each stage has its own concurrency limit. A job waits for a slot in a stage's
pool with its :class:`PausableTimer` paused, so queue time never counts; only
in-stage time does, against the job's total budget and the stage's own cap.
A stage that raises or times out goes to the handler's ``*_exception``
callback and the job ends with a well-formed :class:`JobResult` whose
``critical_error`` names the stage. Cleanups (sandboxes) run right after RUN,
before EVAL, and on every failure path.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import StageTimeout
from prorl_cli.node.handler import AgentHandler, JobContext, Services
from prorl_cli.node.registry import HandlerRegistry
from prorl_cli.node.timer import PausableTimer
from prorl_cli.observe import timeline as TL
from prorl_cli.observe.logs import JobLogger, formatter_for
from prorl_cli.observe.metrics import MetricSet, observe_job
from prorl_cli.protocol import STAGE_NAMES, ErrorInfo, JobResult, JobSpec, JobState, StageStats

log = logging.getLogger(__name__)

#: In-stage limit of an EVAL that runs after RUN failed (the job's own budget may be spent) without a stage cap.
EVAL_AFTER_FAILURE_S = 60.0


@dataclass
class RunningJob:
    """A job this node runs: its task, attempt and latest stage (what a re-registration claims)."""

    task: asyncio.Task[JobResult]
    attempt: int
    stage: str = JobState.INIT.value
    #: Entered its first stage (until then it waits for an INIT slot and may be handed back untouched).
    started: bool = False


class _Pool:
    """The slots of one stage: at most ``limit`` jobs in it, the others wait in arrival order.

    A job that finds a free slot and nobody waiting takes it without a
    suspension (:meth:`try_enter`): a short job passes INIT, RUN and EVAL in
    one step of its task instead of handing itself between three queues.
    """

    __slots__ = ("limit", "active", "_waiters")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def try_enter(self) -> bool:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return True
        return False

    async def enter(self) -> None:
        """Wait for a slot (first come, first served); it is handed over by :meth:`leave`."""
        if self.try_enter():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.leave()  # the slot was ours already: pass it on
            else:
                self._waiters.remove(waiter)
            raise

    def leave(self) -> None:
        # Hand the slot straight to the next waiter (``active`` stays), else free it.
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def stats(self) -> StageStats:
        return StageStats(active=self.active, queued=self.queued, limit=self.limit)


class _Deadline:
    """One timer handle per job, armed for the deadline of the stage it is in.

    The handle is armed at the end of the loop turn in which the stage began
    (by :class:`_Arming`), at the stage's own deadline, and only if the job is
    still in a stage by then: a job whose stages all finish without waiting
    never gets one. A later stage whose deadline is no earlier than the armed
    one keeps the handle (a job that runs its stages back to back has one
    deadline: its budget); a handle that fires before the current stage's
    deadline (it was armed for an earlier one) is armed again; it does
    nothing while the job is between stages. When it fires in a stage it
    cancels the job's task and says so, so a timeout is told apart from a
    cancel from outside.
    """

    __slots__ = ("task", "loop", "arming", "at", "expired", "_handle", "_handle_at", "_queued", "_held_left_s")

    def __init__(self, task: asyncio.Task[Any] | None, loop: asyncio.AbstractEventLoop, arming: _Arming) -> None:
        self.task = task
        self.loop = loop
        self.arming = arming
        #: The current stage's deadline (loop time), ``None`` between stages or without a limit.
        self.at: float | None = None
        #: Whether it fired in the current stage.
        self.expired = False
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = 0.0
        self._queued = False
        #: Seconds the stage had left when a hold began (a generate call held at the broker); ``None`` otherwise.
        self._held_left_s: float | None = None

    def enter_stage(self, limit_s: float | None) -> None:
        self.expired = False
        self._held_left_s = None
        if limit_s is None:
            self.at = None
            return
        self._set_at(self.loop.time() + limit_s)

    def _set_at(self, at: float) -> None:
        self.at = at
        if not self._queued and (self._handle is None or self._handle_at > self.at):
            self._queued = True
            self.arming.add(self)

    def leave_stage(self) -> None:
        self.at = None
        self._held_left_s = None

    def hold(self) -> None:
        """Stop the clock: the job waits on a call held at the broker (a handle that fires meanwhile does nothing)."""
        if self.at is not None:
            self._held_left_s = max(0.0, self.at - self.loop.time())
            self.at = None

    def release(self) -> None:
        """Run the clock again with the time the stage had left when :meth:`hold` stopped it."""
        if self._held_left_s is not None:
            left, self._held_left_s = self._held_left_s, None
            self._set_at(self.loop.time() + left)

    def close(self) -> None:
        self.at = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def arm(self) -> None:
        """Arm (or re-arm earlier) for the current stage's deadline, if the job is still in a stage."""
        self._queued = False
        at = self.at
        if at is None or (self._handle is not None and self._handle_at <= at):
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle_at = at
        self._handle = self.loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self.at is None:
            return
        if self._handle_at < self.at:
            self.arm()
            return
        self.expired = True
        if self.task is not None:
            self.task.cancel()


class _Arming:
    """Arms the deadlines of the jobs that entered a stage in this loop turn, once, at its end."""

    __slots__ = ("_waiting", "_scheduled")

    def __init__(self) -> None:
        self._waiting: list[_Deadline] = []
        self._scheduled = False

    def add(self, deadline: _Deadline) -> None:
        self._waiting.append(deadline)
        if not self._scheduled:
            self._scheduled = True
            deadline.loop.call_soon(self._arm_all)

    def _arm_all(self) -> None:
        self._scheduled = False
        waiting, self._waiting = self._waiting, []
        for deadline in waiting:
            deadline.arm()


class _JobClock:
    """A job's timer and deadline, which stand still while one of its generate calls is held at the broker."""

    __slots__ = ("timer", "deadline", "in_stage", "held")

    def __init__(self, timer: PausableTimer, deadline: _Deadline) -> None:
        self.timer = timer
        self.deadline = deadline
        self.in_stage = False
        self.held = False

    def enter_stage(self, limit_s: float | None) -> None:
        self.in_stage = True
        self.deadline.enter_stage(limit_s)
        if self.held:
            self.deadline.hold()
        else:
            self.timer.resume()

    def leave_stage(self) -> None:
        self.in_stage = False
        self.deadline.leave_stage()
        self.timer.pause()

    def hold(self, held: bool) -> None:
        if held == self.held:
            return
        self.held = held
        if not self.in_stage:
            return
        if held:
            self.timer.pause()
            self.deadline.hold()
        else:
            self.timer.resume()
            self.deadline.release()


class Pipeline:
    """Runs jobs through the three stage pools of one node."""

    def __init__(
        self,
        config: ProrlConfig,
        registry: HandlerRegistry,
        services: Services,
        node_id: str,
        run_dir: Path,
        on_stage: Callable[[JobSpec, str], None],
        on_done: Callable[[JobResult], None],
    ) -> None:
        self.config = config
        self.registry = registry
        self.services = services
        self.node_id = node_id
        self.run_dir = run_dir
        self.on_stage = on_stage
        self.on_done = on_done
        nc = config.node
        self.pools = {
            name: _Pool(limit) for name, limit in zip(STAGE_NAMES, (nc.n_init, nc.n_run, nc.n_eval), strict=True)
        }
        jc = config.jobs
        #: Each stage's cap from the config (a job's ``stage_timeouts_s`` overrides it).
        self._stage_caps_s: dict[str, float | None] = {
            "init": jc.init_timeout_s, "run": jc.run_timeout_s, "eval": jc.eval_timeout_s,
        }
        #: Jobs running on this node, by id: the one table of them.
        self.jobs: dict[str, RunningJob] = {}
        self._jobs_dir = run_dir / "jobs"
        self._arming = _Arming()
        self._loggers: dict[str, logging.Logger] = {}
        self._clocks: dict[str, _JobClock] = {}
        #: The node's Prometheus figures; each job is counted from its timeline when it ends.
        self.metrics = MetricSet()
        #: Failed jobs by (task, stage, error type): [count, latest message] (sent in heartbeats).
        self.failures: dict[tuple[str, str, str], list[Any]] = {}
        self._job_log_format = formatter_for("job", "%(asctime)s %(levelname)s %(name)s: %(message)s")

    def hold_clock(self, job_id: str, held: bool) -> None:
        """Stop (``held``) or restart the clocks of a running job while one of its generate calls is held at the broker.

        Held time counts against neither the stage's limit nor the job's
        budget, nor its ``stage_s``/``active_s``: a paused cluster times out no job.
        """
        clock = self._clocks.get(job_id)
        if clock is not None:
            clock.hold(held)

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: pool.stats().to_wire() for name, pool in self.pools.items()}

    def start(self, spec: JobSpec, instance: Any, timing: Any = None) -> bool:
        """Start running a job in the background; ``False`` if it already runs (a repeated delivery).

        :attr:`on_done` gets its result unless the job was dropped with :meth:`drop`.
        ``timing``: the broker's ``{since_submit_s, events}`` for the job (its timeline's start).
        """
        if spec.job_id in self.jobs:
            return False
        task = asyncio.create_task(self._run(spec, instance, timing), name=f"job-{spec.job_id}")
        self.jobs[spec.job_id] = RunningJob(task, spec.attempt)
        task.add_done_callback(functools.partial(self._cancelled_before_start, spec))
        return True

    def _cancelled_before_start(self, spec: JobSpec, task: asyncio.Task[JobResult]) -> None:
        # run_job never raises, so a cancelled task never started: a cancel_job read in the same turn
        # as its assign. Nothing ran, but the broker still needs the job's result to free its credit.
        if not task.cancelled():
            return
        job = self.jobs.get(spec.job_id)
        if job is not None and job.task is task:
            del self.jobs[spec.job_id]
        self.on_done(JobResult(job_id=spec.job_id, task=spec.task, state=JobState.CANCELLED.value,
                               attempt=spec.attempt, node_id=self.node_id, group_id=spec.group_id, meta=spec.meta))

    def cancel(self, job_id: str) -> bool:
        """Cancel a running job (its result says ``cancelled``); ``False`` if it is not running here."""
        job = self.jobs.get(job_id)
        if job is None:
            return False
        job.task.cancel()
        return True

    def not_started(self) -> list[str]:
        """Jobs still waiting for their first stage's slot (nothing of them ran here)."""
        return [job_id for job_id, job in self.jobs.items() if not job.started]

    def stage_of(self, task_name: str | None) -> tuple[str, str] | None:
        """(job id, stage) of the job whose asyncio task is named ``task_name``, if any."""
        if task_name is None or not task_name.startswith("job-"):
            return None
        job = self.jobs.get(task_name[4:])
        return (task_name[4:], job.stage) if job is not None else None

    async def _run(self, spec: JobSpec, instance: Any, timing: Any = None) -> JobResult:
        try:
            result = await self.run_job(spec, instance, timing)
        except Exception as e:  # a fault of the node's own outside the stages must still answer for the job
            log.exception("job %s: node fault outside the handler's stages", spec.job_id)
            result = JobResult(
                job_id=spec.job_id, task=spec.task, state=JobState.FAILED.value, attempt=spec.attempt,
                node_id=self.node_id, critical_error="node",
                error=ErrorInfo(stage="node", type=type(e).__name__, message=str(e)[:2000]).to_wire(),
                group_id=spec.group_id, meta=spec.meta,
            )
        finally:
            self.jobs.pop(spec.job_id, None)
        self.on_done(result)
        return result

    def rejected(self, raw: Any, problem: str) -> JobResult | None:
        """The FAILED result of an assignment this node cannot decode, or ``None`` without a job id to report on."""
        if not isinstance(raw, dict) or not isinstance(raw.get("job_id"), str) or not raw["job_id"]:
            return None
        attempt = raw.get("attempt")
        group_id, meta = raw.get("group_id"), raw.get("meta")
        return JobResult(
            job_id=raw["job_id"],
            task=raw["task"] if isinstance(raw.get("task"), str) else "",
            state=JobState.FAILED.value,
            attempt=attempt if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt >= 1 else 1,
            node_id=self.node_id,
            critical_error="assign",
            error=ErrorInfo(stage="assign", type="ProtocolError", message=problem).to_wire(),
            group_id=group_id if isinstance(group_id, str) else None,
            meta=meta if isinstance(meta, dict) else None,
        )

    def _stage_budget_s(self, spec: JobSpec, stage: str) -> float | None:
        if spec.stage_timeouts_s and stage in spec.stage_timeouts_s:
            return float(spec.stage_timeouts_s[stage])
        return self._stage_caps_s[stage]

    async def run_job(self, spec: JobSpec, instance: Any, timing: Any = None) -> JobResult:
        """Run one job to a terminal state; never raises (cancellation included)."""
        timeline = _timeline(timing)
        timeline_token = TL.CURRENT.set(timeline)
        run_dir = self._jobs_dir / spec.job_id
        job_log = JobLogger(f"prorl.job.{spec.task}.{spec.job_id}", self._job_logger(spec.task), run_dir, self._job_log_format)
        ctx = JobContext(
            spec=spec,
            instance=instance,
            node_id=self.node_id,
            run_dir=run_dir,
            config=self.config,
            services=self.services,
            log=job_log,
        )
        timer = PausableTimer(spec.timeout_s if spec.timeout_s is not None else self.config.jobs.timeout_s)
        deadline = _Deadline(asyncio.current_task(), asyncio.get_running_loop(), self._arming)
        clock = self._clocks[spec.job_id] = _JobClock(timer, deadline)
        stage_s: dict[str, float] = {}
        state = JobState.DONE
        error: ErrorInfo | None = None
        handler: AgentHandler | None = None
        try:
            handler = self.registry.get(spec.task)()
            ctx.handler = handler
            for stage in STAGE_NAMES:
                if stage == "eval" and ctx._cleanups:
                    await self._cleanup(ctx)  # sandboxes are gone before EVAL
                outcome = await self._run_stage(handler, ctx, stage, timer, deadline, stage_s)
                if outcome is not None:
                    state, error = outcome
                    if stage == "run" and handler.eval_after_run_failure:
                        # The handler scores what RUN left; the job keeps RUN's state and error.
                        await self._cleanup(ctx)
                        await self._run_stage(handler, ctx, "eval", timer, deadline, stage_s, after_failure=True)
                    break
        except asyncio.CancelledError:
            state = JobState.CANCELLED
            error = None
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        except Exception as e:  # handler construction or lookup: report it, keep the node alive
            state = JobState.FAILED
            error = ErrorInfo(stage="init", type=type(e).__name__, message=str(e))
        finally:
            deadline.close()
            if self._clocks.get(spec.job_id) is clock:
                del self._clocks[spec.job_id]
            if ctx._cleanups:
                await self._cleanup(ctx)
        output: Any = None
        if handler is not None:
            try:
                output = handler.final_result(ctx)
            except Exception as e:  # plugin code: a broken final_result still yields a result
                log.exception("job %s: final_result failed", spec.job_id)
                state = JobState.FAILED
                error = ErrorInfo(stage="final_result", type=type(e).__name__, message=str(e))
        if error is not None:
            group = self.failures.setdefault((spec.task, error.stage, error.type), [0, ""])
            group[0] += 1
            group[1] = error.message[:300]
            job_log.note(logging.ERROR, "%s %s in %s: %s: %s", spec.job_id, state.value, error.stage, error.type, error.message)
        timeline.instant(TL.FINISHED, {"state": state.value})
        TL.CURRENT.reset(timeline_token)
        observe_job(self.metrics, spec.task, state.value, timeline.events)
        return JobResult(
            job_id=spec.job_id,
            task=spec.task,
            state=state.value,
            attempt=spec.attempt,
            node_id=self.node_id,
            reward=ctx.reward,
            critical_error=error.stage if error else None,
            error=error.to_wire() if error else None,
            stage_s=stage_s,
            active_s=timer.elapsed_s,
            output=output,
            group_id=spec.group_id,
            meta=spec.meta,
            events=timeline.events,
            log_path=job_log.close(),
        )

    def _job_logger(self, task: str) -> logging.Logger:
        logger = self._loggers.get(task)
        if logger is None:
            logger = self._loggers[task] = logging.getLogger(f"prorl.job.{task}")
        return logger

    async def _run_stage(
        self, handler: AgentHandler, ctx: JobContext, stage: str, timer: PausableTimer, deadline: _Deadline,
        stage_s: dict[str, float], *, after_failure: bool = False,
    ) -> tuple[JobState, ErrorInfo] | None:
        """Run one stage in its pool. Return (state, error) if the job must end here.

        ``after_failure``: EVAL after a failed RUN; a spent job budget does not
        stop it (only its stage cap, else ``EVAL_AFTER_FAILURE_S``).
        """
        try:
            if stage == "init":
                handler.check_instance(ctx)  # bad instances and settings fail INIT, naming the problem
            own_s = handler.stage_limit_s(ctx, stage)
        except Exception as e:  # plugin code or bad settings: the job's failure, not the node's
            return self._stage_failed(handler, ctx, stage, e, JobState.FAILED)
        pool = self.pools[stage]
        timeline = TL.CURRENT.get()
        if not pool.try_enter():
            waited_from = time.monotonic()
            await pool.enter()
            if timeline is not None:
                timeline.span(TL.WAIT, waited_from, time.monotonic(), {"stage": stage})
        entered = time.monotonic()
        running = self.jobs.get(ctx.job_id)
        if running is not None:
            running.stage = stage
            running.started = True
        if not after_failure:
            self.on_stage(ctx.spec, stage)
        budget = timer.remaining_s
        cap = self._stage_budget_s(ctx.spec, stage)
        if after_failure:
            budget = None
            cap = cap if cap is not None else EVAL_AFTER_FAILURE_S
        # The handler's own limit is enforced like the node's: past it the job is timed out, not failed.
        if own_s is not None and (cap is None or own_s < cap):
            cap, which = own_s, f"handler's {stage} limit"
        else:
            which = "stage cap"
        limit_s = budget if cap is None else (cap if budget is None else min(budget, cap))
        task = deadline.task
        clock = self._clocks.get(ctx.job_id)
        counted_s = timer.elapsed_s
        if clock is not None and clock.deadline is deadline:
            clock.enter_stage(limit_s)
        else:
            clock = None
            deadline.enter_stage(limit_s)
            timer.resume()
        error: Exception | None = None
        try:
            await getattr(handler, stage)(ctx)
        except asyncio.CancelledError:
            if not deadline.expired or task is None or task.uncancel() > 0:
                raise  # cancelled from outside (also when that raced with the deadline)
        except Exception as e:  # any handler error is the job's failure, not the node's
            error = e
            if deadline.expired and task is not None:
                task.uncancel()  # the handler turned our cancel into another error
        else:
            if deadline.expired and task is not None:
                task.uncancel()  # the handler swallowed our cancel: still past its time
        finally:
            if clock is not None:
                clock.leave_stage()
            else:
                deadline.leave_stage()
                timer.pause()
            stage_s[stage] = stage_s.get(stage, 0.0) + timer.elapsed_s - counted_s
            pool.leave()
            if timeline is not None:
                timeline.span(TL.STAGE, entered, time.monotonic(), {"stage": stage})
        if deadline.expired:
            if cap is None or (budget is not None and budget <= cap):
                which = "job budget"
            exc = StageTimeout(f"{stage} ran past its {which} of {limit_s:.3f} s (in-stage time only, held generate calls not counted)")
            return self._stage_failed(handler, ctx, stage, exc, JobState.TIMED_OUT)
        if error is not None:
            # A handler's own clock (StageTimeout) ends the job the same way as the node's.
            state = JobState.TIMED_OUT if isinstance(error, StageTimeout) else JobState.FAILED
            return self._stage_failed(handler, ctx, stage, error, state)
        return None

    def _stage_failed(
        self, handler: AgentHandler, ctx: JobContext, stage: str, exc: BaseException, state: JobState
    ) -> tuple[JobState, ErrorInfo]:
        log.info("job %s: %s %s: %s: %s", ctx.job_id, stage, state.value, type(exc).__name__, exc)
        partial = ctx.output.get("trajectory")
        if stage == "run" and isinstance(partial, dict) and state == JobState.TIMED_OUT:
            # The loop saw only a cancel: the node knows it was the clock.
            partial["stop_reason"] = "timeout"
            if "stop_reason" in ctx.output:
                ctx.output["stop_reason"] = "timeout"
        callback = getattr(handler, f"{stage}_exception")
        try:
            callback(ctx, exc)
        except Exception as e:  # a broken callback must not lose the job
            log.exception("job %s: %s_exception raised", ctx.job_id, stage)
            return state, ErrorInfo(stage=stage, type=type(e).__name__, message=f"{stage}_exception raised: {e}")
        return state, ErrorInfo(stage=stage, type=type(exc).__name__, message=str(exc))

    async def _cleanup(self, ctx: JobContext) -> None:
        """Run and forget the job's cleanups (idempotent), logging their failures."""
        cleanups, ctx._cleanups = ctx._cleanups, []
        for fn in reversed(cleanups):
            try:
                await fn()
            except Exception:  # one failed cleanup must not skip the others
                log.exception("job %s: cleanup failed", ctx.job_id)


def _timeline(timing: Any) -> TL.Timeline:
    """A job's timeline, started where the broker says it was submitted (now when it says nothing usable)."""
    now = time.monotonic()
    since_s = timing.get("since_submit_s") if isinstance(timing, dict) else None
    if not isinstance(since_s, int | float) or isinstance(since_s, bool) or not 0 <= since_s < 1e9:
        since_s = 0.0
    broker_events = timing.get("events") if isinstance(timing, dict) else None
    events = [e for e in broker_events if isinstance(e, list)] if isinstance(broker_events, list) else []
    timeline = TL.Timeline(now - since_s, events)
    timeline.instant(TL.RECEIVED, at=now)
    return timeline
