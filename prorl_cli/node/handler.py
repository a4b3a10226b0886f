"""The AgentHandler plugin API and the context a job's stages share.

A handler implements one task type through three async stages::

    class EchoHandler(AgentHandler):
        name = "echo"

        async def init(self, ctx):  ctx.state["text"] = ctx.instance["text"]
        async def run(self, ctx):   ctx.output["echo"] = ctx.state["text"]
        async def eval(self, ctx):  ctx.reward = 1.0

Stages run in separate pools on one node: INIT (start sandboxes, set up
tools), RUN (the agent loop), EVAL (score from what RUN saved; sandboxes are
already stopped). A stage that raises or runs out of time goes to the
matching ``*_exception`` callback, and the job still returns a well-formed
result built by :meth:`AgentHandler.final_result`.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from prorl_cli.protocol import JobSpec, SamplingParams

if TYPE_CHECKING:
    from prorl_cli.config import ProrlConfig
    from prorl_cli.inference.contract import Generation
    from prorl_cli.sandbox.sandbox import Sandbox

Cleanup = Callable[[], Awaitable[None]]


class Services:
    """What the node offers a job beyond its own data (inference, sandboxes).

    The node fills these in; the inference and sandbox subsystems implement
    them. Handlers reach them through :class:`JobContext`.
    """

    async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        raise NotImplementedError("this node has no inference wired in")

    async def start_sandbox(self, ctx: JobContext, **options: Any) -> Sandbox:
        raise NotImplementedError("this node has no sandbox runtime wired in")


@dataclass
class JobContext:
    """Everything one job's stages share (the paper's ``job_details``).

    ``state`` is the handler's scratch space carried from INIT to RUN to EVAL;
    ``output`` is what :meth:`AgentHandler.final_result` returns by default;
    ``reward`` is the scalar reward EVAL sets.
    """

    spec: JobSpec
    instance: Any
    node_id: str
    run_dir: Path
    config: ProrlConfig
    services: Services
    log: logging.Logger
    state: dict[str, Any] = field(default_factory=dict)
    output: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    _cleanups: list[Cleanup] = field(default_factory=list, repr=False)

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def task(self) -> str:
        return self.spec.task

    @property
    def attempt(self) -> int:
        return self.spec.attempt

    @property
    def sampling(self) -> SamplingParams:
        """The job's sampling parameters (defaults where the submitter gave none)."""
        return SamplingParams(**(self.spec.sampling or {}))

    def add_cleanup(self, fn: Cleanup) -> None:
        """Register an async callable run right after RUN (before EVAL), and on any failure."""
        self._cleanups.append(fn)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None) -> Generation:
        """Token-in/token-out generation through the deployment's backends."""
        return await self.services.generate(self, prompt_ids, sampling or self.sampling)

    async def start_sandbox(self, **options: Any) -> Sandbox:
        """Start a sandbox in the configured runtime; it is stopped after RUN."""
        return await self.services.start_sandbox(self, **options)


class AgentHandler(abc.ABC):
    """Base class of task handlers. Subclasses set :attr:`name` and implement the stages."""

    name: ClassVar[str] = ""
    #: Image the handler's sandboxes use by default (resolved through the image manifest).
    image: ClassVar[str | None] = None
    #: Run EVAL even when RUN failed or timed out (it then scores the partial trajectory
    #: in ``ctx.output``); the job's state stays ``failed``/``timed_out``. Default: skip EVAL.
    eval_after_run_failure: ClassVar[bool] = False

    @abc.abstractmethod
    async def init(self, ctx: JobContext) -> None:
        """INIT: provision what RUN needs (sandbox, tools)."""

    @abc.abstractmethod
    async def run(self, ctx: JobContext) -> None:
        """RUN: the agent loop. Save in ``ctx`` whatever EVAL needs."""

    @abc.abstractmethod
    async def eval(self, ctx: JobContext) -> None:
        """EVAL: score the trajectory; set ``ctx.reward``. Sandboxes are gone by now."""

    def init_exception(self, ctx: JobContext, exc: BaseException) -> None:
        """INIT failed or timed out; fill in a fallback result. Default: reward 0."""
        ctx.reward = 0.0

    def run_exception(self, ctx: JobContext, exc: BaseException) -> None:
        """RUN failed or timed out; fill in a fallback result. Default: reward 0.

        What RUN recorded so far is still in ``ctx.output`` (the agent loop keeps
        ``ctx.output["trajectory"]`` current, with ``stop_reason`` ``timeout``,
        ``error`` or ``cancelled``), and goes to the trainer with the result.
        """
        ctx.reward = 0.0

    def eval_exception(self, ctx: JobContext, exc: BaseException) -> None:
        """EVAL failed or timed out; fill in a fallback result. Default: reward 0."""
        ctx.reward = 0.0

    def final_result(self, ctx: JobContext) -> Any:
        """The job's output as sent to the trainer (msgpack-serialisable). Default: ``ctx.output``."""
        return ctx.output
