"""An in-process engine for scripted bridges: fixed answers after a delay, and counts of what it did."""

from __future__ import annotations

import asyncio
import threading

from prorl_cli.inference.contract import Engine, Generation
from prorl_cli.protocol import SamplingParams


class CountingEngine(Engine):
    """Returns fixed ids after ``delay_s`` (a cancellable wait, like a real engine's step loop); counts what it did.

    Unlike :class:`prorl_cli.testing.scripted_engine.ScriptedEngine` (a script of assistant turns
    encoded with a real tokenizer, served by a bridge in a child process), this one has no script and
    no tokenizer: every call answers ids ``[7, 8]``, and a test running the bridge in its own process
    (:class:`tests.fakes.bridges.ThreadBridge`) reads ``started``/``finished``/``cancelled`` and waits
    on ``first_started``/``first_ended`` to see what reached the engine.
    """

    model = "scripted"
    max_model_len = 1 << 20

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.started = 0
        self.finished = 0
        self.cancelled = 0
        self.first_started = threading.Event()
        self.first_ended = threading.Event()

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        self.started += 1
        self.first_started.set()
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            self.first_ended.set()
            raise
        self.finished += 1
        self.first_ended.set()
        return Generation([7, 8], [-0.5, -0.25], "stop")
