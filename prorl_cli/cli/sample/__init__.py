"""``prorl sample``: GRPO groups with DAPO dynamic sampling, from the command line.

The instances of TASKS become prompts of
:class:`prorl_cli.training.sampler.DapoSampler`; each step collects
``--target-groups`` informative groups (rewards that differ) of
``--group-size`` rollouts, with a live line of informative / filtered /
failed / cancelled / in flight (off a terminal, as in a Slurm log: a line per
step and now and then). A step that cannot reach its target stops the command
with the sampler's error (``--max-groups-per-step``,
``--max-consecutive-failures``, ``--step-timeout-s``), failures grouped as
``prorl submit`` groups them. docs/training.md.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.common import (
    check_out_path,
    connect,
    load_task_rows,
    sampling_of,
    sampling_options,
)
from prorl_cli.cli.naming import deployment_option

if TYPE_CHECKING:
    from rich.live import Live
    from rich.text import Text

    from prorl_cli.client import RolloutClient
    from prorl_cli.exceptions import SamplerError
    from prorl_cli.training.sampler import StepBatch, StepStats

#: Off a terminal (an sbatch log, a pipe), a progress line at most this often while results come in, besides the
#: first and each step's last: a log then shows a long step going on without a line per result.
PROGRESS_EVERY_S = 30.0
#: The option that sets each ``SamplerError.setting``: what the one-line error tells a user of this command to raise.
LIMIT_OPTIONS = {"max_groups_per_step": "--max-groups-per-step", "max_consecutive_failures": "--max-consecutive-failures",
                 "step_timeout_s": "--step-timeout-s"}


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
              help="JSONL: one result per line with its group_id and step. .parquet: training samples (docs/training.md); "
                   "where no job recorded a trajectory, the results go whole to a .jsonl beside it and the command "
                   "exits 1, as `prorl submit --out` does.")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), help="In-stage time budget per job.")
@click.option("--max-groups-per-step", type=click.IntRange(min=0), metavar="N",
              help="Groups a step may submit: once all N finished with fewer than --target-groups informative ones, "
                   "the command stops with an error instead of submitting more (rewards that never vary, a no-op "
                   "task) [default: 32 x target groups + 256; 0: no limit].")
@click.option("--max-consecutive-failures", type=click.IntRange(min=0), metavar="N",
              help="Stop with the failures grouped (stage, error, an example job) once N job results in a row "
                   "failed, none finished between them [default: the larger of 32 and --max-in-flight; 0: no limit].")
@click.option("--step-timeout-s", type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="Stop with an error when a step has not reached --target-groups within S seconds [default: none].")
@click.option("--id-prefix", metavar="PREFIX",
              help="Run id: job ids (RUN-sSTEP-pROW-kK, ROW the prompt's row in TASKS as `prorl submit` counts it, "
                   "rows --skip-bad-rows left out included) and group ids start with it [default: dapo-<random>, new "
                   "for each run; the same "
                   "PREFIX again resumes: the jobs the broker still holds under its ids come back as they ended, not "
                   "new ones, and those it holds cancelled (an interrupted run's) run again].")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@deployment_option
@sampling_options
@pass_app
def sample(
    app: App, tasks_file: Path, task: str, group_size: int, target_groups: int, max_in_flight: int | None,
    steps: int, out: Path | None, timeout_s: float | None, max_groups_per_step: int | None,
    max_consecutive_failures: int | None, step_timeout_s: float | None, id_prefix: str | None, address: str | None,
    fmt: str | None, skip_bad_rows: bool, max_tokens: int | None, temperature: float | None, top_p: float | None, seed: int | None,
    sampling_json: str | None, sampling_file: Path | None,
) -> None:
    """Collect GRPO groups of the prompts in TASKS with DAPO dynamic sampling.

    \b
    Each prompt is run --group-size times; a group whose rewards are all equal
    teaches nothing and is filtered, and new prompts are submitted until
    --target-groups informative groups are in, per step. TASKS is read as by
    `prorl submit` (JSONL or Parquet; domain rows through --format).

    \b
    A step that cannot get there stops the command (exit 1) instead of
    submitting rollouts for ever: after --max-groups-per-step groups with too
    few informative ones (a task whose rewards never vary), after
    --max-consecutive-failures failed jobs in a row (printed grouped by stage
    and error, as `prorl submit` does), or past --step-timeout-s. Off a
    terminal (a Slurm log) progress comes as a line per step and one every
    30 s or so.

    \b
    Ctrl-C, SIGTERM (a batch job's time limit) or SIGHUP (a dropped ssh
    session) cancels the jobs in flight, says how many and the run id that
    resumes (--id-prefix), and exits 130, 143 or 129; under nohup SIGHUP
    stays ignored. --out may not be TASKS itself.
    """
    from prorl_cli.cli.common import interrupt_signals
    from prorl_cli.cli.jobs.collect import tell
    from prorl_cli.exceptions import ProrlError, SamplerError
    from prorl_cli.training.sampler import BlockingDapoSampler, SamplerConfig

    sampling = sampling_of(app, max_tokens, temperature, top_p, seed, sampling_json, sampling_file)
    # The same loaders as plain submit: JSONL or Parquet, domain rows through their --format.
    rows = load_task_rows(app, task, tasks_file, fmt, skip_bad_rows)
    instances = [instance for _, instance in rows]
    if not instances:
        app.abort(f"{tasks_file}: no instances")
    if out is not None:
        check_out_path(app, out, tasks_file=tasks_file)
    cfg = SamplerConfig(group_size=group_size, target_groups=target_groups, max_in_flight=max_in_flight,
                        run_id=id_prefix or f"dapo-{uuid.uuid4().hex[:10]}", timeout_s=timeout_s, sampling=sampling,
                        max_groups_per_step=max_groups_per_step, max_consecutive_failures=max_consecutive_failures,
                        step_timeout_s=step_timeout_s)
    batches: list[StepBatch] = []
    stopped: str | None = None
    interrupted: int | None = None  # the jobs in flight when an interrupt came
    # SIGTERM (a batch job's time limit) and SIGHUP (a dropped ssh session) end it as Ctrl-C does: the jobs in
    # flight are cancelled (nobody would take their results), said, and it exits 143 or 129 (Ctrl-C: 130).
    with interrupt_signals() as signals, connect(app, address) as client:
        resuming = id_prefix is not None and _resume(app, client, cfg.run_id)  # a fresh run id names no earlier run
        file_rows = [r for r, _ in rows]
        sampler = BlockingDapoSampler(client, task, instances, cfg, prompt_id=row_prompt_ids(file_rows),
                                      seed_index=row_seed_index(file_rows))
        sampler.sampler.resuming = resuming  # said above: the sampler's warning of existing ids would be noise
        try:
            with live_line(app) as live:
                sampler.sampler.on_progress = lambda st: live.update(progress_text(st, target_groups))
                for _step in range(steps):
                    batch = sampler.step(policy_version=0)
                    live.update(progress_text(batch.stats, target_groups), force=True)
                    batches.append(batch)
        except SamplerError as e:
            print_stop(app, e)
            stopped = f"dynamic sampling stopped: {for_this_command(e)}"
        except ProrlError as e:
            stopped = f"dynamic sampling failed: {e}"
        except KeyboardInterrupt:
            interrupted = sampler.sampler.in_flight_jobs
            raise
        finally:
            sampler.close()  # cancels the jobs still in flight: a stopped step leaves nothing running
            if interrupted is not None:
                tell(app, f"{signals.how}: cancelled {interrupted} job(s) in flight; {_resume_hint(cfg.run_id, batches)}")
                _keep_steps(app, batches, out)
    written: Path | None = None
    problem: str | None = None
    if out is not None and (batches or stopped is None):
        # The steps done before a stop are kept: a long run that stops late loses only its last step.
        written, problem = write_groups(app, batches, out)
    if stopped is not None:
        app.abort(stopped + (f" ({len(batches)} step(s) before it written to {written})" if written and batches else "")
                  + (f"; {problem}" if problem else ""))
    total = sum(len(b.groups) for b in batches)
    filtered = sum(b.stats.filtered for b in batches)
    cancelled = sum(b.stats.cancelled_jobs for b in batches)
    app.console.print(f"{total} informative group(s) of {group_size}; {filtered} filtered, {cancelled} job(s) cancelled"
                      + (f"; results in {written}" if written else ""))
    if problem is not None:  # after the summary, which says where the results are, as `prorl submit` ends
        app.abort(problem)


def row_prompt_ids(file_rows: list[int]) -> Callable[[int, object], str]:
    """The sampler's ``prompt_id`` for the prompts of ``file_rows`` (each instance's row in TASKS, rows that
    ``--skip-bad-rows`` left out counted, as ``prorl submit`` numbers them): the prompt at sampler position ``pos``
    is ``ROW`` on the first walk over the file and ``ROWeE`` on walk ``E`` (from 1) after it.

    An id names a row, not a place in the filtered list: a run resumed under its ``--id-prefix`` once a bad row is
    mended gives every other row its own earlier jobs (a place would shift them onto a neighbour's, which holds
    other work). The walk is in the id because a step that wraps around the file submits a row again.
    """

    def prompt_id(pos: int, _instance: object) -> str:
        walk, index = divmod(pos, len(file_rows))
        return f"{file_rows[index]}" + (f"e{walk}" if walk else "")

    return prompt_id


#: Rows of one walk over a TASKS file a seed index leaves room for: walk ``E``'s rows are numbered from
#: ``E * ROWS_PER_WALK``, so a row's seeds do not depend on how many rows the file holds.
ROWS_PER_WALK = 1 << 32


def row_seed_index(file_rows: list[int]) -> Callable[[int, object], int]:
    """The sampler's ``seed_index`` for the prompts of ``file_rows``: the row on the first walk over the file, as
    :func:`row_prompt_ids` names it; a mended row shifts no other row's seeds (nor so the work its jobs hold)."""

    def seed_index(pos: int, _instance: object) -> int:
        walk, index = divmod(pos, len(file_rows))
        return walk * ROWS_PER_WALK + file_rows[index]

    return seed_index


