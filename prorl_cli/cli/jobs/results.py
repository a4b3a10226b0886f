"""``prorl results``: reattach to submitted jobs and collect their results.

Jobs outlive the process that submitted them (``submit --detach``, a killed
or disconnected terminal): the broker keeps running them and retains their
results (``broker.result_retention``). ``results`` names them by id, by the
submission's id prefix or by group, and writes them like ``submit --out``.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.naming import deployment_option, id_prefix


@click.command()
@click.argument("job_ids", metavar="[IDS]...", nargs=-1)
@click.option("--prefix", metavar="PREFIX", help="The jobs of a submission: ids PREFIX-... (what submit --detach printed, or its --id-prefix).")
@click.option("--group", "group_id", metavar="GROUP", help="Every job of group GROUP (PREFIX-LINE: the rollouts of one line).")
@click.option("-f", "--follow", is_flag=True, help="Wait for the unfinished jobs too (default: collect the finished ones and exit).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Results file, as submit --out: JSONL (every job's whole result) or .parquet (trajectories with their state).")
@click.option("--only-done", is_flag=True, help="--out keeps only jobs that ended done.")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@deployment_option
@pass_app
def results(app: App, job_ids: tuple[str, ...], prefix: str | None, group_id: str | None, follow: bool,
            out: Path | None, only_done: bool, address: str | None) -> None:
    """Collect the results of jobs submitted earlier (by ids, --prefix or --group).

    \b
    Without --follow, the jobs that have ended are collected and the rest counted;
    with --follow the command waits until every selected job ended. Progress
    (jobs ended by state, running, queued) goes to stderr: a bar on a terminal,
    plain lines off one (every 30 s and every 10 % of the jobs). Ctrl-C, SIGTERM
    or SIGHUP leaves the jobs running (exit 130, 143, 129). Exit status 0 once the selected results are written;
    1 when nothing matches, when an id given is unknown (the others' results are
    written all the same), when a .parquet --out could not be written (its results
    go to a .jsonl beside it), or when the broker cannot be reached.
    """
    from prorl_cli.cli.common import check_out_path, connect, interrupt_signals
    from prorl_cli.cli.jobs.collect import ResultFile, collect, print_summary
    from prorl_cli.protocol import TERMINAL_STATES

    if sum([bool(job_ids), prefix is not None, group_id is not None]) != 1:
        app.abort("give job ids, or one of --prefix PREFIX, --group GROUP")
    if out is not None:
        check_out_path(app, out)
    ended = {s.value for s in TERMINAL_STATES}
    # Ids given: the broker lists only what starts as they all do (one submission's ids share its prefix), not
    # every job it holds, on each progress poll too.
    listed = id_prefix(prefix) if not job_ids else os.path.commonprefix(list(job_ids)) or None
    with connect(app, address) as client:
        held = client.list_jobs(prefix=listed, group_id=group_id)
        # Ids the broker does not hold (mistyped, or past broker.result_retention) do not stop the others from
        # being collected: a partial match writes what matched and ends in an error naming the rest.
        unknown = [j for j in dict.fromkeys(job_ids) if j not in held]
        if job_ids:
            held = {j: held[j] for j in job_ids if j in held}
        if not held:
            what = (f"--prefix {prefix}" if prefix is not None else f"--group {group_id}" if group_id is not None
                    else f"ids {' '.join(_some(unknown))}")
            app.abort(f"no job matches {what} in deployment {app.config.deployment!r} "
                      "(finished results are kept up to broker.result_retention)")
        wanted = list(held) if follow else [j for j, state in held.items() if state in ended]
        # Ctrl-C: collect says the jobs keep running; the prorl group ends it with one line, exit 130.
        # The ids held only: the command to collect them again must not fail on the unknown ones again.
        selection = tuple(held) if job_ids else ("--prefix", prefix) if prefix is not None else ("--group", str(group_id))
        sink = ResultFile(app, out, only_done, selection=selection, address=address)
        chosen, collected = set(held), set(wanted)

        def poll() -> dict[str, str]:
            """The selection's states now, for the progress's queued and running counts."""
            states = client.list_jobs(prefix=listed, group_id=group_id)
            return {j: state for j, state in states.items() if j in chosen} if job_ids else states

        with interrupt_signals() as signals:
            got = collect(app, client, wanted, "results", sink, on_interrupt="leave", signals=signals, poll=poll,
                          left_out={j: _progress_state(s) for j, s in held.items() if j not in collected})
    # A rate here would time the collection, not the jobs.
    print_summary(app, got, None, sink.written, title="prorl results")
    running = len(held) - len(got)
    if running:
        app.console.print(f"{running} job(s) not finished yet: `--follow` waits for them")
    if unknown:
        # One error line (after the summary, which says where the rest went), with the --out problem if any.
        where = f"; the other results are in {sink.written}" if sink.written is not None else ""
        app.abort(f"{len(unknown)} job id(s) the broker does not hold: {', '.join(_some(unknown))} (finished results "
                  f"are kept up to broker.result_retention){where}" + (f"; {sink.problem}" if sink.problem else ""))
    sink.check()


def _progress_state(state: str) -> str:
    """A job state as progress counts it: ``queued``, or ``running`` for one placed on a node (any stage)."""
    from prorl_cli.cli.jobs.collect import RUNNING_STATES

    return "running" if state in RUNNING_STATES else state


#: Unknown ids named at most in an error line; the rest are counted.
NAMED_IDS = 10


def _some(ids: list[str]) -> list[str]:
    """The first :data:`NAMED_IDS` of ``ids``, then ``...`` when there are more."""
    return ids[:NAMED_IDS] + (["..."] if len(ids) > NAMED_IDS else [])
