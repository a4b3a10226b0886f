"""The INIT → RUN → EVAL pipeline of one node: three pools, phase-aware timeouts.

Each stage has its own concurrency limit. A job waits for a slot in a stage's
pool with its clock (:class:`~prorl_cli.node.clock.JobClock`) paused, so queue time never counts; only
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
import inspect
import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_cli import timebase
from prorl_cli.agent.loop import JOB_RECORDER
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import HandlerError, StageTimeout
from prorl_cli.node.clock import Arming, JobClock
from prorl_cli.node.handler import AgentHandler, JobContext, Services
from prorl_cli.node.registry import HandlerRegistry
from prorl_cli.observe import timeline as TL
from prorl_cli.observe.logs import JobLogger, formatter_for
from prorl_cli.observe.metrics import MetricSet, observe_job
from prorl_cli.protocol import STAGE_NAMES, ErrorInfo, JobResult, JobSpec, JobState, StageStats

log = logging.getLogger(__name__)

#: In-stage limit of an EVAL that runs after RUN failed (the job's own budget may be spent) without a stage cap.
EVAL_AFTER_FAILURE_S = 60.0


@dataclass(slots=True)
class RunningJob:
    """A job this node runs: its task, attempt and latest stage (what a re-registration claims)."""

    task: asyncio.Task[JobResult]
    attempt: int
    spec: JobSpec
    stage: str = JobState.INIT.value
    #: Entered its first stage (until then it waits for an INIT slot and may be handed back untouched).
    started: bool = False
    #: Its task has begun running (a task cancelled before that never runs: :meth:`Pipeline.cancel` answers for it).
    begun: bool = False
    #: INIT ended well (until RUN takes a slot it waits, and a drain may hand it back; a failed INIT never does).
    init_done: bool = False
    #: The pool whose slot it holds now (``None`` between stages, and once the slot was taken back from it).
    slot: _Pool | None = None
    #: How many stages it entered so far (tells one stage from the next).
    entries: int = 0
    #: Its stage ignored a cancel past the grace: the job was reported without it, its task is left to itself.
    abandoned: bool = False
    #: (context, handler, clock, timeline, stage_s) while it runs: what ending it from outside its task needs.
    live: tuple[_NodeJobContext, AgentHandler, JobClock, TL.Timeline, dict[str, float]] | None = None


class _NodeJobContext(JobContext):
    """A job's context on this node: its run directory's path and its logger are made on first use.

    Most short jobs never write a file nor log a line, and a ``Path`` and a
    logger per job were a good part of the node's CPU per no-op job. Reads of
    ``run_dir`` and ``log`` give what they always gave; assigning either sets
    it as before (``dataclasses.replace`` makes a copy with both set).
    """

    _pipeline: Pipeline | None = None
    _run_dir: Path | None = None
    _log: logging.Logger | None = None
    #: The job's own logger once made (its file is closed and named in the result).
    _job_log: JobLogger | None = None

    @classmethod
    def of(cls, pipeline: Pipeline, spec: JobSpec, instance: Any) -> _NodeJobContext:
        """The context of a job that ``pipeline`` runs."""
        ctx = cls(spec=spec, instance=instance, node_id=pipeline.node_id, run_dir=None,  # type: ignore[arg-type]
                  config=pipeline.config, services=pipeline.services, log=None)  # type: ignore[arg-type]
        ctx._pipeline = pipeline
        return ctx

    @property
    def run_dir(self) -> Path:
        run_dir = self._run_dir
        if run_dir is None:
            assert self._pipeline is not None
            run_dir = self._run_dir = self._pipeline._jobs_dir / self.spec.job_id
        return run_dir

    @run_dir.setter
    def run_dir(self, value: Path | None) -> None:
        self._run_dir = value

    @property
    def log(self) -> logging.Logger:
        return self._log if self._log is not None else self.job_log()

    @log.setter
    def log(self, value: logging.Logger | None) -> None:
        self._log = value

    def job_log(self) -> JobLogger:
        """The job's own logger (made now if not yet)."""
        if self._job_log is None:
            pipeline = self._pipeline
            assert pipeline is not None
            task = self.spec.task
            self._job_log = JobLogger(f"prorl.job.{task}.{self.spec.job_id}", pipeline._job_logger(task), self.run_dir,
                                      pipeline._job_log_format)
            if self._log is None:
                self._log = self._job_log
        return self._job_log


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
            elif waiter in self._waiters:  # a leave() on its way past drops a cancelled waiter itself
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
        #: Asked before a job takes its RUN slot: True takes it from this node instead (a draining node hands it
        #: back, its INIT done, rather than start a RUN its grace may cut short, spending an attempt).
        self.hand_back_before_run: Callable[[str], bool] = lambda job_id: False
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
        self._arming = Arming()
        self._loggers: dict[str, logging.Logger] = {}
        self._clocks: dict[str, JobClock] = {}
        #: The in-stage budget of jobs that set none.
        self._timeout_s = config.jobs.timeout_s
        #: How long a stage may go on after its job was cancelled or timed out before its slot is taken back.
        self._cancel_grace_s = nc.stop_grace_s
        #: Cleanups of abandoned jobs, running in the background (a reference keeps each task alive).
        self._background: set[asyncio.Task[None]] = set()
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

        :attr:`on_done` gets its result, also when it is cancelled before it began.
        ``timing``: the broker's ``{since_submit_s, events}`` for the job (its timeline's start).
        """
        if spec.job_id in self.jobs:
            return False
        task = asyncio.create_task(self._run(spec, instance, timing), name=f"job-{spec.job_id}")
        self.jobs[spec.job_id] = RunningJob(task, spec.attempt, spec)
        return True

    def cancel(self, job_id: str) -> bool:
        """Cancel a running job (its result says ``cancelled``); ``False`` if it is not running here."""
        job = self.jobs.get(job_id)
        if job is None:
            return False
        job.task.cancel()
        if job.begun:
            self._watch(job, JobState.CANCELLED)
        if not job.begun:
            # Its task never ran (a cancel_job read in the same turn as its assign) and now never will:
            # nothing ran, but the broker still needs the job's result to free its credit.
            del self.jobs[job_id]
            spec = job.spec
            self.on_done(JobResult(job_id=spec.job_id, task=spec.task, state=JobState.CANCELLED.value,
                                   attempt=spec.attempt, node_id=self.node_id, group_id=spec.group_id, meta=spec.meta))
        return True

    def not_started(self) -> list[str]:
        """Jobs still waiting for their first stage's slot (nothing of them ran here)."""
        return [job_id for job_id, job in self.jobs.items() if not job.started]

    def waiting_for_run(self) -> list[str]:
        """Jobs whose INIT ended well and that wait for a RUN slot (nothing of them runs now)."""
        return [job_id for job_id, job in self.jobs.items()
                if job.init_done and job.stage == "init" and job.slot is None and not job.abandoned]

    def stage_of(self, task_name: str | None) -> tuple[str, str] | None:
        """(job id, stage) of the job whose asyncio task is named ``task_name``, if any."""
        if task_name is None or not task_name.startswith("job-"):
            return None
        job = self.jobs.get(task_name[4:])
        return (task_name[4:], job.stage) if job is not None else None

    async def _run(self, spec: JobSpec, instance: Any, timing: Any = None) -> JobResult:
        running = self.jobs.get(spec.job_id)
        if running is not None:
            running.begun = True
        try:
            result = await self.run_job(spec, instance, timing)
        except asyncio.CancelledError:
            # Cancelled again where run_job could not take it: the broker still needs the job's one result.
            result = JobResult(job_id=spec.job_id, task=spec.task, state=JobState.CANCELLED.value, attempt=spec.attempt,
                               node_id=self.node_id, group_id=spec.group_id, meta=spec.meta)
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # a fault of the node's own outside the stages must still answer for the job
            log.exception("job %s: node fault outside the handler's stages", spec.job_id)
            result = JobResult(
                job_id=spec.job_id, task=spec.task, state=JobState.FAILED.value, attempt=spec.attempt,
                node_id=self.node_id, critical_error="node",
                error=ErrorInfo(stage="node", type=type(e).__name__, message=str(e)[:2000]).to_wire(),
                group_id=spec.group_id, meta=spec.meta,
            )
        finally:
            if running is None or self.jobs.get(spec.job_id) is running:
                self.jobs.pop(spec.job_id, None)
        if running is not None and running.abandoned:
            log.warning("job %s: its abandoned %s stage ended at last; its result went out already", spec.job_id,
                        running.stage)
            return result
        self.on_done(result)
        return result

    def _watch(self, job: RunningJob, state: JobState) -> None:
        """The job was cancelled (from outside, or by its deadline): take its slot back if its stage has not
        ended after the grace (a handler that swallows every cancel, or blocks in a thread it awaits)."""
        asyncio.get_running_loop().call_later(self._cancel_grace_s, self._abandon_if_stuck, job, job.entries, state)

    def _abandon_if_stuck(self, job: RunningJob, entries: int, state: JobState) -> None:
        job_id = job.spec.job_id
        pool = job.slot
        if (job.abandoned or job.task.done() or pool is None or job.entries != entries or job.live is None
                or self.jobs.get(job_id) is not job):
            return  # it ended, or left that stage
        ctx, handler, clock, timeline, stage_s = job.live
        stage = job.stage
        job.abandoned = True
        job.slot = None
        pool.leave()
        del self.jobs[job_id]
        now = timebase.now()
        stage_s = dict(stage_s)
        stage_s[stage] = stage_s.get(stage, 0.0) + clock.leave_stage(now)
        clock.close()
        if self._clocks.get(job_id) is clock:
            del self._clocks[job_id]
        log.error("job %s: the %r handler's %s ignored its cancel for %.1f s; its %s slot is taken back and the job "
                  "ends %s without it (its task is left running)", job_id, ctx.task, stage, self._cancel_grace_s,
                  stage, state.value)
        error: ErrorInfo | None = None
        if state == JobState.TIMED_OUT:
            exc = StageTimeout(f"{stage} ran past its limit and did not end within {self._cancel_grace_s:g} s of being "
                               f"cancelled: the {ctx.task!r} handler ignored the cancel")
            state, error = self._stage_failed(handler, ctx, stage, exc, state)
        elif stage != "eval":
            ctx.publish_trajectory()
        if ctx._cleanups:
            cleanup = asyncio.ensure_future(self._cleanup(ctx))
            self._background.add(cleanup)
            cleanup.add_done_callback(self._background.discard)
        self.on_done(self._finish(ctx, handler, state, error, stage_s, clock, timeline))

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

    async def run_job(self, spec: JobSpec, instance: Any, timing: Any = None) -> JobResult:
        """Run one job to a terminal state; never raises (cancellation included)."""
        timeline = _timeline(timing)
        timeline_token = TL.CURRENT.set(timeline)
        ctx = _NodeJobContext.of(self, spec, instance)
        # The agent loop records into the job running in this task, however the handler calls it.
        recorder_token = JOB_RECORDER.set(ctx.record_trajectory)
        job_id = spec.job_id
        clock = self._clocks[job_id] = JobClock(
            spec.timeout_s if spec.timeout_s is not None else self._timeout_s,
            asyncio.current_task(), asyncio.get_running_loop(), self._arming,
        )
        running = self.jobs.get(job_id)
        stage_s: dict[str, float] = {}
        state = JobState.DONE
        error: ErrorInfo | None = None
        handler: AgentHandler | None = None
        try:
            handler = self.registry.get(spec.task)()
            ctx.handler = handler
            if running is not None:
                running.live = (ctx, handler, clock, timeline, stage_s)
                clock.on_expire = functools.partial(self._watch, running, JobState.TIMED_OUT)
            for stage in STAGE_NAMES:
                if stage == "eval" and ctx._cleanups:
                    await self._cleanup(ctx)  # sandboxes are gone before EVAL
                outcome = await self._run_stage(handler, ctx, stage, clock, stage_s, timeline, running)
                if outcome is None and stage == "init" and running is not None:
                    running.init_done = True
                if outcome is not None:
                    state, error = outcome
                    if stage == "run" and handler.eval_after_run_failure:
                        # The handler scores what RUN left; the job keeps RUN's state and error.
                        await self._cleanup(ctx)
                        await self._run_stage(handler, ctx, "eval", clock, stage_s, timeline, running, after_failure=True)
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
            clock.close()
            if self._clocks.get(job_id) is clock:
                del self._clocks[job_id]
            if ctx._cleanups:
                try:
                    await self._cleanup(ctx)
                except asyncio.CancelledError:  # cancelled while cleaning up: all cleanups ran; the job is cancelled
                    state, error = JobState.CANCELLED, None
                    task = asyncio.current_task()
                    if task is not None:
                        task.uncancel()
        TL.CURRENT.reset(timeline_token)
        JOB_RECORDER.reset(recorder_token)
        if running is not None and running.abandoned:  # its result went out when its slot was taken back
            return JobResult(job_id=job_id, task=spec.task, state=state.value, attempt=spec.attempt, node_id=self.node_id)
        return self._finish(ctx, handler, state, error, stage_s, clock, timeline)

    def _finish(
        self, ctx: _NodeJobContext, handler: AgentHandler | None, state: JobState, error: ErrorInfo | None,
        stage_s: dict[str, float], clock: JobClock, timeline: TL.Timeline,
    ) -> JobResult:
        """The job's result: the handler's ``final_result``, its failure counted, its timeline closed."""
        spec = ctx.spec
        job_id = spec.job_id
        output: Any = None
        if handler is not None:
            try:
                output = handler.final_result(ctx)
            except BaseException as e:  # plugin code: a broken final_result still yields a result
                if isinstance(e, GeneratorExit):
                    raise
                log.exception("job %s: final_result failed", job_id)
                state = JobState.FAILED
                error = ErrorInfo(stage="final_result", type=type(e).__name__,
                                  message=str(e) if isinstance(e, Exception) else _handler_fault(spec.task, "final_result", e))
        bad_reward = _bad_reward(ctx, "final_result" if error is None else f"{error.stage}_exception")
        if bad_reward is not None and state == JobState.DONE:  # set outside EVAL (its check saw a good one), or by a callback
            state = JobState.FAILED
            error = ErrorInfo(stage="final_result", type=type(bad_reward).__name__, message=str(bad_reward))
        state_name = state.value
        if error is not None:
            group = self.failures.setdefault((spec.task, error.stage, error.type), [0, ""])
            group[0] += 1
            group[1] = error.message[:300]
            ctx.job_log().note(logging.ERROR, "%s %s in %s: %s: %s", job_id, state_name, error.stage, error.type,
                               error.message)
        timeline.instant(TL.FINISHED, {"state": state_name})
        observe_job(self.metrics, spec.task, state_name, timeline.events)
        job_log = ctx._job_log
        return JobResult(
            job_id=job_id,
            task=spec.task,
            state=state_name,
            attempt=spec.attempt,
            node_id=self.node_id,
            reward=ctx.reward,
            critical_error=error.stage if error else None,
            error=error.to_wire() if error else None,
            stage_s=stage_s,
            active_s=clock.elapsed_s,
            output=output,
            group_id=spec.group_id,
            meta=spec.meta,
            events=timeline.events,
            log_path=job_log.close() if job_log is not None else None,
        )

    def _job_logger(self, task: str) -> logging.Logger:
        logger = self._loggers.get(task)
        if logger is None:
            logger = self._loggers[task] = logging.getLogger(f"prorl.job.{task}")
        return logger

    async def _run_stage(
        self, handler: AgentHandler, ctx: JobContext, stage: str, clock: JobClock, stage_s: dict[str, float],
        timeline: TL.Timeline, running: RunningJob | None, *, after_failure: bool = False,
    ) -> tuple[JobState, ErrorInfo] | None:
        """Run one stage in its pool. Return (state, error) if the job must end here.

        ``after_failure``: EVAL after a failed RUN; a spent job budget does not
        stop it (only its stage cap, else ``EVAL_AFTER_FAILURE_S``).
        """
        try:
            if stage == "init":
                handler.check_instance(ctx)  # bad instances and settings fail INIT, naming the problem
            own_s = handler.stage_limit_s(ctx, stage)
        except BaseException as e:  # plugin code or bad settings: the job's failure, not the node's
            if isinstance(e, GeneratorExit):
                raise
            return self._stage_failed(handler, ctx, stage, _as_error(ctx.task, stage, e), JobState.FAILED)
        pool = self.pools[stage]
        if stage == "run" and not after_failure and self.hand_back_before_run(ctx.spec.job_id):
            raise asyncio.CancelledError  # handed back: its cancelled result stays here, the broker places it anew
        if not pool.try_enter():
            waited_from = timebase.now()
            await pool.enter()
            timeline.span(TL.WAIT, waited_from, timebase.now(), {"stage": stage})
        if running is not None:
            running.stage = stage
            running.started = True
            running.slot = pool
            running.entries += 1
        if not after_failure:
            self.on_stage(ctx.spec, stage)
        spec_caps = ctx.spec.stage_timeouts_s
        cap = float(spec_caps[stage]) if spec_caps and stage in spec_caps else self._stage_caps_s[stage]
        if after_failure:
            budget = None
            cap = cap if cap is not None else EVAL_AFTER_FAILURE_S
        else:
            budget = clock.remaining_s
        # The handler's own limit is enforced like the node's: past it the job is timed out, not failed.
        if own_s is not None and (cap is None or own_s < cap):
            cap, which = own_s, f"handler's {stage} limit"
        else:
            which = "stage cap"
        limit_s = budget if cap is None else (cap if budget is None else min(budget, cap))
        task = clock.task
        entered = timebase.now()
        clock.enter_stage(limit_s, entered)
        error: Exception | None = None
        try:
            if stage == "init" and handler.prepares_chat():
                await ctx.chat()  # the template with the tools' schemas (seconds, once per node): RUN finds it ready
            hook = getattr(handler, stage)(ctx)
            if not inspect.isawaitable(hook):
                raise HandlerError(f"the {ctx.task!r} handler's {stage} returned {type(hook).__name__}, not an awaitable: "
                                   f"declare it 'async def {stage}(self, ctx)'")
            await hook
        except asyncio.CancelledError:
            if not clock.expired or task is None or task.uncancel() > 0:
                raise  # cancelled from outside (also when that raced with the deadline)
        except BaseException as e:  # any handler error is the job's failure, not the node's (sys.exit() included)
            if isinstance(e, GeneratorExit):
                raise  # the coroutine is being closed: nothing may run on
            error = _as_error(ctx.task, stage, e)
            if clock.expired and task is not None:
                task.uncancel()  # the handler turned our cancel into another error
        else:
            if clock.expired and task is not None:
                task.uncancel()  # the handler swallowed our cancel: still past its time
            if task is not None and task.cancelling():
                raise asyncio.CancelledError  # it swallowed a cancel from outside: the job is still cancelled
            if stage == "eval":
                error = _bad_reward(ctx, stage)
        finally:
            if stage != "eval":
                ctx.publish_trajectory()  # what the loop recorded reaches the output, also when the stage failed
            left = timebase.now()
            stage_s[stage] = stage_s.get(stage, 0.0) + clock.leave_stage(left)
            if running is None:
                pool.leave()
            elif running.slot is pool:  # else it was taken back already (the stage ignored its cancel)
                running.slot = None
                pool.leave()
            timeline.span(TL.STAGE, entered, left, {"stage": stage})
        if clock.expired:
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
        if stage == "run" and state == JobState.TIMED_OUT:
            # The loop saw only a cancel: the node knows it was the clock.
            if ctx._trajectory is not None:
                ctx._trajectory.stop_reason = "timeout"
                ctx.publish_trajectory()
            partial = ctx.output.get("trajectory")
            if isinstance(partial, dict):  # also one a handler wrote itself (the gateway records so)
                partial["stop_reason"] = "timeout"
                if "stop_reason" in ctx.output:
                    ctx.output["stop_reason"] = "timeout"
        callback = getattr(handler, f"{stage}_exception")
        try:
            callback(ctx, exc)
        except BaseException as e:  # a broken callback must not lose the job
            if isinstance(e, GeneratorExit):
                raise
            log.exception("job %s: %s_exception raised", ctx.job_id, stage)
            return state, ErrorInfo(stage=stage, type=type(e).__name__, message=f"{stage}_exception raised: {e}")
        return state, ErrorInfo(stage=stage, type=type(exc).__name__, message=str(exc))

    async def _cleanup(self, ctx: JobContext) -> None:
        """Run and forget the job's cleanups (idempotent), logging their failures.

        A cancel that comes during one stops that one only: the others still
        run (a sandbox or workspace must not outlive its job), then it is raised.
        """
        cleanups, ctx._cleanups = ctx._cleanups, []
        cancelled: asyncio.CancelledError | None = None
        for fn in reversed(cleanups):
            try:
                await fn()
            except asyncio.CancelledError as e:
                cancelled = e
            except BaseException:  # one failed cleanup must not skip the others
                log.exception("job %s: cleanup failed", ctx.job_id)
        if cancelled is not None:
            raise cancelled


