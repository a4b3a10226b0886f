"""The AgentHandler plugin API and the context a job's stages share.

A handler implements one task type through three async stages::

    class EchoHandler(AgentHandler):
        name = "echo"

        async def init(self, ctx):  ctx.state["text"] = ctx.instance["text"]
        async def run(self, ctx):   ctx.output["echo"] = ctx.state["text"]
        async def eval(self, ctx):  ctx.reward = 1.0

Stages run in separate pools on one node: INIT (start sandboxes, set up
tools), RUN (the agent loop), EVAL (score from what RUN saved; sandboxes are
already stopped). A handler may also declare

- ``defaults`` (:class:`HandlerSettings`): max turns, system prompt, image,
  per-stage limits, ``tool_timeout_s`` and its own knobs, overridden by
  ``handlers.<name>`` in prorl.yaml and by the instance's ``settings``; the
  job's effective settings are ``ctx.settings``. The node enforces the stage
  limits like its own: a stage past any limit ends the job ``timed_out``;
- ``tools`` (:class:`~prorl_cli.agent.Tool`): each declared once, it reaches
  both the chat template and the loop of :meth:`JobContext.agent`. The node
  loads the chat template with their schemas at the start of INIT.

The contract with the node is explicit: the first sandbox started is
``ctx.sandbox`` (the shipped sandbox tools run there), and the trajectory the
agent loop records is ``ctx.trajectory``, which the node writes into the
output (``trajectory``, ``stop_reason``, ``turns``) after INIT and RUN,
including a RUN that failed, timed out or was cancelled. A stage that raises
or runs out of time goes to the matching ``*_exception`` callback, and the
job still returns a well-formed result built by
:meth:`AgentHandler.final_result`. ``docs/handlers.md`` is the reference.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from prorl_cli.agent.tools import Tool, ToolFn, ToolParser
from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import ConfigError, DomainError, HandlerError, SettingsError
from prorl_cli.inference.contract import Generation
from prorl_cli.node.settings import HandlerSettings, deployment_settings, resolve_settings
from prorl_cli.protocol import JobSpec, SamplingParams, derive_seed

if TYPE_CHECKING:
    from prorl_cli.agent import ChatTokens, Trajectory
    from prorl_cli.sandbox.options import Mount, SandboxLimits
    from prorl_cli.sandbox.sandbox import Sandbox

Cleanup = Callable[[], Awaitable[None]]

__all__ = ["AgentHandler", "Generation", "HandlerSettings", "JobContext", "Services", "Tool"]


class Services:
    """What the node offers a job beyond its own data (inference, sandboxes).

    The node fills these in; the inference and sandbox subsystems implement
    them. Handlers reach them through :class:`JobContext`.
    """

    async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        raise NotImplementedError("this node has no inference wired in")

    async def start_sandbox(self, ctx: JobContext, **options: Any) -> Sandbox:
        """Start a sandbox; ``options`` are those of :meth:`JobContext.start_sandbox` that were given."""
        raise NotImplementedError("this node has no sandbox runtime wired in")


@functools.lru_cache(maxsize=32)
def _chat(tokenizer_dir: str, tools_json: str) -> ChatTokens:
    from prorl_cli.agent import ChatTokens

    return ChatTokens.from_pretrained(tokenizer_dir, tools=json.loads(tools_json) or None)


@dataclass
class JobContext:
    """Everything one job's stages share (the paper's ``job_details``).

    ``state`` is the handler's scratch space carried from INIT to RUN to EVAL;
    ``output`` is what :meth:`AgentHandler.final_result` returns by default;
    ``reward`` is the scalar reward EVAL sets; :attr:`sandbox` is the job's
    first sandbox and :attr:`trajectory` what the agent loop recorded.
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
    #: The handler running the job (set by the node; its settings and tools are the job's).
    handler: AgentHandler | None = field(default=None, repr=False)
    _cleanups: list[Cleanup] = field(default_factory=list, repr=False)
    _settings: HandlerSettings | None = field(default=None, repr=False)
    _sandbox: Sandbox | None = field(default=None, repr=False)
    _trajectory: Trajectory | None = field(default=None, repr=False)
    #: Model calls made so far (the ``n`` of the next call's seed, :meth:`generate`).
    _calls_made: int = field(default=0, repr=False)
    #: What :meth:`publish_trajectory` last wrote (trajectory id, calls, messages, stop reason): not copied twice.
    _published: tuple[int, int, int, str | None] | None = field(default=None, repr=False)

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
        """The job's sampling parameters (defaults where the submitter gave none, each field left unset)."""
        return self.spec.sampling or SamplingParams.from_given()

    @property
    def sandbox(self) -> Sandbox:
        """The job's sandbox: the first one :meth:`start_sandbox` started (the shipped sandbox tools run there).

        Assign it to make another sandbox the job's. ``ctx.state["sandbox"]``
        holds the same object, and a sandbox a handler put there itself counts
        too (handlers written before this attribute keep working). Without a
        sandbox: :class:`~prorl_cli.exceptions.HandlerError`.
        """
        sandbox = self._sandbox if self._sandbox is not None else self.state.get("sandbox")
        if sandbox is None:
            raise HandlerError(f"{self.task}: job {self.job_id} has no sandbox; start one in INIT with ctx.start_sandbox()")
        return sandbox

    @sandbox.setter
    def sandbox(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox
        self.state["sandbox"] = sandbox

    @property
    def has_sandbox(self) -> bool:
        """Whether the job has a sandbox (:attr:`sandbox` would not raise)."""
        return self._sandbox is not None or self.state.get("sandbox") is not None

    @property
    def trajectory(self) -> Trajectory:
        """The trajectory the agent loop recorded (:meth:`agent`), live while RUN goes on; read it in EVAL.

        The node writes it into the output after INIT and RUN (also a RUN that
        failed, timed out or was cancelled, with ``stop_reason`` ``error``,
        ``timeout`` or ``cancelled``). A handler that records one some other
        way (the gateway, a loop of its own) assigns it here. Before any:
        the ``trajectory`` in the output, else :class:`~prorl_cli.exceptions.HandlerError`.
        """
        if self._trajectory is not None:
            return self._trajectory
        recorded = self.output.get("trajectory")
        if isinstance(recorded, dict):
            from prorl_cli.agent import Trajectory

            return Trajectory.from_dict(recorded)
        raise HandlerError(f"{self.task}: job {self.job_id} has no trajectory; ctx.agent() in RUN records one")

    @trajectory.setter
    def trajectory(self, trajectory: Trajectory) -> None:
        self._trajectory = trajectory

    @property
    def has_trajectory(self) -> bool:
        """Whether a trajectory was recorded (:attr:`trajectory` would not raise)."""
        return self._trajectory is not None or isinstance(self.output.get("trajectory"), dict)

    def record_trajectory(self, trajectory: Trajectory) -> None:
        """Make ``trajectory`` the job's (the agent loop calls this with its live trajectory)."""
        self._trajectory = trajectory

    def publish_trajectory(self) -> None:
        """Write :attr:`trajectory` into the output (``trajectory``, ``stop_reason``, ``turns``); the node calls it.

        It runs when :meth:`agent` ends, after INIT and RUN, and before a
        ``*_exception`` callback, so the output a trainer gets always holds
        what RUN sampled.
        """
        traj = self._trajectory
        if traj is None:
            return
        # A trajectory only grows (calls, messages) or ends (stop_reason): those say whether it changed.
        state = (id(traj), len(traj.calls), len(traj.messages), traj.stop_reason)
        if state == self._published and isinstance(self.output.get("trajectory"), dict):
            return
        self.output["trajectory"] = traj.to_dict()
        self.output["stop_reason"] = traj.stop_reason
        self.output["turns"] = len(traj.calls)
        self._published = state

    @property
    def settings(self) -> HandlerSettings:
        """The job's effective handler settings (defaults < prorl.yaml ``handlers.<task>`` < instance ``settings``).

        Bad settings raise :class:`~prorl_cli.exceptions.SettingsError` naming
        where they came from (the node resolves them before INIT, so the job
        fails there).
        """
        if self._settings is None:
            handler = self.handler
            self._settings = handler.settings_for(self) if handler is not None else HandlerSettings()
        return self._settings

    def add_cleanup(self, fn: Cleanup) -> None:
        """Register an async callable run right after RUN (before EVAL), and on any failure."""
        self._cleanups.append(fn)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None) -> Generation:
        """Token-in/token-out generation through the deployment's backends.

        A seeded call is sampled with the job's ``n``-th seed, ``derive_seed(seed, n)`` for its ``n``-th call
        (the first keeps the seed): with one seed for every call, each turn would draw from the same random
        stream as the first. A rerun of the job makes the same calls with the same seeds."""
        sampling = sampling or self.sampling
        n, self._calls_made = self._calls_made, self._calls_made + 1
        if sampling.seed is not None and n:
            sampling = sampling.with_set(seed=derive_seed(sampling.seed, n))  # the fields left unset stay unset
        return await self.services.generate(self, prompt_ids, sampling)

    async def start_sandbox(
        self,
        *,
        image: str | None = None,
        network: bool | None = None,
        env: Mapping[str, str] | None = None,
        mounts: Sequence[Mount] = (),
        limits: SandboxLimits | None = None,
    ) -> Sandbox:
        """Start a sandbox in the configured runtime; it is stopped right after RUN (and on any failure).

        ``image``: an image name from the manifest or a path (default: the
        handler's settings ``image``, else its class ``image``, else
        ``sandbox.image``); ``network``: default ``sandbox.network`` (off);
        ``env``: extra environment variables; ``mounts``: host paths bound in
        (:class:`~prorl_cli.sandbox.options.Mount`, Apptainer and bubblewrap);
        ``limits``: this sandbox's memory, process and wall-time limits
        (:class:`~prorl_cli.sandbox.options.SandboxLimits`). The first sandbox
        a job starts becomes :attr:`sandbox`.
        """
        options: dict[str, Any] = {}
        chosen = image if image is not None else (self.settings.image if self.handler is not None else None)
        if chosen is not None:
            options["image"] = chosen
        if network is not None:
            options["network"] = network
        if env:
            options["env"] = dict(env)
        if mounts:
            options["mounts"] = list(mounts)
        if limits is not None:
            options["limits"] = limits
        sandbox = await self.services.start_sandbox(self, **options)
        if not self.has_sandbox:
            self.sandbox = sandbox
        return sandbox

    # -- the agent loop over the handler's declared tools ---------------------------------
    def _tools(self) -> list[Tool]:
        """The declared tools the settings enable (unknown names were refused when resolving settings)."""
        declared = self.handler.tools if self.handler is not None else ()
        enabled = self.settings.tools
        return [t for t in declared if enabled is None or t.name in enabled]

    async def chat(self) -> ChatTokens:
        """The chat tokenizer (instance ``tokenizer``, else ``inference.tokenizer``) with the enabled tools' schemas.

        Loaded once per node process and shared (a tokenizer takes seconds to
        load: off the event loop). The node calls it at the start of INIT for
        a handler that declares tools (and :attr:`AgentHandler.uses_model`).
        """
        cached = self.state.get("chat")
        if cached is not None:
            return cached
        inst = self.instance if isinstance(self.instance, dict) else {}
        tokenizer = inst.get("tokenizer") or self.config.inference.tokenizer
        if not tokenizer:
            raise ConfigError(f"{self.task} needs a tokenizer: instance 'tokenizer' or inference.tokenizer in prorl.yaml")
        schemas = json.dumps([t.spec() for t in self._tools()])
        chat = await asyncio.to_thread(_chat, str(tokenizer), schemas)
        self.state["chat"] = chat
        return chat

    def agent_sampling(self) -> SamplingParams:
        """The job's sampling, with the settings' ``max_tokens`` where the submitter set none.

        The fields neither the submitter nor the settings set stay unset (:meth:`SamplingParams.is_set`), so
        the broker's KV admission and the engine see them as the engine's defaults, not as chosen values.
        """
        sampling = self.sampling
        if self.settings.max_tokens is not None and not sampling.is_set("max_tokens"):
            sampling = sampling.with_set(max_tokens=self.settings.max_tokens)
        return sampling

    async def agent(
        self,
        user: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        tools: Mapping[str, ToolFn] | None = None,
        system: str | None = None,
        max_turns: int | None = None,
        sampling: SamplingParams | None = None,
        record: bool = True,
        parser: ToolParser | None = None,
        chat: ChatTokens | None = None,
    ) -> Trajectory:
        """Run the token-exact tool loop (:func:`~prorl_cli.agent.run_tool_agent`) on the handler's tools.

        The conversation is ``messages``, or the settings' system prompt (or
        ``system``) and ``user``. ``tools`` supplies or replaces the
        implementation of declared tools by name (a per-job closure); the
        schemas always come from the declarations. ``parser``: the tool-call
        format (default Hermes; an inline one, Search-R1's, continues the
        model's turn); ``chat``: the tokenizer's template to prompt with
        (default :meth:`chat`, whose prompt lists the tools). With ``record`` (the
        default) the loop's trajectory is :attr:`trajectory` from its first
        call on, so a RUN that fails or times out still returns its tokens,
        and it is written into the output when the loop ends. Recording does
        not depend on :meth:`generate`: a handler may wrap or replace it.
        """
        from prorl_cli.agent import run_tool_agent

        settings = self.settings
        declared = {t.name: t for t in (self.handler.tools if self.handler is not None else ())}
        extra = sorted(set(tools or {}) - set(declared))
        if extra:
            raise HandlerError(f"{self.task}: tools {extra} are not declared by the handler; declared: {sorted(declared)}")
        functions: dict[str, ToolFn] = {}
        for tool in self._tools():
            fn = (tools or {}).get(tool.name)
            if fn is None:
                if tool.fn is None:
                    raise HandlerError(f"{self.task}: tool {tool.name!r} has no implementation; pass it in tools=")
                fn = functools.partial(tool.fn, self) if tool.context else tool.fn
            functions[tool.name] = fn
        if messages is None:
            if user is None:
                raise HandlerError("ctx.agent() needs a user message or messages")
            prompt = settings.system_prompt if system is None else system
            messages = ([{"role": "system", "content": prompt}] if prompt else []) + [{"role": "user", "content": user}]
        try:
            return await run_tool_agent(
                self.generate, chat or await self.chat(), messages, functions,
                sampling=sampling or self.agent_sampling(),
                max_turns=max_turns if max_turns is not None else settings.max_turns,
                parser=parser, record_into=self.record_trajectory if record else None,
            )
        finally:
            if record:
                # In the output as soon as the loop ends, also for code that drives the hooks itself.
                self.publish_trajectory()


