"""Collecting results for ``prorl submit`` and ``prorl results``: progress, ``--out`` files, the summary.

The rules ``--out`` follows, whichever command wrote it:

- ``.jsonl`` (any other name): one whole JobResult per line, every state, written as each job ends;
- ``.parquet``: one row per job whose output holds a token-level ``trajectory``, partial trajectories of
  ``failed`` and ``timed_out`` jobs included, with the job's ``state`` column; ``only_done`` keeps ``done`` rows only.

A job that ended (done, failed, timed out, cancelled) is a result, not an error: the commands exit 0
once every job ended, and count the states in the summary.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from prorl_cli.cli.application import App
from prorl_cli.cli.common import SigtermAsInterrupt

if TYPE_CHECKING:
    from prorl_cli.client import RolloutClient
    from prorl_cli.protocol import JobResult


class ResultFile:
    """``--out``: JSONL lines as results arrive; a ``.parquet`` name is written once, at :meth:`close`."""

    def __init__(self, app: App, out: Path | None, only_done: bool = False) -> None:
        self.app = app
        self.out = out
        self.only_done = only_done
        self.parquet = out is not None and out.suffix == ".parquet"
        self.results: list[JobResult] = []
        self._file: IO[str] | None = None
        if out is not None and not self.parquet:
            self._file = out.open("w", encoding="utf-8")

    def add(self, result: JobResult) -> None:
        self.results.append(result)
        if self._file is not None and (not self.only_done or result.state == "done"):
            self._file.write(json.dumps(result.to_wire()) + "\n")
            self._file.flush()  # a killed collector leaves every line it took

    def close(self, partial: bool = False) -> None:
        """Finish the file; ``partial`` (collection stopped early): a Parquet file only if some row was taken."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.parquet and self.out is not None:
            if partial and not parquet_rows(self.results, self.only_done):
                return
            write_trajectories_parquet(self.app, self.results, self.out, only_done=self.only_done)
            self.out = None  # written once


#: What a cancelled submission is told it could have done instead.
SUBMIT_CANCEL_HINT = "submit --detach leaves them running; prorl results collects them"


def collect(
    app: App, client: RolloutClient, ids: list[str], title: str, sink: ResultFile,
    on_interrupt: str = "cancel", cancel_hint: str = SUBMIT_CANCEL_HINT,
) -> list[JobResult]:
    """Stream the results of ``ids`` into ``sink`` with a progress bar; return them all.

    Ctrl-C (``on_interrupt``): ``cancel`` the unfinished jobs (saying ``cancel_hint``), or ``leave`` them running
    (they can be collected again with ``prorl results``); either way the results taken so far stay in ``sink``.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    started = time.monotonic()
    counts: dict[str, int] = {}
    results: list[JobResult] = []
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TextColumn("{task.fields[rate]:.1f} jobs/s"),
        TimeElapsedColumn(),
    )
    terminated = SigtermAsInterrupt()
    try:
        with terminated, Progress(*columns, console=app.err_console, transient=False) as progress:
            bar = progress.add_task(title, total=len(ids), counts="", rate=0.0)
            for result in client.as_completed(ids):
                results.append(result)
                sink.add(result)
                counts[result.state] = counts.get(result.state, 0) + 1
                elapsed = max(time.monotonic() - started, 1e-9)
                progress.update(bar, advance=1, counts=_counts_text(counts), rate=len(results) / elapsed)
    except KeyboardInterrupt:
        done = {r.job_id for r in results}
        left = [j for j in ids if j not in done]
        if on_interrupt == "cancel":
            how = "terminated (SIGTERM)" if terminated.fired else "interrupted"
            app.err_console.print(f"{how}: cancelling {len(left)} unfinished job(s)" + (f" ({cancel_hint})" if cancel_hint else ""))
            client.cancel(left)
            # After SIGTERM, Slurm sends SIGKILL once its KillWait (30 s by default) is up: wait less than that.
            wait_s = TERMINATED_RESULTS_WAIT_S if terminated.fired else CANCELLED_RESULTS_WAIT_S
            _collect_cancelled(app, client, left, results, sink, wait_s)
        else:
            app.err_console.print(f"interrupted: {len(left)} job(s) still running; `prorl results` collects them later")
        raise
    finally:
        sink.close(partial=sys.exc_info()[0] is not None)
    return results


#: How long an interrupted submit waits for its cancelled jobs' results (the broker holds each for its
#: node's partial result at most ``broker.cancel_result_grace_s``); a second Ctrl-C stops waiting.
CANCELLED_RESULTS_WAIT_S = 30.0
#: The same after SIGTERM (a Slurm job cancelled, preempted or at its time limit): well inside KillWait.
TERMINATED_RESULTS_WAIT_S = 10.0


def _collect_cancelled(app: App, client: RolloutClient, ids: list[str], results: list[JobResult],
                       sink: ResultFile, wait_s: float = CANCELLED_RESULTS_WAIT_S) -> None:
    """Write the cancelled jobs' results too: they carry what each job did until the cancel."""
    from prorl_cli.exceptions import BrokerUnavailable

    try:
        for result in client.as_completed(ids, timeout_s=wait_s):
            results.append(result)
            sink.add(result)
    except (TimeoutError, BrokerUnavailable, KeyboardInterrupt) as e:
        app.err_console.print(f"interrupted: {len(ids)} cancelled job(s)' results not all written ({type(e).__name__})")
    else:
        app.err_console.print(f"interrupted: wrote the {len(ids)} cancelled job(s)' results (partial trajectories)")


