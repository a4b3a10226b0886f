"""``prorl serve inference``: build the engine, bridge it to the broker, clean up.

Order: start the engine (vLLM takes a minute or more on a CPU), then find
the broker and register. SIGTERM/SIGINT at any point stop a vLLM child
(SIGTERM, then SIGKILL) and unregister; an engine that dies ends the bridge
with a non-zero exit code. A deployment stopped on purpose (``prorl stop``)
while the bridge started ends it with exit code 0 instead of a wait for a
broker that is not coming (the stop record, :mod:`prorl_cli.rendezvous`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from prorl_cli.config import ProrlConfig
from prorl_cli.exceptions import DeploymentStopped, InferenceError
from prorl_cli.inference.bridge import InferenceBridge
from prorl_cli.inference.contract import Engine
from prorl_cli.rendezvous import await_rendezvous

log = logging.getLogger(__name__)


@dataclass
class BridgeOptions:
    """What ``prorl serve inference`` was asked to run."""

    engine: str = "vllm"  # vllm | transformers | sim
    model: str | None = None
    attach: str | None = None
    backend_id: str | None = None
    address: str | None = None
    port: int = 0  # vLLM's port (0: a free one)
    max_model_len: int | None = None
    capacity: int = 64
    vllm_args: list[str] = field(default_factory=list)
    broker_wait_s: float = 300.0


def vllm_args(configured: list[str], given: list[str], *, reload_in_place: bool) -> list[str]:
    """vLLM's flags: the configured ones, the command line's, and prorl's reload extension when reloading in place.

    A worker extension of the user's own (``--worker-extension-cls`` among the
    flags) wins; it must then provide ``prorl_reload_weights`` (subclass
    :class:`~prorl_cli.inference.vllm_reload.ReloadWorkerExtension`).
    """
    from prorl_cli.inference.vllm_reload import WORKER_EXTENSION

    args = [*configured, *given]
    if reload_in_place and not any(a.split("=", 1)[0] == "--worker-extension-cls" for a in args):
        args += ["--worker-extension-cls", WORKER_EXTENSION]
    return args


def build_engine(opts: BridgeOptions, config: ProrlConfig, backend_id: str) -> Engine:
    """The engine the options describe; :class:`InferenceError` names a bad combination."""
    ic = config.inference
    if opts.attach:
        from prorl_cli.inference.openai_engine import OpenAIEngine

        return OpenAIEngine(opts.attach, timeout_s=ic.generate_timeout_s, backend_id=backend_id,
                            reload_in_place=ic.vllm_reload_in_place, concurrency=opts.capacity)
    if opts.engine == "sim":
        from prorl_cli.inference.sim_engine import SimEngine, SimProfile

        profile = SimProfile.load(ic.sim_profile, speedup=ic.sim_speedup, max_model_len=opts.max_model_len)
        if opts.model:
            profile.model = opts.model  # the name it registers (handlers may route on it)
        ledger = Path(ic.sim_ledger_dir) / f"{backend_id}.json" if ic.sim_ledger_dir else None
        return SimEngine(profile, backend_id=backend_id, ledger_path=ledger)
    if not opts.model:
        raise InferenceError("give --model DIR (a local model directory) or --attach URL")
    if opts.engine == "transformers":
        from prorl_cli.inference.transformers_engine import TransformersEngine

        return TransformersEngine(opts.model, max_model_len=opts.max_model_len, backend_id=backend_id,
                                  device=ic.device)
    if opts.engine != "vllm":
        raise InferenceError(f"--engine {opts.engine!r}: expected vllm, transformers or sim")
    from prorl_cli.inference.vllm_server import VLLMChildEngine, VLLMServer

    server = VLLMServer(
        opts.model,
        port=opts.port,
        max_model_len=opts.max_model_len,
        extra_args=vllm_args(ic.vllm_args, opts.vllm_args, reload_in_place=ic.vllm_reload_in_place),
        # vLLM serves /collective_rpc (in-place reload) only with its dev endpoints on.
        env={**({"VLLM_SERVER_DEV_MODE": "1"} if ic.vllm_reload_in_place else {}), **ic.vllm_env},
        log_path=config.deployment_dir / "inference" / f"{backend_id}.vllm.log",
    )
    return VLLMChildEngine(
        server, timeout_s=ic.generate_timeout_s, startup_timeout_s=ic.startup_timeout_s, backend_id=backend_id,
        reload_in_place=ic.vllm_reload_in_place, concurrency=opts.capacity,
    )


async def run_bridge(opts: BridgeOptions, config: ProrlConfig, leave_requested: threading.Event | None = None) -> int:
    """Run until stopped; return the process exit code (1 when the engine died).

    ``leave_requested`` set by the time this loop takes SIGTERM over (a signal the caller's handler
    caught in the meantime): the bridge leaves without starting its engine.
    """
    host = socket.gethostname()
    backend_id = opts.backend_id or f"{host}-{os.getpid()}"
    engine = build_engine(opts, config, backend_id)
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    bridge: InferenceBridge | None = None

    def on_signal() -> None:
        if bridge is not None:
            bridge.stop()
        elif main is not None:
            main.cancel()  # still starting the engine: abandon the start, clean up below

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        if leave_requested is not None and leave_requested.is_set():
            log.info("asked to leave before the engine started: not starting it")
            return 0
        log.info("starting engine %s (model %s)", opts.attach and "attach" or opts.engine, opts.model or opts.attach)
        await engine.start()
        log.info("engine ready: model %s, max_model_len %s", engine.model, engine.max_model_len)
        address = opts.address
        if address is None:
            try:
                info = await await_rendezvous(config.deployment_dir, opts.broker_wait_s, live=True)
            except DeploymentStopped as e:
                log.info("%s while this bridge started: not waiting for a broker", e)
                return 0
            address = info.address
        bridge = InferenceBridge(
            engine, address=address, backend_id=backend_id, host=host, capacity=opts.capacity,
            deployment_dir=config.deployment_dir,
        )
        bridge.follow_rendezvous = opts.address is None
        await bridge.serve()
        if bridge.failure:
            log.error("bridge stopped: %s", bridge.failure)
            return 1
        return 0
    except asyncio.CancelledError:
        log.info("stopped while starting")
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await engine.close()
