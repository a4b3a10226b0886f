"""``prorl sample``: GRPO groups with DAPO dynamic sampling, from the command line.

The instances of TASKS become prompts of
:class:`prorl_cli.training.sampler.DapoSampler`; each step collects
``--target-groups`` informative groups (rewards that differ) of
``--group-size`` rollouts, with a live line of informative / filtered /
failed / cancelled / in flight. docs/training.md.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.common import (
    check_out_path,
    connect,
    load_task_file,
    sampling_of,
    sampling_options,
)
from prorl_cli.cli.naming import deployment_option

if TYPE_CHECKING:
    from rich.live import Live

    from prorl_cli.training.sampler import StepBatch, StepStats


@click.command()
@click.argument("tasks_file", metavar="TASKS", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--task", required=True, metavar="NAME", help="Handler (task type) to run every prompt with.")
@click.option("--group-size", required=True, type=click.IntRange(min=2), help="Rollouts per prompt (the GRPO group).")
@click.option("--target-groups", required=True, type=click.IntRange(min=1),
              help="Informative groups (rewards that differ) to collect per step.")
@click.option("--max-in-flight", type=click.IntRange(min=1),
              help="Jobs running at once [default: 2 x group size x target groups].")
@click.option("--steps", type=click.IntRange(min=1), default=1, show_default=True, help="Steps to collect.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="JSONL: one result per line with its group_id and step. .parquet: training samples (docs/training.md).")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), help="In-stage time budget per job.")
@click.option("--id-prefix", metavar="PREFIX",
              help="Run id: job ids and group ids start with it [default: dapo-<random>, new for each run; the same "
                   "PREFIX again gets the jobs the broker still holds under its ids back, not new ones].")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@deployment_option
@sampling_options
@pass_app
def sample(
    app: App, tasks_file: Path, task: str, group_size: int, target_groups: int, max_in_flight: int | None,
    steps: int, out: Path | None, timeout_s: float | None, id_prefix: str | None, address: str | None,
    fmt: str | None, skip_bad_rows: bool, max_tokens: int | None, temperature: float | None, top_p: float | None, seed: int | None,
    sampling_json: str | None, sampling_file: Path | None,
) -> None:
    """Collect GRPO groups of the prompts in TASKS with DAPO dynamic sampling.

    \b
    Each prompt is run --group-size times; a group whose rewards are all equal
    teaches nothing and is filtered, and new prompts are submitted until
    --target-groups informative groups are in, per step. TASKS is read as by
    `prorl submit` (JSONL or Parquet; domain rows through --format).
    """
    from rich.text import Text

    from prorl_cli.exceptions import ProrlError
    from prorl_cli.training.sampler import BlockingDapoSampler, SamplerConfig

    sampling = sampling_of(app, max_tokens, temperature, top_p, seed, sampling_json, sampling_file)
    # The same loaders as plain submit: JSONL or Parquet, domain rows through their --format.
    instances = load_task_file(app, task, tasks_file, fmt, skip_bad_rows)
    if not instances:
        app.abort(f"{tasks_file}: no instances")
    if out is not None:
        check_out_path(app, out)
    cfg = SamplerConfig(group_size=group_size, target_groups=target_groups, max_in_flight=max_in_flight,
                        run_id=id_prefix or f"dapo-{uuid.uuid4().hex[:10]}", timeout_s=timeout_s, sampling=sampling)
    batches: list[StepBatch] = []
    with connect(app, address) as client:
        sampler = BlockingDapoSampler(client, task, instances, cfg)
        try:
            with live_line(app) as live:
                sampler.sampler.on_progress = lambda st: live.update(Text(progress_text(st, target_groups)))
                for _step in range(steps):
                    batch = sampler.step(policy_version=0)
                    live.update(Text(progress_text(batch.stats, target_groups)))
                    batches.append(batch)
        except ProrlError as e:
            app.abort(f"dynamic sampling failed: {e}")
        finally:
            sampler.close()
    if out is not None:
        write_groups(app, batches, out)
    total = sum(len(b.groups) for b in batches)
    filtered = sum(b.stats.filtered for b in batches)
    cancelled = sum(b.stats.cancelled_jobs for b in batches)
    app.console.print(f"{total} informative group(s) of {group_size}; {filtered} filtered, {cancelled} job(s) cancelled"
                      + (f"; results in {out}" if out else ""))


@contextmanager
def live_line(app: App) -> Iterator[Live]:
    """The live line on stderr; it ends with its newline off a terminal too (a log file, a pipe), where rich
    leaves the last frame without one and the next line (an ``error:``) would run on after it."""
    from rich.live import Live
    from rich.text import Text

    try:
        with Live(Text("starting"), console=app.err_console, transient=False, refresh_per_second=8) as live:
            yield live
    finally:
        if not app.err_console.is_terminal:
            app.err_console.line()


def progress_text(stats: StepStats, target: int) -> str:
    """The live line of a step: informative of target, filtered, failed, cancelled, in flight."""
    return (
        f"step {stats.step}: informative {stats.informative}/{target}, filtered {stats.filtered}, "
        f"failed {stats.failed_groups}, cancelled {stats.cancelled_jobs}, in flight {stats.in_flight}"
    )


def write_groups(app: App, batches: list[StepBatch], out: Path) -> None:
    """JSONL: one result per line with its ``group_id`` and ``step``; ``.parquet``: training samples (docs/training.md)."""
    if out.suffix == ".parquet":
        from prorl_cli.training.export import write_samples_parquet
        from prorl_cli.training.samples import samples_from_results

        samples = [s for b in batches for s in samples_from_results(b.results, group_of=b.group_of).samples]
        if not samples:
            app.abort(f"{out}: no result has a 'trajectory' in its output; write .jsonl to keep whole results")
        write_samples_parquet(out, samples)
        return
    with out.open("w") as f:
        for b in batches:
            for g in b.groups:
                for r in g.results:
                    f.write(json.dumps({**r.to_wire(), "group_id": g.group_id, "step": b.step}) + "\n")