def _counts_text(counts: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def parquet_rows(results: list[JobResult], only_done: bool = False) -> list[dict[str, Any]]:
    """The Parquet rows of ``results``: every job whose output holds a ``trajectory``, with its state.

    Each row carries the whole JobResult but ``output`` (the trajectory stands for it), so ``prorl report``,
    ``trace`` and ``inspect`` read the same figures (in-stage times, attempt, group, error) from it as from JSONL.
    """
    return [
        {"job_id": r.job_id, "state": r.state, "reward": r.reward, "trajectory": r.output["trajectory"],
         "task": r.task, "node_id": r.node_id, "events": r.events, "stage_s": r.stage_s, "active_s": r.active_s,
         "attempt": r.attempt, "group_id": r.group_id, "critical_error": r.critical_error, "error": r.error,
         "meta": r.meta, "log_path": r.log_path}
        for r in results
        if (r.state == "done" or not only_done)
        and isinstance(r.output, dict) and isinstance(r.output.get("trajectory"), dict)
    ]


def write_trajectories_parquet(app: App, results: list[JobResult], out: Path, only_done: bool = False) -> int:
    """One row per job with a token-level ``trajectory`` (partial ones included unless ``only_done``); see docs/protocol.md."""
    from prorl_cli.agent.trajectory import write_parquet

    rows = parquet_rows(results, only_done)
    if not rows:
        which = "finished job" if only_done else "job"
        app.abort(f"{out}: no {which} has a 'trajectory' in its output; write .jsonl to keep whole results")
    try:
        write_parquet(out, rows)
    except ImportError as e:
        app.abort(str(e))
    return len(rows)


#: Failure groups the summary shows (the largest first); the rest are counted in one line.
FAILURE_GROUPS_SHOWN = 5


def print_failures(app: App, results: list[JobResult]) -> None:
    """Why jobs did not finish: failed and timed-out jobs grouped by stage, error type and first message line,
    the largest groups first, each with a job id to look up (``prorl inspect``, the job's log)."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for r in results:
        if r.state not in ("failed", "timed_out"):
            continue
        error = r.error if isinstance(r.error, dict) else {}
        stage = str(error.get("stage") or r.critical_error or "?")
        kind = str(error.get("type") or r.state)
        lines = str(error.get("message") or "").strip().splitlines()
        groups.setdefault((stage, kind, lines[0][:300] if lines else ""), []).append(r.job_id)
    if not groups:
        return
    ranked = sorted(groups.items(), key=lambda item: -len(item[1]))
    app.err_console.print("[bold]why jobs did not finish[/bold] (the error field of each result has it whole):")
    for (stage, kind, message), ids in ranked[:FAILURE_GROUPS_SHOWN]:
        app.err_console.print(f"  {len(ids)} job(s) in {stage}: {kind}" + (f": {message}" if message else "")
                              + f" (e.g. {ids[0]})", markup=False, soft_wrap=True)
    if len(ranked) > FAILURE_GROUPS_SHOWN:
        rest = ranked[FAILURE_GROUPS_SHOWN:]
        app.err_console.print(f"  and {sum(len(ids) for _, ids in rest)} job(s) in {len(rest)} other group(s)")


def print_summary(app: App, results: list[JobResult], elapsed_s: float | None, out: Path | None,
                  title: str = "prorl submit") -> None:
    """A table of states (jobs, mean reward, mean in-stage time) and one line with the rate and where the results
    went. ``elapsed_s`` None: the jobs ran before this command (``prorl results``), so no rate is shown."""
    from rich.table import Table

    table = Table(title=f"{title}: summary")
    table.add_column("state")
    table.add_column("jobs", justify="right")
    table.add_column("mean reward", justify="right")
    table.add_column("mean in-stage s", justify="right")
    by_state: dict[str, list[JobResult]] = {}
    for r in results:
        by_state.setdefault(r.state, []).append(r)
    for state, rs in sorted(by_state.items()):
        rewards = [r.reward for r in rs if r.reward is not None]
        table.add_row(
            state,
            str(len(rs)),
            f"{sum(rewards) / len(rewards):.3f}" if rewards else "-",
            f"{sum(r.active_s for r in rs) / len(rs):.3f}",
        )
    app.console.print(table)
    print_failures(app, results)
    where = f"; results in {out}" if out else ""
    if elapsed_s is None:
        app.console.print(f"{len(results)} job(s){where}")
        return
    rate = len(results) / elapsed_s if elapsed_s > 0 else 0.0
    app.console.print(f"{len(results)} job(s) in {elapsed_s:.2f} s ({rate:.1f} jobs/s){where}")