def _run_jobs(run_id: str, held: dict[str, str]) -> dict[str, str]:
    """Of the jobs the broker ``held`` under ``RUN-s``, those of run ``run_id`` (``RUN-sSTEP-pPROMPT-kK``, PROMPT
    the row in TASKS, :func:`row_prompt_ids`)."""
    shape = re.compile(rf"{re.escape(run_id)}-s\d+-p\d+(?:e\d+)?-k\d+")
    return {j: state for j, state in held.items() if shape.fullmatch(j)}


def _resume(app: App, client: RolloutClient, run_id: str) -> bool:
    """``--id-prefix`` of an earlier run: the jobs of it that the broker holds cancelled (an interrupted run's)
    are forgotten there, so that the sampler's same ids run them again; the others are taken as they are.
    Whether the broker held jobs of an earlier run under it."""
    from prorl_cli.cli.jobs.collect import rerun_cancelled, tell
    from prorl_cli.exceptions import ProrlError

    try:
        ours = _run_jobs(run_id, client.list_jobs(prefix=f"{run_id}-s"))
        resumed = rerun_cancelled(client, ours) if ours else None
    except ProrlError as e:
        app.abort(f"--id-prefix {run_id}: could not ask the broker for the jobs of an earlier run under it: {e}")
    if resumed is None:
        return False
    tell(app, resumed.describe(f"--id-prefix {run_id}"))
    return True