def _handler_fault(task: str, stage: str, exc: BaseException) -> str:
    """The message of a handler error that is no ``Exception`` (``sys.exit()``, a ``BaseException`` subclass)."""
    return f"the {task!r} handler's {stage} raised {type(exc).__name__}, which is no Exception: {exc!r}"


def _as_error(task: str, stage: str, exc: BaseException) -> Exception:
    """``exc`` as the job's error: a ``BaseException`` that is no ``Exception`` becomes a :class:`HandlerError` naming it."""
    if isinstance(exc, Exception):
        return exc
    error = HandlerError(_handler_fault(task, stage, exc))
    error.__cause__ = exc
    return error


def _bad_reward(ctx: JobContext, stage: str) -> HandlerError | None:
    """The error of a reward ``stage`` left that is neither ``None`` nor a finite real number (then it is reset to
    ``None``; a good one is made a ``float``)."""
    reward = ctx.reward
    if reward is None or type(reward) is float and math.isfinite(reward):
        return None
    if isinstance(reward, numbers.Real):
        value = float(reward)  # an int or a bool (``answer == gold``), or a numpy scalar msgpack could not carry
        if math.isfinite(value):
            ctx.reward = value
            return None
        problem = f"a non-finite reward {value!r}"
    else:
        problem = f"a reward of type {type(reward).__name__} ({reward!r:.100}), not a number"
    ctx.reward = None
    return HandlerError(f"the {ctx.task!r} handler's {stage} set {problem}; ctx.reward must be a finite number or None")


def _timeline(timing: Any) -> TL.Timeline:
    """A job's timeline, started where the broker says it was submitted (now when it says nothing usable)."""
    now = timebase.now()
    since_s: Any = 0.0
    events: list[TL.Event] = []
    if isinstance(timing, dict):
        given = timing.get("since_submit_s")
        if isinstance(given, (int, float)) and not isinstance(given, bool) and 0 <= given < 1e9:
            since_s = given
        broker_events = timing.get("events")
        if isinstance(broker_events, list):
            events = [e for e in broker_events if isinstance(e, list)]
    timeline = TL.Timeline(now - since_s, events)
    timeline.instant(TL.RECEIVED, at=now)
    return timeline
