"""Observability commands: ``prorl trace``, ``prorl inspect``, ``prorl report``, ``prorl top``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from prorl_cli.cli.application import App, pass_app

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
    from prorl_cli.observe.trace import trace_events

    results = read_results(app, results_file)
    doc = trace_events(results)
    jobs = doc["otherData"]["jobs"]
    if not jobs:
        app.abort(f"{results_file}: no result has a timeline ('events'); results of older prorl versions have none")
    out.write_text(json.dumps(doc))
    app.console.print(f"{jobs} job(s), {len(doc['traceEvents'])} trace events -> {out} (open it at ui.perfetto.dev)")


def run_top(app: App, address: str | None, as_json: bool, interval_s: float, frames: int | None = None) -> None:
    """The live dashboard (``prorl top``, ``prorl status --watch``), or one ``--json`` snapshot."""
    from prorl_cli.cli.jobs import connect
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
@click.argument("deployment_name", metavar="[DEPLOYMENT]", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot (rates over --interval-s) as JSON and exit.")
@click.option("--interval-s", type=click.FloatRange(min=0.1), default=1.0, show_default=True, help="Refresh period.")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@pass_app
def top(app: App, deployment_name: str | None, as_json: bool, interval_s: float, address: str | None) -> None:
    """Live dashboard of a deployment (same as `prorl status --watch`); Ctrl-C to leave.

    \b
    Jobs by task and state, throughput (jobs/s, tokens/s in and out), each node's
    INIT/RUN/EVAL pools (active/queued/limit), each backend's in-flight and served
    calls and tokens/s (paused or not), and failures grouped by task, stage and error type.
    """
    from prorl_cli.cli.jobs import name_deployment

    name_deployment(app, deployment_name)
    run_top(app, address, as_json, interval_s)


OBSERVE_COMMANDS = [trace, top]