def _resume_hint(run_id: str, batches: list[StepBatch]) -> str:
    """How an interrupted run is resumed, and what that costs."""
    again = (" (the steps done are sampled again: a step's jobs are dropped at the broker once the next one "
             "starts)" if batches else "")
    return (f"the same command with --id-prefix {run_id} resumes: the jobs that ended are taken as they are, the "
            f"cancelled ones run again{again}")


def _keep_steps(app: App, batches: list[StepBatch], out: Path | None) -> None:
    """After an interrupt: the steps done before it go to ``out`` all the same, as after a sampler's stop."""
    from prorl_cli.cli.jobs.collect import tell

    if out is None or not batches:
        return
    try:
        written, problem = write_groups(app, batches, out)
    except OSError as e:
        tell(app, f"{out}: the {len(batches)} step(s) done not written: {e.strerror or e}")
        return
    tell(app, f"the {len(batches)} step(s) done are in {written}" + (f"; {problem}" if problem else ""))


class ProgressLine:
    """``prorl sample``'s progress on stderr: on a terminal, one live line redrawn in place; off one (an sbatch
    log, a pipe), where rich's live display shows nothing before it stops, plain lines: the first update, then at
    most one every :data:`PROGRESS_EVERY_S`, each forced one (a step's end) and, at the end, the last one not yet
    shown (the state a stopped step was in)."""

    def __init__(self, app: App, live: Live | None, every_s: float = PROGRESS_EVERY_S) -> None:
        self.app = app
        self.live = live
        self.every_s = every_s
        self._shown_at: float | None = None
        self._unshown: str | None = None

    def update(self, text: str | Text, *, force: bool = False) -> None:
        """Show ``text`` (on a terminal, always; off one, when ``force`` or the last line is old enough)."""
        from rich.text import Text

        if self.live is not None:
            self.live.update(text if isinstance(text, Text) else Text(text))
            return
        plain = text.plain if isinstance(text, Text) else text
        now = time.monotonic()
        if force or self._shown_at is None or now - self._shown_at >= self.every_s:
            self.app.err_console.print(plain, markup=False, highlight=False, soft_wrap=True)
            self._shown_at, self._unshown = now, None
        else:
            self._unshown = plain

    def finish(self) -> None:
        """Off a terminal: show the last update if it was held back."""
        if self._unshown is not None:
            self.app.err_console.print(self._unshown, markup=False, highlight=False, soft_wrap=True)
            self._unshown = None


