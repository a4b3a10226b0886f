"""The base class of the domain handlers: settings, stage limits, tokenizer, agent loop, fallbacks.

A domain handler implements ``setup`` (INIT), ``act`` (RUN) and ``score``
(EVAL). This class wraps each in the domain's stage limit, loads the chat
tokenizer with the tool schemas the settings allow, runs the token-exact tool
loop, and turns any stage failure into the structured fallback result
``output["failure"] = {stage, type, message}`` with reward 0.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any, ClassVar

from prorl_cli.agent import ChatTokens, Trajectory, run_tool_agent
from prorl_cli.agent.loop import ToolFn
from prorl_cli.domains.settings import DomainSettings, resolve_settings
from prorl_cli.exceptions import DomainError, StageTimeout
from prorl_cli.node.handler import AgentHandler, JobContext
from prorl_cli.protocol import SamplingParams


@functools.lru_cache(maxsize=16)
def _chat(tokenizer_dir: str, tools_json: str) -> ChatTokens:
    return ChatTokens.from_pretrained(tokenizer_dir, tools=json.loads(tools_json) or None)


class DomainHandler(AgentHandler):
    """Shared machinery of the ``math``, ``code``, ``swe`` and ``search`` handlers."""

    #: The domain's defaults; ``domains.<name>`` in prorl.yaml and the instance's ``settings`` override them.
    defaults: ClassVar[DomainSettings]
    #: JSON schemas (OpenAI function format) of every tool the domain can offer, by name.
    tool_schemas: ClassVar[dict[str, dict[str, Any]]] = {}
    #: Instance fields that must be present (checked in INIT, errors name the field).
    required_fields: ClassVar[tuple[str, ...]] = ()

    # -- the three stages, implemented by each domain ------------------------------------
    async def setup(self, ctx: JobContext, settings: DomainSettings) -> None:
        """INIT work (start sandboxes, load indexes)."""

    async def act(self, ctx: JobContext, settings: DomainSettings) -> None:
        """RUN work: the agent loop; save what ``score`` needs in ``ctx.output``."""
        raise NotImplementedError

    async def score(self, ctx: JobContext, settings: DomainSettings) -> None:
        """EVAL work: set ``ctx.reward`` from what RUN saved."""
        raise NotImplementedError

    # -- AgentHandler -------------------------------------------------------------------
    def settings_for(self, ctx: JobContext) -> DomainSettings:
        """The job's effective settings (cached in ``ctx.state``)."""
        cached = ctx.state.get("settings")
        if isinstance(cached, DomainSettings):
            return cached
        inst = ctx.instance if isinstance(ctx.instance, dict) else {}
        settings = resolve_settings(
            self.defaults,
            (f"prorl.yaml: domains.{self.name}", ctx.config.domains.get(self.name)),
            (f"instance settings of job {ctx.job_id}", inst.get("settings")),
        )
        unknown = sorted(set(settings.tools) - set(self.tool_schemas))
        if unknown:
            raise DomainError(f"{self.name}: tools {unknown} do not exist; this domain offers {sorted(self.tool_schemas)}")
        ctx.state["settings"] = settings
        return settings

    async def _stage(self, stage: str, ctx: JobContext, work: Any) -> None:
        settings = self.settings_for(ctx)
        limit_s = settings.stage_timeout_s(stage)
        try:
            async with asyncio.timeout(limit_s):
                await work(ctx, settings)
        except TimeoutError as e:
            raise StageTimeout(f"{self.name}: {stage.upper()} ran past the domain's limit of {limit_s:g} s") from e

    async def init(self, ctx: JobContext) -> None:
        if not isinstance(ctx.instance, dict):
            raise DomainError(f"{self.name}: an instance must be a JSON object, got {type(ctx.instance).__name__}")
        missing = [f for f in self.required_fields if f not in ctx.instance]
        if missing:
            raise DomainError(f"{self.name}: instance of job {ctx.job_id} lacks field(s) {missing}")
        ctx.output["domain"] = self.name
        await self._stage("init", ctx, self.setup)

    async def run(self, ctx: JobContext) -> None:
        await self._stage("run", ctx, self.act)

    async def eval(self, ctx: JobContext) -> None:
        await self._stage("eval", ctx, self.score)

    def _fallback(self, ctx: JobContext, stage: str, exc: BaseException) -> None:
        ctx.reward = 0.0
        ctx.output["domain"] = self.name
        ctx.output["failure"] = {"stage": stage, "type": type(exc).__name__, "message": str(exc)[:2000]}

    def init_exception(self, ctx: JobContext, exc: BaseException) -> None:
        self._fallback(ctx, "init", exc)

    def run_exception(self, ctx: JobContext, exc: BaseException) -> None:
        self._fallback(ctx, "run", exc)

    def eval_exception(self, ctx: JobContext, exc: BaseException) -> None:
        self._fallback(ctx, "eval", exc)

    # -- helpers for the domains --------------------------------------------------------
    async def load_chat(self, ctx: JobContext, settings: DomainSettings) -> ChatTokens:
        """The chat tokenizer (instance ``tokenizer`` or ``inference.tokenizer``) with the allowed tools."""
        tokenizer = ctx.instance.get("tokenizer") or ctx.config.inference.tokenizer
        if not tokenizer:
            raise DomainError(
                f"{self.name} needs a tokenizer: instance 'tokenizer' or inference.tokenizer in prorl.yaml"
            )
        schemas = [self.tool_schemas[t] for t in settings.tools]
        # Loading a tokenizer takes seconds: off the event loop.
        chat = await asyncio.to_thread(_chat, str(tokenizer), json.dumps(schemas))
        ctx.state["chat"] = chat
        return chat

    def sampling(self, ctx: JobContext, settings: DomainSettings) -> SamplingParams:
        """The job's sampling, with the domain's ``max_tokens`` where the submitter set none."""
        wire = dict(ctx.spec.sampling or {})
        wire.setdefault("max_tokens", settings.max_tokens)
        return SamplingParams(**wire)

    async def agent_loop(
        self, ctx: JobContext, settings: DomainSettings, user: str, tools: dict[str, ToolFn]
    ) -> Trajectory:
        """System prompt + ``user``; the tool loop over the allowed ``tools``; saved as ``output["trajectory"]``."""
        chat = ctx.state.get("chat") or await self.load_chat(ctx, settings)
        allowed = {name: fn for name, fn in tools.items() if name in settings.tools}
        messages = [{"role": "system", "content": settings.system_prompt}, {"role": "user", "content": user}]
        traj = await run_tool_agent(
            ctx.generate, chat, messages, allowed, sampling=self.sampling(ctx, settings), max_turns=settings.max_turns
        )
        ctx.output["trajectory"] = traj.to_dict()
        ctx.output["turns"] = len(traj.calls)
        ctx.output["stop_reason"] = traj.stop_reason
        return traj


def final_text(traj: Trajectory) -> str:
    """The text of the last model turn (the answer when the loop stopped on a turn without tools)."""
    return traj.calls[-1].text if traj.calls else ""
