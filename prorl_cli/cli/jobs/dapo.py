"""``prorl submit --dapo``: data generation with DAPO dynamic sampling from the command line.

A hook on the ``submit`` command (:func:`with_dapo_options`), kept apart from
the plain submission path: with ``--dapo`` the instances become prompts of
:class:`prorl_cli.training.sampler.DapoSampler`, and the command collects
``--target-groups`` informative groups of ``--group-size`` rollouts per
step, with a live line of informative / filtered / failed / cancelled / in
flight.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from prorl_cli.cli.application import App

if TYPE_CHECKING:
    from prorl_cli.training.sampler import StepBatch, StepStats

DAPO_OPTIONS = [
    click.Option(["--dapo"], is_flag=True, help="Dynamic sampling: keep only groups whose rewards differ (needs --group-size, --target-groups)."),
    click.Option(["--group-size"], type=click.IntRange(min=2), help="With --dapo: rollouts per prompt (the GRPO group)."),
    click.Option(["--target-groups"], type=click.IntRange(min=1), help="With --dapo: informative groups to collect per step."),
    click.Option(["--max-in-flight"], type=click.IntRange(min=1), help="With --dapo: jobs running at once [default: 2 x group size x target]."),
    click.Option(["--dapo-steps"], type=click.IntRange(min=1), default=1, show_default=True, help="With --dapo: steps to collect."),
]


def with_dapo_options(cmd: click.Command) -> click.Command:
    """Add the ``--dapo`` options to ``submit``; without ``--dapo`` the command runs unchanged."""
    original = cmd.callback
    assert original is not None
    cmd.params.extend(DAPO_OPTIONS)

    @functools.wraps(original)
    def callback(**kwargs: Any) -> Any:
        dapo = kwargs.pop("dapo")
        opts = {k: kwargs.pop(k) for k in ("group_size", "target_groups", "max_in_flight", "dapo_steps")}
        if not dapo:
            given = [f"--{k.replace('_', '-')}" for k in ("group_size", "target_groups", "max_in_flight") if opts[k] is not None]
            if given:
                raise click.UsageError(f"{', '.join(given)} need --dapo")
            return original(**kwargs)
        if opts["group_size"] is None or opts["target_groups"] is None:
            raise click.UsageError("--dapo needs --group-size and --target-groups")
        if kwargs.get("detach"):
            raise click.UsageError("--dapo collects groups as they finish; it cannot --detach")
        if kwargs.get("n", 1) != 1:
            raise click.UsageError("--dapo samples --group-size rollouts per prompt; do not combine it with -n/--n")
        app = click.get_current_context().find_object(App)
        assert app is not None
        run_dapo(app, **kwargs, **opts)
        return None

    cmd.callback = callback
    return cmd


def progress_text(stats: StepStats, target: int) -> str:
    return (
        f"step {stats.step}: informative {stats.informative}/{target}, filtered {stats.filtered}, "
        f"failed {stats.failed_groups}, cancelled {stats.cancelled_jobs}, in flight {stats.in_flight}"
    )


def run_dapo(
    app: App, *, tasks_file: Path, task: str, out: Path | None, timeout_s: float | None, id_prefix: str | None,
    address: str | None, group_size: int, target_groups: int, max_in_flight: int | None, dapo_steps: int,
    max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
    sampling_json: str | None = None, sampling_file: Path | None = None, fmt: str | None = None, **_: Any,
) -> None:
    from rich.live import Live
    from rich.text import Text

    from prorl_cli.cli.jobs import connect, load_task_file, sampling_from_options
    from prorl_cli.exceptions import ProrlError
    from prorl_cli.training.sampler import BlockingDapoSampler, SamplerConfig

    sampling = sampling_from_options(app, sampling_json, sampling_file,
                                     {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed})
    # The same loaders as plain submit: JSONL or Parquet, domain rows through their --format.
    instances = load_task_file(app, task, tasks_file, fmt)
    if not instances:
        app.abort(f"{tasks_file}: no instances")
    cfg = SamplerConfig(group_size=group_size, target_groups=target_groups, max_in_flight=max_in_flight,
                        run_id=id_prefix or "dapo", timeout_s=timeout_s, sampling=sampling)
    batches: list[StepBatch] = []
    with connect(app, address) as client:
        sampler = BlockingDapoSampler(client, task, instances, cfg)
        try:
            with Live(Text("starting"), console=app.err_console, transient=False, refresh_per_second=8) as live:
                sampler.sampler.on_progress = lambda st: live.update(Text(progress_text(st, target_groups)))
                for _step in range(dapo_steps):
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