#: Resolved settings without instance overrides, by (handler class, id of the config), with the config
#: itself (an id is only unique while its object lives).
_BASE_SETTINGS: dict[tuple[type[AgentHandler], int], tuple[ProrlConfig, HandlerSettings]] = {}


class AgentHandler(abc.ABC):
    """Base class of task handlers. Subclasses set :attr:`name` and implement the stages."""

    name: ClassVar[str] = ""
    #: Image the handler's sandboxes use by default (resolved through the image manifest);
    #: ``defaults.image`` (a setting, overridable per deployment and instance) wins over it.
    image: ClassVar[str | None] = None
    #: The handler's settings before overrides (see :class:`HandlerSettings`).
    defaults: ClassVar[HandlerSettings] = HandlerSettings()
    #: The ``handlers.<section>`` of prorl.yaml the handler reads (default: its :attr:`name`), so a
    #: subclass under another name can share its parent's deployment settings.
    settings_section: ClassVar[str | None] = None
    #: Tools offered to the model by :meth:`JobContext.agent` (and rendered by its chat template).
    tools: ClassVar[Sequence[Tool]] = ()
    #: Whether the handler's jobs sample from the model. With declared :attr:`tools`, the node then
    #: loads the chat template (:meth:`JobContext.chat`) at the start of INIT; a handler that declares
    #: tools but never calls the model (one that applies a gold patch, say) sets it ``False``.
    uses_model: ClassVar[bool] = True
    #: Instance fields that must be present (checked before INIT; the error names them).
    required_fields: ClassVar[tuple[str, ...]] = ()
    #: Run EVAL even when RUN failed or timed out (it then scores the partial trajectory
    #: in ``ctx.output``); the job's state stays ``failed``/``timed_out``. Default: skip EVAL.
    eval_after_run_failure: ClassVar[bool] = False

    async def init(self, ctx: JobContext) -> None:  # noqa: B027 - optional: a handler with nothing to set up leaves it out
        """INIT: provision what RUN needs (a sandbox, files in it). Default: nothing.

        The node has loaded the chat template with the tools' schemas before
        (:meth:`JobContext.chat`) when the handler declares tools.
        """

    @abc.abstractmethod
    async def run(self, ctx: JobContext) -> None:
        """RUN: the agent loop. Save in ``ctx`` whatever EVAL needs."""

    @abc.abstractmethod
    async def eval(self, ctx: JobContext) -> None:
        """EVAL: score the trajectory; set ``ctx.reward``. Sandboxes are gone by now."""

    # -- settings and limits ------------------------------------------------------------
    def settings_for(self, ctx: JobContext) -> HandlerSettings:
        """The job's effective settings: ``defaults`` < ``handlers.<settings_section or name>`` in prorl.yaml < instance ``settings``.

        ``domains.<section>``, the old name of the prorl.yaml section, is read
        too (with a warning once per process); both set is a :class:`SettingsError`.
        """
        cls = type(self)
        key = (cls, id(ctx.config))
        cached = _BASE_SETTINGS.get(key)
        if cached is not None and cached[0] is ctx.config:
            base = cached[1]
        else:
            where, layer = deployment_settings(ctx.config, cls.settings_section or cls.name)
            base = resolve_settings(cls.defaults, (where, layer))
            self._check_tools(base, where)
            if len(_BASE_SETTINGS) > 256:
                _BASE_SETTINGS.clear()  # configs come and go in tests; a node has one
            _BASE_SETTINGS[key] = (ctx.config, base)
        inst = ctx.instance.get("settings") if isinstance(ctx.instance, dict) else None
        if inst is None:
            return base
        where = f"instance settings of job {ctx.job_id}"
        settings = resolve_settings(base, (where, inst))
        self._check_tools(settings, where)
        return settings

    def _check_tools(self, settings: HandlerSettings, where: str) -> None:
        if settings.tools is None:
            return
        declared = sorted(t.name for t in self.tools)
        unknown = sorted(set(settings.tools) - set(declared))
        if unknown:
            raise SettingsError(f"{where}: tools {unknown} do not exist; {self.name} offers {declared}")

    def check_instance(self, ctx: JobContext) -> None:
        """Before INIT: the instance has :attr:`required_fields` (an object then) and valid settings."""
        if self.required_fields:
            if not isinstance(ctx.instance, dict):
                raise DomainError(f"{self.name}: an instance must be a JSON object, got {type(ctx.instance).__name__}")
            missing = [f for f in self.required_fields if f not in ctx.instance]
            if missing:
                raise DomainError(f"{self.name}: instance of job {ctx.job_id} lacks field(s) {missing}")
        _ = ctx.settings

    def prepares_chat(self) -> bool:
        """Whether the node loads the chat template before INIT: the handler declares tools and uses the model."""
        return bool(self.tools) and self.uses_model

    def stage_limit_s(self, ctx: JobContext, stage: str) -> float | None:
        """This job's limit of ``stage`` from the handler's settings (``None``: only the node's limits)."""
        return (ctx._settings or ctx.settings).stage_timeout_s(stage)

    # -- fallbacks ----------------------------------------------------------------------
    def record_failure(self, ctx: JobContext, stage: str, exc: BaseException) -> None:
        """Reward 0 and ``output["failure"] = {stage, type, message}``; what RUN recorded stays."""
        ctx.reward = 0.0
        ctx.output["failure"] = {"stage": stage, "type": type(exc).__name__, "message": str(exc)[:2000]}

    def init_exception(self, ctx: JobContext, exc: BaseException) -> None:
        """INIT failed or timed out; fill in a fallback result. Default: :meth:`record_failure`."""
        self.record_failure(ctx, "init", exc)

    def run_exception(self, ctx: JobContext, exc: BaseException) -> None:
        """RUN failed or timed out; fill in a fallback result. Default: :meth:`record_failure`.

        What RUN recorded so far is ``ctx.trajectory``, already written into
        ``ctx.output`` (``trajectory``, with ``stop_reason`` ``timeout``,
        ``error`` or ``cancelled``), and goes to the trainer with the result.
        """
        self.record_failure(ctx, "run", exc)

    def eval_exception(self, ctx: JobContext, exc: BaseException) -> None:
        """EVAL failed or timed out; fill in a fallback result. Default: :meth:`record_failure`."""
        self.record_failure(ctx, "eval", exc)

    def final_result(self, ctx: JobContext) -> Any:
        """The job's output as sent to the trainer (msgpack-serialisable). Default: ``ctx.output``."""
        return ctx.output


def final_text(traj: Trajectory) -> str:
    """The text of the last model turn (the answer when the loop stopped on a turn without tools)."""
    return traj.calls[-1].text if traj.calls else ""
