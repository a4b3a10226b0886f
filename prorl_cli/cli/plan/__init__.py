"""``prorl plan``: what a cluster shape delivers for a workload, before asking Slurm for it.

Reads a workload (a results file of an earlier run, or a sim_agent-style
description) and simulates it on ``--bridges`` simulated GPUs
(:mod:`prorl_cli.planning`): rollouts/s, informative groups per GPU-hour, GPU
busy share and mean rollout time per candidate of jobs in flight, and the
recommended one. Simulated seconds of compute, deterministic. docs/training.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from prorl_cli.cli.application import App, pass_app

if TYPE_CHECKING:
    from prorl_cli.planning import Plan


def _raised(result: Plan) -> str:
    """Which candidates were simulated longer than --rollouts to reach a steady state."""
    raised = [f"{p.in_flight}: {p.simulated_rollouts}" for p in result.sweep if p.simulated_rollouts > result.rollouts]
    return f" (more for a steady state at {', '.join(raised)})" if raised else ""


def _in_flight_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"comma-separated positive integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"comma-separated positive integers, got {value!r}")
    return out


@click.command()
@click.option("--results", "results_file", metavar="FILE", type=click.Path(dir_okay=False, path_type=Path),
              help="Results (JSONL or Parquet) of an earlier run (prorl submit/sample/results --out): its rollouts' calls, tool gaps, rewards.")
@click.option("--workload", "workload_file", metavar="FILE.yaml", type=click.Path(dir_okay=False, path_type=Path),
              help="A workload description with sim_agent's fields (turns, prompt_tokens, output_tokens, ...).")
@click.option("--bridges", required=True, type=click.IntRange(min=1), help="Inference bridges (backends) to plan for.")
@click.option("--gpus-per-bridge", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs each bridge holds (GPU-hours count them; the profile models the whole bridge's server).")
@click.option("--profile", default="h100-8b", show_default=True, metavar="NAME|PATH",
              help="Simulated GPU server (prorl_cli/inference/sim_profiles/NAME.yaml, or a YAML path).")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="Rollout nodes.")
@click.option("--slots", type=click.IntRange(min=1), help="Rollout slots per node [default: no limit].")
@click.option("--group-size", type=click.IntRange(min=2), default=8, show_default=True, help="Rollouts per GRPO group.")
@click.option("--in-flight", "in_flight", default="8,16,32,64,128", show_default=True, callback=_in_flight_list,
              metavar="N,N,...", help="Candidates for the sampler's jobs in flight.")
@click.option("--rollouts", type=click.IntRange(min=4), default=1000, show_default=True,
              help="Rollouts each simulation completes (the first quarter is warm-up); a description draws this many.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of a description's draws, and of the order a results file's rollouts are replayed in.")
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="--results were recorded on a clock this many times faster (a sim replay's speedup): tool gaps x it.")
@click.option("--kv-admission", type=click.FloatRange(min=0, max=4), default=1.0, show_default=True,
              help="broker.kv_admission of the deployment (0: off).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@pass_app
def plan(
    app: App, results_file: Path | None, workload_file: Path | None, bridges: int, gpus_per_bridge: int, profile: str,
    nodes: int, slots: int | None, group_size: int, in_flight: list[int], rollouts: int, seed: int, time_scale: float,
    kv_admission: float, as_json: bool,
) -> None:
    """Predict rollouts/s and informative groups per GPU-hour of a cluster shape, per jobs in flight.

    \b
    Give the workload as --results FILE (an earlier run's results, JSONL or Parquet) or
    --workload FILE.yaml (sim_agent's fields). Each --in-flight candidate is
    simulated on --bridges simulated GPU servers (--profile) with --nodes x
    --slots rollout slots; the recommendation is the smallest in flight within
    5% of the best informative groups per GPU-hour. Figures are simulated
    seconds of compute: the same input gives the same figures. Notes after
    the table say what the figures do not: candidates above --nodes x --slots
    (they run that many at once), a recommendation at the largest candidate
    (try larger ones), results left out (failed, timed out, cancelled, no
    generate call: their cost is not in the figures), results recorded
    faster than --profile serves their calls (a sim engine's speedup: pass
    it as --time-scale).

    \b
    A workload description, e.g. swe.yaml:
      turns: [10, 40]            # calls per rollout, drawn uniformly
      prompt_tokens: 2000        # the first call's prompt
      output_tokens: {median: 150, sigma: 1.0, max: 4000}
      observation_tokens: {median: 500, sigma: 1.0}
      tool_s: {median: 1.0, sigma: 1.0, max: 60}
      p_solve: [0.1, 0.5, 0.9]   # per prompt; or one probability
    """
    import json

    from prorl_cli.exceptions import ProrlError
    from prorl_cli.inference.sim_engine import SimProfile
    from prorl_cli.planning import ClusterShape, Workload, make_plan

    if (results_file is None) == (workload_file is None):
        app.abort("give the workload as one of --results FILE or --workload FILE.yaml")
    try:
        cluster = ClusterShape(bridges=bridges, gpus_per_bridge=gpus_per_bridge, nodes=nodes, slots=slots,
                               kv_admission=kv_admission)
        cluster.validate()
        sim_profile = SimProfile.load(profile)
        if results_file is not None:
            workload = Workload.from_results(results_file, time_scale=time_scale)
        else:
            assert workload_file is not None
            workload = Workload.from_file(workload_file, rollouts, seed)
        result = make_plan(workload, sim_profile, cluster, group_size=group_size, in_flight=in_flight,
                           rollouts=rollouts, seed=seed)
    except ProrlError as e:
        app.abort(str(e))
    if workload.ignored:
        app.err_console.print(f"note: {workload_file}: {', '.join(workload.ignored)} steer a live replay and are not "
                              "used here (a description's tool times are in simulated seconds; --time-scale scales "
                              "--results)", soft_wrap=True, markup=False)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    _print_plan(app, result)


def _print_plan(app: App, result: Plan) -> None:
    from rich.table import Table

    c = result.cluster
    slots = "no slot limit" if c.slots is None else f"{c.nodes} x {c.slots} slots"
    table = Table(title=f"prorl plan: {c.bridges} bridge(s) x {c.gpus_per_bridge} GPU ({result.profile}), {slots}, "
                        f"groups of {result.group_size}")
    for name in ("in flight", "rollouts/s", "informative groups/GPU-h", "GPU busy", "rollout s", "prefix hits"):
        table.add_column(name, justify="right")
    for p in result.sweep:
        mark = " *" if p.in_flight == result.recommended.in_flight else ""
        table.add_row(f"{p.in_flight}{mark}", f"{p.rollouts_per_s:.4g}", f"{p.informative_groups_per_gpu_hour:.4g}",
                      f"{p.gpu_busy_share:.1%}", f"{p.mean_rollout_s:.1f}", f"{p.prefix_hit_rate:.1%}")
    app.console.print(f"workload: {result.workload}: {result.workload_rollouts} rollout(s), "
                      f"{result.mean_calls_per_rollout:.1f} calls each on average; P(group informative) "
                      f"{result.p_informative:.3f}; {result.rollouts} rollouts simulated per candidate"
                      + _raised(result))
    app.console.print(table)
    r = result.recommended
    app.console.print(f"recommended: --max-in-flight {r.in_flight} ({r.rollouts_per_s:.4g} rollouts/s, "
                      f"{r.informative_groups_per_gpu_hour:.4g} informative groups per GPU-hour, "
                      f"GPU busy {r.gpu_busy_share:.1%}): {result.rule}")
    for note in result.notes:
        app.console.print(f"note: {note}", soft_wrap=True, markup=False)
