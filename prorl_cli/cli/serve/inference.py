"""``prorl serve inference``: start (or attach to) vLLM and bridge it to the broker."""

from __future__ import annotations

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.naming import deployment_option


@click.command("inference", context_settings={"ignore_unknown_options": True})
@deployment_option
@click.option("--engine", type=click.Choice(["vllm", "transformers", "sim"]),
              help="vllm (child process), transformers (in-process CPU reference) or sim (a simulated GPU server, no model).")
@click.option("--sim-profile", metavar="NAME|FILE", help="sim engine: a profile name (default h100-8b) or a YAML file.")
@click.option("--sim-speedup", type=float, help="sim engine: run this many times faster than the profiled GPU.")
@click.option("--model", metavar="DIR", help="Local model directory (never downloaded).")
@click.option("--attach", metavar="URL", help="Use an already running OpenAI-compatible server instead of starting one.")
@click.option("--backend-id", metavar="ID", help="Name of this backend (default: HOST-PID).")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: read the rendezvous file).")
@click.option("--port", type=int, default=0, help="Port for the vLLM child (default: a free one).")
@click.option("--max-model-len", type=int, help="Longest prompt + output in tokens.")
@click.option("--capacity", type=int, help="Generate requests served at once.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@pass_app
def serve_inference(
    app: App,
    engine: str | None,
    sim_profile: str | None,
    sim_speedup: float | None,
    model: str | None,
    attach: str | None,
    backend_id: str | None,
    address: str | None,
    port: int,
    max_model_len: int | None,
    capacity: int | None,
    vllm_args: tuple[str, ...],
) -> None:
    """Start (or attach to) vLLM and bridge it to the broker.

    \b
    prorl serve inference --model DIR                   vLLM child process
    prorl serve inference --model DIR -- --dtype float32   extra vLLM flags
    prorl serve inference --attach http://host:8000/v1  a running server
    prorl serve inference --engine transformers --model DIR   CPU reference
    prorl serve inference --engine sim [--sim-speedup 10]     simulated H100 (8B), no GPU
    """
    app.override(inference__engine=engine, inference__capacity=capacity,
                 inference__sim_profile=sim_profile, inference__sim_speedup=sim_speedup)
    app.setup_logging("inference")
    import asyncio

    from prorl_cli.exceptions import ProrlError
    from prorl_cli.inference.serve import BridgeOptions, run_bridge

    ic = app.config.inference
    extra = [a for a in vllm_args if a != "--"]
    if extra and (attach or ic.engine != "vllm"):
        app.abort(f"extra arguments {extra} are vLLM flags; they need --engine vllm without --attach")
    opts = BridgeOptions(
        engine=ic.engine,
        model=model,
        attach=attach,
        backend_id=backend_id,
        address=address,
        port=port,
        max_model_len=max_model_len,
        capacity=ic.capacity,
        vllm_args=extra,
    )
    from prorl_cli.slurm.identity import SlurmIdentity
    from prorl_cli.slurm.roles import broker_requeue_watch, slurm_lifecycle

    identity = SlurmIdentity.from_env()
    if identity.in_slurm and backend_id is None:
        opts.backend_id = identity.member_id("inference")  # the same name after a requeue
    try:
        # In a Slurm job, SIGUSR2 (time limit, preemption) stops the bridge and requeues the task; while the
        # broker is away, a requeued broker job held for Slurm's delay is made eligible.
        deployment_dir = app.config.deployment_dir
        with slurm_lifecycle(identity.in_slurm, deployment_dir, opts.backend_id) as signals, \
                broker_requeue_watch(deployment_dir, identity):
            code = asyncio.run(run_bridge(opts, app.config, leave_requested=signals.leave))
    except ProrlError as e:
        app.abort(str(e))
    raise SystemExit(code)
