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
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import StageTimeout
from prorl_cli.node.handler import AgentHandler, JobContext, Services
from prorl_cli.node.registry import HandlerRegistry
from prorl_cli.node.timer import PausableTimer
from prorl_cli.protocol import ErrorInfo, JobResult, JobSpec, JobState, StageStats

log = logging.getLogger(__name__)

STAGE_NAMES = ("init", "run", "eval")


@dataclass
class _Pool:
    limit: int
    sem: asyncio.Semaphore
    active: int = 0
    queued: int = 0

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
    ) -> None:
        self.config = config
        self.registry = registry
        self.services = services
        self.node_id = node_id
        self.run_dir = run_dir
        self.on_stage = on_stage
        nc = config.node
        self.pools = {
            name: _Pool(limit, asyncio.Semaphore(limit))
            for name, limit in zip(STAGE_NAMES, (nc.n_init, nc.n_run, nc.n_eval), strict=True)
        }
        self.tasks: dict[str, asyncio.Task[JobResult]] = {}
        self._jobs_dir = run_dir / "jobs"
        self._loggers: dict[str, logging.Logger] = {}

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: pool.stats().to_wire() for name, pool in self.pools.items()}

    def _stage_budget_s(self, spec: JobSpec, stage: str) -> float | None:
        if spec.stage_timeouts_s and stage in spec.stage_timeouts_s:
            return float(spec.stage_timeouts_s[stage])
        value: float | None = getattr(self.config.jobs, f"{stage}_timeout_s")
        return value

    async def run_job(self, spec: JobSpec, instance: Any) -> JobResult:
        """Run one job to a terminal state; never raises (cancellation included)."""
        ctx = JobContext(
            spec=spec,
            instance=instance,
            node_id=self.node_id,
            run_dir=self._jobs_dir / spec.job_id,
            config=self.config,
            services=self.services,
            log=self._job_logger(spec.task),
        )
        timer = PausableTimer(spec.timeout_s if spec.timeout_s is not None else self.config.jobs.timeout_s)
        stage_s: dict[str, float] = {}
        state = JobState.DONE
        error: ErrorInfo | None = None
        handler: AgentHandler | None = None
        try:
            handler = self.registry.get(spec.task)()
            for stage in STAGE_NAMES:
                if stage == "eval":
                    await self._cleanup(ctx)  # sandboxes are gone before EVAL
                outcome = await self._run_stage(handler, ctx, stage, timer, stage_s)
                if outcome is not None:
                    state, error = outcome
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
            await self._cleanup(ctx)
        output: Any = None
        if handler is not None:
            try:
                output = handler.final_result(ctx)
            except Exception as e:  # plugin code: a broken final_result still yields a result
                log.exception("job %s: final_result failed", spec.job_id)
                state = JobState.FAILED
                error = ErrorInfo(stage="final_result", type=type(e).__name__, message=str(e))
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
        )

    def _job_logger(self, task: str) -> logging.Logger:
        logger = self._loggers.get(task)
        if logger is None:
            logger = self._loggers[task] = logging.getLogger(f"prorl.job.{task}")
        return logger

    async def _run_stage(
        self, handler: AgentHandler, ctx: JobContext, stage: str, timer: PausableTimer, stage_s: dict[str, float]
    ) -> tuple[JobState, ErrorInfo] | None:
        """Run one stage in its pool. Return (state, error) if the job must end here."""
        pool = self.pools[stage]
        pool.queued += 1
        try:
            await pool.sem.acquire()
        finally:
            pool.queued -= 1
        pool.active += 1
        self.on_stage(ctx.spec, stage)
        budget = timer.remaining_s
        cap = self._stage_budget_s(ctx.spec, stage)
        limit_s = budget if cap is None else (cap if budget is None else min(budget, cap))
        # One timer handle per stage (cheaper than asyncio.timeout on this hot path):
        # when it fires it cancels the job's task and says so, so a timeout is
        # told apart from a cancel that came from outside.
        task = asyncio.current_task()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            if task is not None:
                task.cancel()

        deadline = asyncio.get_running_loop().call_later(limit_s, expire) if limit_s is not None else None
        timer.resume()
        error: Exception | None = None
        try:
            await getattr(handler, stage)(ctx)
        except asyncio.CancelledError:
            if not expired or task is None or task.uncancel() > 0:
                raise  # cancelled from outside (also when that raced with the deadline)
        except Exception as e:  # any handler error is the job's failure, not the node's
            error = e
            if expired and task is not None:
                task.uncancel()  # the handler turned our cancel into another error
        else:
            if expired and task is not None:
                task.uncancel()  # the handler swallowed our cancel: still past its time
        finally:
            if deadline is not None:
                deadline.cancel()
            stage_s[stage] = stage_s.get(stage, 0.0) + timer.pause()
            pool.active -= 1
            pool.sem.release()
        if expired:
            which = "job budget" if cap is None or (budget is not None and budget <= cap) else "stage cap"
            exc = StageTimeout(f"{stage} ran past its {which} of {limit_s:.3f} s (in-stage time only)")
            return self._stage_failed(handler, ctx, stage, exc, JobState.TIMED_OUT)
        if error is not None:
            return self._stage_failed(handler, ctx, stage, error, JobState.FAILED)
        return None

    def _stage_failed(
        self, handler: AgentHandler, ctx: JobContext, stage: str, exc: BaseException, state: JobState
    ) -> tuple[JobState, ErrorInfo]:
        log.info("job %s: %s %s: %s: %s", ctx.job_id, stage, state.value, type(exc).__name__, exc)
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
