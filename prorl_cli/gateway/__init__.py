"""An OpenAI- and Anthropic-compatible endpoint per job, token-exact, so unmodified agents run as handlers.

Host-side agents (in the node process)::

    async def run(self, ctx):
        gw = await prorl_cli.gateway.session(ctx)
        client = openai.AsyncOpenAI(base_url=gw.base_url(), api_key=gw.api_key)
        ...                                    # every call is ctx.generate, recorded token-exactly
        ctx.output["trajectory"] is kept current after every call

Harnesses inside a sandbox: ``handlers/harness.py`` (docs/harness.md).
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import TYPE_CHECKING, Any

from prorl_cli.exceptions import DomainError

if TYPE_CHECKING:
    from prorl_cli.agent.chat import ChatTokens
    from prorl_cli.agent.trajectory import Trajectory
    from prorl_cli.gateway.server import Gateway, JobGateway
    from prorl_cli.node.handler import JobContext
    from prorl_cli.protocol import SamplingParams

__all__ = ["session", "tokenizer_of"]


@functools.lru_cache(maxsize=8)
def _tokenizer(tokenizer_dir: str) -> Any:
    from prorl_cli.agent.chat import ChatTokens

    return ChatTokens.from_pretrained(tokenizer_dir).tokenizer


@functools.lru_cache(maxsize=64)
def _chat(tokenizer_dir: str, tools_json: str) -> ChatTokens:
    """The template with one tool list (cheap once the tokenizer is loaded: one rendering)."""
    from prorl_cli.agent.chat import ChatTokens

    return ChatTokens(_tokenizer(tokenizer_dir), tools=json.loads(tools_json) or None)


def tokenizer_of(ctx: JobContext) -> str:
    """The job's tokenizer directory: instance ``tokenizer``, else ``inference.tokenizer``."""
    inst = ctx.instance if isinstance(ctx.instance, dict) else {}
    tokenizer = inst.get("tokenizer") or ctx.config.inference.tokenizer
    if not tokenizer:
        raise DomainError("the gateway needs a tokenizer: instance 'tokenizer' or inference.tokenizer in prorl.yaml")
    return str(tokenizer)


async def session(
    ctx: JobContext, *, parser: str = "hermes", models: tuple[str, ...] = ("prorl",),
    sampling: SamplingParams | None = None, gateway: Gateway | None = None, max_concurrent: int = 8,
    tool_choice_retries: int = 2,
) -> JobGateway:
    """Open this job's endpoint on the node's gateway; it closes after RUN (``ctx.add_cleanup``).

    ``parser`` names the tool parser (``prorl_cli.agent.get_tool_parser``);
    ``sampling`` is the default a request's own fields override (the job's);
    ``max_concurrent`` bounds the job's requests answered at once;
    ``tool_choice_retries`` bounds the turns sampled again when one does not honour ``tool_choice``.
    The trajectory is kept in ``ctx.output["trajectory"]`` after every call,
    so a RUN that fails or is cancelled still returns what was sampled.
    """
    from prorl_cli.agent.tools import get_tool_parser
    from prorl_cli.gateway.server import Gateway

    tokenizer = tokenizer_of(ctx)
    await asyncio.to_thread(_tokenizer, tokenizer)  # seconds, once per node: off the event loop

    def chat_for(tools: list[dict[str, Any]] | None) -> ChatTokens:
        return _chat(tokenizer, json.dumps(tools or []))

    def record(traj: Trajectory) -> None:
        ctx.output["trajectory"] = traj.to_dict()
        ctx.output["turns"] = len(traj.calls)

    gw = gateway or await Gateway.get()
    job = gw.open_job(ctx.job_id, generate=ctx.generate, chat_for=chat_for, parser=get_tool_parser(parser),
                      sampling=sampling or ctx.sampling, models=models, on_record=record,
                      max_concurrent=max_concurrent, tool_choice_retries=tool_choice_retries)
    ctx.add_cleanup(job.close)
    return job
