"""Observability commands: ``prorl trace``, ``prorl inspect``, ``prorl report``, ``prorl top``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.naming import deployment_argument, deployment_option

if TYPE_CHECKING:
    from prorl_cli.protocol import JobResult

_RESULTS = click.Path(exists=True, dir_okay=False, path_type=Path)


def read_results(app: App, path: Path) -> list[JobResult]:
    """The results in ``path``, or a one-line error naming what is wrong with the file."""
    from prorl_cli.observe.results import ResultsFileError, load_results

    try:
        return load_results(path)
    except ResultsFileError as e:
        app.abort(str(e))


@click.command()
@click.argument("results_file", metavar="RESULTS", type=_RESULTS)
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("trace.json"), show_default=True,
              help="Where to write the trace-event JSON.")
@pass_app
def trace(app: App, results_file: Path, out: Path) -> None:
    """Write a Chrome/Perfetto trace of a run from its RESULTS (JSONL or Parquet of `prorl submit --out`).

    \b
    One track per node slot (each job with its queue waits, stages, generate and tool
    calls, sandbox starts) and one per inference backend. Open it at ui.perfetto.dev.
    """
    from prorl_cli.cli.common import check_out_path
    from prorl_cli.observe.trace import trace_events

    check_out_path(app, out, "--out")
    results = read_results(app, results_file)
    doc = trace_events(results)
    jobs = doc["otherData"]["jobs"]
    if not jobs:
        app.abort(f"{results_file}: no result has a timeline ('events'); results of older prorl versions have none")
    from prorl_cli.jsonl import atomic_text_file

    with atomic_text_file(out) as f:  # a failed write (a full disk) keeps the last good trace
        f.write(json.dumps(doc))
    app.console.print(f"{jobs} job(s), {len(doc['traceEvents'])} trace events -> {out} (open it at ui.perfetto.dev)")


def run_top(app: App, address: str | None, as_json: bool, interval_s: float, frames: int | None = None) -> None:
    """The live dashboard (``prorl top``, ``prorl status --watch``), or one ``--json`` snapshot."""
    from prorl_cli.cli.common import connect
    from prorl_cli.exceptions import ProrlError
    from prorl_cli.observe.dashboard import Dashboard, watch

    with connect(app, address) as client:
        try:
            if as_json:
                board = Dashboard()
                board.update(client.status())
                time.sleep(interval_s)  # rates need two reports
                click.echo(json.dumps(board.update(client.status()).to_json(), indent=2))
                return
            watch(client.status, app.console, interval_s, frames)
        except ProrlError as e:
            app.abort(f"lost the broker: {e}")


@click.command()
@deployment_argument
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot (rates over --interval-s) as JSON and exit.")
@click.option("--interval-s", type=click.FloatRange(min=0.1), default=1.0, show_default=True, help="Refresh period.")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@deployment_option
@pass_app
def top(app: App, as_json: bool, interval_s: float, address: str | None) -> None:
    """Live dashboard of a deployment (same as `prorl status --watch`); Ctrl-C to leave.

    \b
    Jobs by task and state, throughput (jobs/s, tokens/s in and out), each node's
    INIT/RUN/EVAL pools (active/queued/limit; a gone node says why), each backend's
    in-flight and served calls and tokens/s (paused or not; bridges that went away,
    left or lost), held generate calls, and failures grouped by task, stage and error type.
    """
    run_top(app, address, as_json, interval_s)



def load_tokenizer(app: App, path: str | None) -> object | None:
    """The tokenizer to decode ids with: --tokenizer, else inference.tokenizer of the config, else none."""
    where = path or getattr(app.config.inference, "tokenizer", None)
    if not where:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(where))
    except (OSError, ValueError) as e:
        app.abort(f"--tokenizer {where}: cannot load a tokenizer there: {e}")


@click.command()
@click.argument("results_file", metavar="RESULTS", type=_RESULTS)
@click.option("--job", "job_ids", multiple=True, metavar="ID", help="Only this job id (a glob; repeatable).")
@click.option("--task", "tasks", multiple=True, metavar="NAME", help="Only jobs of this handler (repeatable).")
@click.option("--state", "states", multiple=True, type=click.Choice(["done", "failed", "cancelled", "timed_out"]),
              help="Only jobs that ended so (repeatable).")
@click.option("--min-reward", type=float, help="Only jobs with at least this reward.")
@click.option("--max-reward", type=float, help="Only jobs with at most this reward.")
@click.option("--violations", "violations_only", is_flag=True, help="Only trajectories with continuity violations.")
@click.option("--limit", type=click.IntRange(min=1), help="Show at most this many.")
@click.option("--tokenizer", metavar="DIR", help="Decode token ids with this tokenizer (default: inference.tokenizer).")
@click.option("--tokens", "show_tokens", is_flag=True, help="Show token boundaries (alternating shading).")
@pass_app
def inspect(
    app: App, results_file: Path, job_ids: tuple[str, ...], tasks: tuple[str, ...], states: tuple[str, ...],
    min_reward: float | None, max_reward: float | None, violations_only: bool, limit: int | None,
    tokenizer: str | None, show_tokens: bool,
) -> None:
    """Show trajectories of a run call by call: new prompt tokens, output, log-probs, tools, violations.

    RESULTS is the JSONL (or Parquet) of `prorl submit --out` or the quickstart. Exits 1 when no result matches.
    A job of several conversations (sub-agents) labels each call with its agent and conversation, and counts
    its new prompt tokens against the previous call of that conversation.
    """
    from prorl_cli.observe.inspect import Decoder, Filters, render_result

    results = read_results(app, results_file)
    chosen = Filters(job_ids, tasks, states, min_reward, max_reward, violations_only, limit).select(results)
    if not chosen:
        app.abort(f"{results_file}: no result matches ({len(results)} in the file)")
    decoder = Decoder(load_tokenizer(app, tokenizer))
    for r in chosen:
        # Wrapped at the console's width (the app's consoles never wrap one-line messages): a panel's lines
        # would otherwise be cut there, the stage times at the end of its header first.
        app.console.print(render_result(r, decoder, show_tokens=show_tokens), soft_wrap=False)
    app.console.print(f"{len(chosen)} of {len(results)} result(s)")



@click.command()
@click.argument("results_file", metavar="RESULTS", type=_RESULTS)
@click.option("--html", "html_out", required=True, type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Where to write the report (one self-contained HTML file).")
@click.option("--title", help="Page title (default: the results file's name).")
@click.option("--max-trajectories", type=click.IntRange(min=0), default=500, show_default=True,
              help="Trajectory views in the page (the job table lists every job).")
@pass_app
def report(app: App, results_file: Path, html_out: Path, title: str | None, max_trajectories: int) -> None:
    """Write an HTML report of a run: throughput, stage split, rewards, turns, failures, trajectories.

    RESULTS is the JSONL (or Parquet) of `prorl submit --out` or the quickstart. The page embeds its plots
    (matplotlib) and needs nothing else: open it in any browser, offline.
    """
    from prorl_cli.cli.common import check_out_path

    check_out_path(app, html_out, "--html")
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        app.abort(f"the report needs matplotlib: pip install 'prorl[observe]' ({e})")
    from prorl_cli.observe.report import render_html

    results = read_results(app, results_file)
    if not results:
        app.abort(f"{results_file}: no results")
    page = render_html(results, title or f"prorl run: {results_file.name}", max_trajectories)
    from prorl_cli.jsonl import atomic_text_file

    with atomic_text_file(html_out) as f:  # a failed write (a full disk) keeps the last good report
        f.write(page)
    app.console.print(f"{len(results)} job(s) -> {html_out} ({len(page) // 1024} KiB)")


OBSERVE_COMMANDS = [trace, top, inspect, report]
