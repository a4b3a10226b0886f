"""prorl's agent loop as a veRL ``AgentLoopBase`` subclass (this module imports veRL; import it only with veRL installed).

veRL's ``AgentLoopWorker`` builds each sample's loop with
``hydra.utils.instantiate({"_target_": "<module>.<class>"}, trainer_config=...,
server_manager=..., tokenizer=..., ...)``, so the class must live at a module's
top level where hydra can import it by name: a class defined inside a
function registers under a ``<locals>`` path hydra cannot locate. Importing
this module registers it as ``prorl`` in veRL's registry of the importing
process; veRL's Ray workers are other processes, so a trainer names it in its
``agent_loop_config_path`` file (see docs/training.md).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import Any

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from prorl_cli.client import AsyncRolloutClient
from prorl_cli.exceptions import ConfigError
from prorl_cli.integrations.verl import AGENT_NAME, fit_lengths, plain, run_job

#: One client per event loop: veRL's worker keeps one loop for its lifetime, and a client's sockets belong to one loop.
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncRolloutClient] = weakref.WeakKeyDictionary()


def client_for_loop() -> AsyncRolloutClient:
    """The running loop's client of deployment ``$PRORL_DEPLOYMENT`` (created on first use)."""
    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None:
        client = _CLIENTS[loop] = AsyncRolloutClient(os.environ.get("PRORL_DEPLOYMENT"))
    return client


async def close_client() -> None:
    """Close the running loop's client, if one was made (a worker's shutdown, or a test's)."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.close()


@register(AGENT_NAME)
class ProrlAgentLoop(AgentLoopBase):
    """Runs each sample as one prorl job; see :mod:`prorl_cli.integrations.verl`.

    Constructed by veRL's worker with its usual arguments (trainer config,
    server manager, tokenizer, ...); the server manager is not called, as
    generation goes through prorl's backends.
    """

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        task = kwargs.get("prorl_task") or os.environ.get("PRORL_TASK")
        if not task:
            raise ConfigError("prorl agent loop: no task (a 'prorl_task' dataset field or $PRORL_TASK)")
        instance = plain(kwargs.get("prorl_instance", kwargs))
        sampling = dict(sampling_params)
        # veRL's worker passes no per-call token limit; its response_length bounds the whole response.
        sampling.setdefault("max_tokens", int(self.rollout_config.response_length))
        out, result = await run_job(client_for_loop(), str(task), instance, sampling)
        out.extra_fields["prorl_truncated"] = fit_lengths(
            out, int(self.rollout_config.prompt_length), int(self.rollout_config.response_length))
        return AgentLoopOutput(
            prompt_ids=out.prompt_ids, response_ids=out.response_ids, response_mask=out.response_mask,
            response_logprobs=out.response_logprobs, reward_score=out.reward_score, num_turns=out.num_turns,
            metrics=AgentLoopMetrics(generate_sequences=float(result.stage_s.get("run", 0.0))),
            extra_fields=out.extra_fields,
        )
