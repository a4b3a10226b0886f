"""Observability commands: ``prorl trace``, ``prorl inspect``, ``prorl report``, ``prorl top``."""

from __future__ import annotations

import json
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
OBSERVE_COMMANDS = [trace]