@contextmanager
def live_line(app: App) -> Iterator[ProgressLine]:
    """The progress line on stderr (:class:`ProgressLine`): live on a terminal; off one, line by line, each ended
    by its newline so the next line (an ``error:``) starts a line of its own."""
    from rich.live import Live
    from rich.text import Text

    if not app.err_console.is_terminal:
        progress = ProgressLine(app, None)
        try:
            yield progress
        finally:
            progress.finish()
        return
    with Live(Text("starting"), console=app.err_console, transient=False, refresh_per_second=8) as live:
        yield ProgressLine(app, live)


def print_stop(app: App, error: SamplerError) -> None:
    """The failures that stopped a step, grouped as ``prorl submit``'s summary groups them."""
    from prorl_cli.cli.jobs.collect import print_failure_groups

    print_failure_groups(app, error.failures)
    if error.other_failures:
        app.err_console.print(f"  and {error.other_failures} job(s) that failed in still other ways")


def for_this_command(error: SamplerError) -> str:
    """The error's message with the option of this command in place of the ``SamplerConfig`` setting it names."""
    option = LIMIT_OPTIONS.get(error.setting)
    message = str(error)
    return message.replace(f"SamplerConfig.{error.setting}", option) if option else message


def progress_text(stats: StepStats, target: int) -> str:
    """The live line of a step: informative of target, filtered, failed, cancelled, in flight."""
    return (
        f"step {stats.step}: informative {stats.informative}/{target}, filtered {stats.filtered}, "
        f"failed {stats.failed_groups}, cancelled {stats.cancelled_jobs}, in flight {stats.in_flight}"
    )


def write_groups(app: App, batches: list[StepBatch], out: Path) -> tuple[Path | None, str | None]:
    """JSONL: one result per line with its ``group_id`` and ``step``; ``.parquet``: training samples (docs/training.md).

    Returns where the results went and, when that is not ``out``, why (the error the command ends with): a
    Parquet file that cannot be written (no result recorded a trajectory, pyarrow failing) leaves them whole in
    a JSONL beside it, as ``prorl submit --out`` does (:func:`~prorl_cli.cli.jobs.collect.write_stand_in`).
    """
    rows = [{**r.to_wire(), "group_id": g.group_id, "step": b.step} for b in batches for g in b.groups
            for r in g.results]
    if out.suffix != ".parquet":
        with out.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        return out, None
    from prorl_cli.cli.jobs.collect import PARQUET_ERRORS, no_trajectory, write_stand_in
    from prorl_cli.training.export import write_samples_parquet
    from prorl_cli.training.samples import samples_from_results

    results = [r for b in batches for r in b.results]
    try:
        batch_samples = [samples_from_results(b.results, group_of=b.group_of) for b in batches]
        samples = [s for got in batch_samples for s in got.samples]
        if not samples:
            return write_stand_in(out, rows, no_trajectory(results))
        write_samples_parquet(out, samples)
    except PARQUET_ERRORS as e:  # a trajectory or reward a sample cannot be made of, pyarrow failing
        return write_stand_in(out, rows, f"{type(e).__name__}: {e}")
    skipped = sum(got.skipped for got in batch_samples)
    if skipped:
        app.err_console.print(
            f"note: {skipped} of {len(results)} job(s) recorded no trajectory (or no reward) and have no sample in "
            f"{out}; --out FILE.jsonl keeps every job's whole result", markup=False, soft_wrap=True)
    return out, None
