"""Collecting results for ``prorl submit`` and ``prorl results``: progress, ``--out`` files, the summary.

(``prorl sample`` writes training samples to its ``.parquet``, not these rows, but keeps its results the same way
where that file cannot be written: :func:`write_stand_in`.)

The rules ``--out`` follows, whichever command wrote it:

- ``.jsonl`` (any other name): one whole JobResult per line, every state, written as each job ends;
- ``.parquet``: one row per job whose output holds a token-level ``trajectory``, partial trajectories of
  ``failed`` and ``timed_out`` jobs included, with the job's ``state`` column; ``only_done`` keeps ``done`` rows only.
  Where it cannot be written (no job recorded a trajectory: a handler that never ran the agent loop; pyarrow
  failing), the results it was to hold go whole to a JSONL file beside it instead, and the command ends in an
  error naming that file and the ``prorl results`` command that collects them again: the jobs ran, their results
  are never dropped. Jobs without a trajectory are left out of a Parquet file that is written, and counted.

A job that ended (done, failed, timed out, cancelled) is a result, not an error: the commands exit 0
once every job ended, and count the states in the summary.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

from prorl_cli.cli.application import App
from prorl_cli.cli.common import InterruptSignals, command_hint
from prorl_cli.exceptions import ProrlError

if TYPE_CHECKING:
    from prorl_cli.client import RolloutClient
    from prorl_cli.observe.failures import FailureGroup
    from prorl_cli.protocol import JobResult

log = logging.getLogger(__name__)


class ResultFile:
    """``--out``: JSONL lines as results arrive; a ``.parquet`` name is written once, at :meth:`close`.

    This is the one place the rules of the module docstring live, the stand-in JSONL of a Parquet file that
    cannot be written included. ``selection`` (``("--prefix", PREFIX)``, job ids) is what ``prorl results`` is
    given to collect these jobs again (with ``address``), for the messages that say how.
    """

    def __init__(self, app: App, out: Path | None, only_done: bool = False, selection: Sequence[str] = (),
                 address: str | None = None) -> None:
        self.app = app
        self.out = out
        self.only_done = only_done
        self.selection = tuple(selection)
        self.address = address
        self.parquet = out is not None and out.suffix == ".parquet"
        self.results: list[JobResult] = []
        #: Where the results are once closed: ``out``; a stand-in JSONL where a Parquet ``out`` could not be
        #: written; None where nothing was written (no ``out``, or nothing to write).
        self.written: Path | None = None if self.parquet else out
        #: Why a Parquet ``out`` was not written, and where its results went instead; :meth:`check` raises it.
        self.problem: str | None = None
        self._file: IO[str] | None = None
        if out is not None and not self.parquet:
            self._file = out.open("w", encoding="utf-8")

    @property
    def recollect(self) -> str:
        """The ``prorl results`` command that collects these jobs again (the broker keeps their results for
        ``broker.result_retention``), ready to paste."""
        return command_hint(self.app, "results", *(self.selection or ("--prefix", "PREFIX")), address=self.address)

    def keeps(self, result: JobResult) -> bool:
        """Whether ``result`` belongs in the file (``only_done``: jobs that ended done)."""
        return result.state == "done" or not self.only_done

    def add(self, result: JobResult) -> None:
        self.results.append(result)
        if self._file is not None and self.keeps(result):
            self._file.write(json.dumps(result.to_wire()) + "\n")
            self._file.flush()  # a killed collector leaves every line it took

    def close(self, partial: bool = False) -> None:
        """Finish the file; ``partial``: collection stopped early (what was taken is written all the same)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if not self.parquet or self.out is None:
            return
        out, self.out = self.out, None  # written once
        kept = [r for r in self.results if self.keeps(r)]
        if not kept:
            if partial:  # a stopped collection that took nothing has nothing to say
                return
            if self.results:  # --only-done, and none was: the others are whole in a JSONL
                self.problem = (f"{out}: not written: no job ended done; `{self.recollect} --out FILE.jsonl` "
                                "collects every job's whole result")
            else:
                self.problem = (f"{out}: not written: no job has ended yet; `{self.recollect} --follow "
                                f"--out {shlex.quote(str(out))}` waits for them")
            return
        from prorl_cli.agent.trajectory import write_parquet

        try:
            rows = parquet_rows(kept)
            if not rows:
                self._stand_in(out, kept, no_trajectory(kept, self.only_done))
                return
            write_parquet(out, rows)
        except PARQUET_ERRORS as e:
            self._stand_in(out, kept, f"{type(e).__name__}: {e}")
            return
        self.written = out
        # Counted on the records as written (Trajectory.conversations' rule), without parsing each one again.
        several = sum(1 for r in rows if len({c.get("segment", 0) for c in r["trajectory"].get("calls") or ()}) > 1)
        if several:
            self.app.err_console.print(
                f"note: {several} job(s) in {out} held several conversations (sub-agents, or a history edit): their "
                "sequence_ids/loss_mask/logprobs columns hold the last one only (column 'conversations'); every call "
                "is in the 'trajectory' column, and `prorl sample` or samples_from_results makes a sample of each",
                markup=False, soft_wrap=True)
        if len(rows) < len(kept):
            self.app.err_console.print(
                f"note: {len(kept) - len(rows)} of {len(kept)} job(s) recorded no trajectory and are not in {out} "
                f"(a Parquet row is a trajectory); `{self.recollect} --out FILE.jsonl` collects their whole results",
                markup=False, soft_wrap=True)

    def _stand_in(self, out: Path, kept: list[JobResult], why: str) -> None:
        """Write ``kept`` whole as the JSONL beside ``out`` that stands in for it; :attr:`problem` says so."""
        self.written, self.problem = write_stand_in(
            out, [r.to_wire() for r in kept], why, again=f"`{self.recollect} --out FILE` collects them again")

    def check(self) -> None:
        """End the command with :attr:`problem`, if any (after the summary, which says where the results are)."""
        if self.problem is not None:
            self.app.abort(self.problem)


#: What writing a Parquet ``--out`` raises when it cannot be written: pyarrow gone or failing (its ArrowInvalid and
#: ArrowTypeError are a ValueError and a TypeError), or a trajectory that does not read back. The results then
#: stay whole, as JSONL beside it (:func:`write_stand_in`), and the error says why.
PARQUET_ERRORS: tuple[type[Exception], ...] = (ImportError, OSError, ValueError, TypeError, KeyError, ProrlError)


def write_stand_in(out: Path, rows: list[dict[str, Any]], why: str, again: str | None = None) -> tuple[Path | None, str]:
    """Write ``rows`` (whole results, as ``--out X.jsonl`` writes them) to the JSONL beside a Parquet ``out`` that
    could not be written (``why``): the jobs ran, their results are never dropped.

    Returns where they went (None when the stand-in could not be written either) and the error that ends the
    command, naming that file; ``again``: how to collect the results again, added to it.
    """
    from prorl_cli.jsonl import write_jsonl_atomic

    path = stand_in_path(out)
    try:
        write_jsonl_atomic(path, rows, allow_nan=True)
    except OSError as e:
        still = f": the {len(rows)} result(s) are still at the broker: {again}" if again else ""
        return None, f"{out}: not written: {why}; nor could the stand-in {path} be ({e.strerror or e}){still}"
    return path, (f"{out}: not written: {why}; the {len(rows)} whole result(s) are in {path} instead "
                  f"(as --out {path.name} writes them)" + (f"; {again}" if again else ""))


def stand_in_path(out: Path) -> Path:
    """The JSONL file beside ``out`` that takes its results (``r.parquet``: ``r.jsonl``), never one that exists
    (``r-1.jsonl``, ...): the stand-in must not overwrite a file of the user's (a TASKS file named so)."""
    path = out.with_suffix(".jsonl")
    k = 0
    while path.exists():
        k += 1
        path = out.with_name(f"{out.stem}-{k}.jsonl")
    return path


def _no_trajectory_why(results: list[JobResult]) -> str:
    """Which tasks' jobs recorded no trajectory, and what records one, for the error."""
    tasks = sorted({r.task for r in results if r.task})
    which = f"{', '.join(repr(t) for t in tasks)} recorded none" if tasks else "none recorded one"
    return f"{which}: a handler's agent loop, ctx.agent(), records one"


def no_trajectory(results: list[JobResult], only_done: bool = False) -> str:
    """Why a Parquet file of ``results`` has no row: none recorded a trajectory (the error's words)."""
    return (f"no {'finished ' if only_done else ''}job has a token-level 'trajectory' in its output "
            f"({_no_trajectory_why(results)})")


#: What a cancelled submission is told it could have done instead.
SUBMIT_CANCEL_HINT = "submit --detach leaves them running; prorl results collects them"

#: Off a terminal (a batch log, ``2>&1 | tee``), a progress line at least this often while jobs run, whether or not one
#: ended meanwhile (``prorl sample`` keeps the same pace)...
PROGRESS_EVERY_S = 30.0
#: ...and one each time another such share of the jobs ended, besides the first line and the last.
PROGRESS_STEP_FRACTION = 0.1
#: On a terminal, how often the bar asks the broker how many of the unfinished jobs are queued and how many run.
PROGRESS_POLL_S = 10.0
#: Job states of a job placed on a node and not ended: what a progress line counts as running.
RUNNING_STATES = frozenset({"assigned", "init", "run", "eval"})


def tell(app: App | None, message: str) -> None:
    """``message`` on stderr, as is (no markup); a terminal already gone (SIGHUP) does not stop the cleanup it
    reports on."""
    try:
        if app is None:
            click.echo(message, err=True)
        else:
            app.err_console.print(message, markup=False, highlight=False, soft_wrap=True)
    except OSError as e:
        log.debug("stderr is gone (%s): %s", e, message)


@dataclass
class Tally:
    """What a progress line says of ``total`` jobs: those ended, by state (the results taken), and of the others
    how many the broker last said were queued; the rest of them run (placed on a node)."""

    total: int
    started_s: float = field(default_factory=time.monotonic)
    ended: dict[str, int] = field(default_factory=dict)
    queued: int = 0
    #: Jobs of the selection left out of the collection (``prorl results`` without --follow): their states.
    left_out: dict[str, int] = field(default_factory=dict)
    #: A command's own count, last on the line (``prorl eval``: ``resolved 3``).
    note: str = ""
    #: Jobs the first poll found ended already (collected after the fact, as ``prorl results`` does): their
    #: results arrive at once, and counting them would make the rate the speed of reading, not of the jobs.
    ended_before: int = 0
    _first_poll: bool = field(default=True, init=False, repr=False)

    @property
    def taken(self) -> int:
        return sum(self.ended.values())

    @property
    def running(self) -> int:
        return max(self.total - self.taken - self.queued, 0)

    def add(self, result: JobResult) -> None:
        self.ended[result.state] = self.ended.get(result.state, 0) + 1
        self.queued = min(self.queued, self.total - self.taken)

    def polled(self, states: Mapping[str, str], left: Iterable[str]) -> None:
        """The broker's ``states`` (``list_jobs``) of the jobs still ``left``."""
        from prorl_cli.protocol import TERMINAL_STATES

        left = list(left)
        self.queued = sum(1 for j in left if states.get(j) == "queued")
        if self._first_poll:  # the rate counts from here, without the jobs that had ended
            self._first_poll = False
            terminal = {s.value for s in TERMINAL_STATES}
            self.ended_before = self.taken + sum(1 for j in left if states.get(j) in terminal)
            self.started_s = time.monotonic()

    def text(self) -> str:
        """``12/40 ended (done 10, failed 2); running 5, queued 23; 0.4 jobs/s``: the states the summary counts."""
        ended = ", ".join(f"{k} {v}" for k, v in sorted(self.ended.items()))
        line = f"{self.taken}/{self.total} ended" + (f" ({ended})" if ended else "")
        if self.taken < self.total:
            line += f"; running {self.running}, queued {self.queued}"
        elapsed_s = max(time.monotonic() - self.started_s, 1e-9)
        if self.ended_before < self.total:  # else every job had ended: no rate to tell
            line += f"; {max(self.taken - self.ended_before, 0) / elapsed_s:.1f} jobs/s"
        if self.left_out:
            line += "; not collected (--follow waits): " + ", ".join(f"{k} {v}" for k, v in sorted(self.left_out.items()))
        return line + (f"; {self.note}" if self.note else "")


class ProgressReport:
    """Progress on stderr: on a terminal, rich's bar with :meth:`Tally.text` beside it, redrawn in place; off one
    (a batch log, a pipe), where the bar shows nothing before it stops, plain lines: the first, then one every
    :data:`PROGRESS_EVERY_S` and each time another :data:`PROGRESS_STEP_FRACTION` of the jobs ended, and the last.

    ``poll``: the broker's states of the selection (``list_jobs``), asked before a line that jobs still run.
    """

    def __init__(self, app: App, title: str, tally: Tally, poll: Callable[[], Mapping[str, str]] | None) -> None:
        self.app = app
        self.title = title
        self.tally = tally
        self.poll = poll
        self.left: set[str] = set()
        self.terminal = app.err_console.is_terminal
        self._bar: Any = None
        self._bar_id: Any = None
        self._polled_at: float | None = None
        self._shown_at: float | None = None
        self._shown_taken = -1

    def __enter__(self) -> ProgressReport:
        if self.terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            # The counts text carries M/N ended: no second count beside the bar.
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[counts]}"),
                                 TimeElapsedColumn(), console=self.app.err_console, transient=False)
            self._bar.start()
            self._bar_id = self._bar.add_task(self.title, total=self.tally.total, counts="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            try:
                self._bar.stop()
            except OSError as e:  # the terminal went away (SIGHUP): the cleanup that follows matters more
                log.debug("progress bar not closed: %s", e)
            self._bar = None
        elif self._shown_taken != self.tally.taken:
            self._line()  # the last state, not yet shown

    def wait_s(self) -> float:
        """How long to wait for the next result before the progress is brought up to date without one."""
        if self.terminal:
            return PROGRESS_POLL_S
        if self._shown_at is None:
            return 0.0
        return max(PROGRESS_EVERY_S - (time.monotonic() - self._shown_at), 0.0)

    def update(self) -> None:
        """After a result, or a wait without one: redraw the bar, or print a line when one is due."""
        now = time.monotonic()
        if self.terminal:
            if self._polled_at is None or now - self._polled_at >= PROGRESS_POLL_S:
                self._poll(now)
            self._bar.update(self._bar_id, completed=self.tally.taken, counts=self.tally.text())
            return
        step = max(int(self.tally.total * PROGRESS_STEP_FRACTION), 1)
        taken = self.tally.taken
        # A line when the last one is old (jobs that run for minutes still show), or another step of jobs ended.
        if (self._shown_at is None or now - self._shown_at >= PROGRESS_EVERY_S or taken >= self._shown_taken + step
                or (taken == self.tally.total and taken != self._shown_taken)):
            self._poll(now)
            self._line()

    def _poll(self, now: float) -> None:
        self._polled_at = now
        if self.poll is None or self.tally.taken >= self.tally.total:
            return
        try:
            states = self.poll()
        except ProrlError as e:  # the counts stay as last known; the collection itself reports a broker gone
            log.debug("progress: job states not read: %s", e)
            return
        self.tally.polled(states, self.left)

    def _line(self) -> None:
        self._shown_at, self._shown_taken = time.monotonic(), self.tally.taken
        tell(self.app, f"{self.title}: {self.tally.text()}")


def collect(
    app: App, client: RolloutClient, ids: list[str], title: str, sink: ResultFile,
    on_interrupt: str = "cancel", cancel_hint: str = SUBMIT_CANCEL_HINT,
    signals: InterruptSignals | None = None, poll: Callable[[], Mapping[str, str]] | None = None,
    left_out: Mapping[str, str] | None = None, on_result: Callable[[JobResult], str] | None = None,
) -> list[JobResult]:
    """Stream the results of ``ids`` into ``sink`` with progress (:class:`ProgressReport`); return them all.

    Ctrl-C, SIGTERM or SIGHUP (``on_interrupt``): ``cancel`` the unfinished jobs (saying ``cancel_hint``), or
    ``leave`` them running (they can be collected again with ``prorl results``); either way the results taken so
    far stay in ``sink``. ``signals``: the command's :class:`InterruptSignals` (default: one for this collection).
    ``poll``: the broker's states of the selection, for the queued and running counts; ``left_out``: the states
    of the selected jobs not collected (``prorl results`` without --follow), counted in the progress;
    ``on_result``: called with each result, returns the command's own note for the progress (:attr:`Tally.note`).
    """
    results: list[JobResult] = []
    tally = Tally(len(ids))
    for state in (left_out or {}).values():
        tally.left_out[state] = tally.left_out.get(state, 0) + 1
    own = None
    if signals is None:
        own = signals = InterruptSignals()
    try:
        with own or nullcontext(), ProgressReport(app, title, tally, poll) as progress, \
                client.results(ids) as stream:
            progress.left = set(ids)
            progress.update()
            while progress.left:
                try:
                    result = stream.next_within(progress.wait_s())
                except StopIteration:
                    break
                if result is not None:
                    results.append(result)
                    sink.add(result)
                    tally.add(result)
                    progress.left.discard(result.job_id)
                    if on_result is not None:
                        tally.note = on_result(result)
                progress.update()
    except KeyboardInterrupt:
        done = {r.job_id for r in results}
        left = [j for j in ids if j not in done]
        if on_interrupt == "cancel":
            # The cancel first: after SIGHUP the terminal these words go to may be gone.
            cancelled = cancel_jobs(app, client, left)
            tell(app, f"{signals.how}: cancelled {cancelled} unfinished job(s)" + (f" ({cancel_hint})" if cancel_hint else ""))
            # After SIGTERM, Slurm sends SIGKILL once its KillWait (30 s by default) is up: wait less than that.
            wait_s = CANCELLED_RESULTS_WAIT_S if signals.signum is None else TERMINATED_RESULTS_WAIT_S
            _collect_cancelled(app, client, left, results, sink, wait_s)
        else:
            tell(app, f"{signals.how}: {len(left)} job(s) still running; `{sink.recollect} --follow` "
                      "collects them later")
        raise
    finally:
        partial = sys.exc_info()[0] is not None
        sink.close(partial=partial)
        if partial and sink.problem is not None:  # the command ends with the interruption's own error
            tell(app, f"warning: {sink.problem}")
    return results


@dataclass(frozen=True)
class CancelCounts:
    """What a cancel did: ``cancelled`` by it, of ``taken`` the broker held (the rest of those had ended already;
    ids it never took answer ``unknown`` and count in neither)."""

    cancelled: int
    taken: int


def cancel_counts(client: RolloutClient, ids: list[str]) -> CancelCounts:
    """Cancel ``ids`` and count the broker's answers (its errors propagate)."""
    states = client.cancel(ids) if ids else {}
    return CancelCounts(cancelled=sum(1 for state in states.values() if state == "cancelled"),
                        taken=sum(1 for state in states.values() if state != "unknown"))


@dataclass(frozen=True)
class Resumed:
    """What a run under an earlier run's ids found at the broker: ``taken`` jobs it holds that are taken as they
    are (ended, or still running), and ``again``, those it held cancelled, forgotten so that they run again."""

    taken: int
    again: int

    def describe(self, what: str) -> str:
        """``what`` (``--id-prefix P``) resumes an earlier run: the counts, for stderr."""
        return (f"{what} resumes an earlier run: {self.taken} job(s) of it taken as they are (ended or still "
                "running; their results, not new rollouts)" + (f"; {self.again} it cancelled run again" if self.again
                                                                 else ""))


#: How long a resumed run waits for the results of the jobs an earlier run cancelled before it runs them again:
#: the broker sends a cancelled job's result once its node reported what the job did (at most
#: ``broker.cancel_result_grace_s`` after the cancel).
RERUN_WAIT_S = 60.0


def rerun_cancelled(client: RolloutClient, held: Mapping[str, str], wait_s: float = RERUN_WAIT_S) -> Resumed:
    """Before a run submits ids an earlier run may have used (the same ``--id-prefix``), given the states the broker
    ``held`` of them (``list_jobs``): forget at the broker those it holds cancelled, so that submitting their ids
    again runs them again; every other job it holds is taken as it is.

    The broker answers an id it holds with that job as it ended: a job cancelled by an interrupted run would come
    back cancelled for ever. The cancelled jobs' results are waited for first: until its node reported, the broker
    keeps a cancelled job to adopt the node's partial result, and a job forgotten before that could take the old
    node's late report for the new job's. The ids stay the same (a group keeps its members, a job its seed)."""
    cancelled = [j for j, state in held.items() if state == "cancelled"]
    if cancelled:
        client.wait(cancelled, timeout_s=wait_s)
        client.forget(cancelled)
    return Resumed(taken=len(held) - len(cancelled), again=len(cancelled))


def cancel_jobs(app: App, client: RolloutClient, ids: list[str]) -> int:
    """Cancel ``ids``; how many the broker cancelled (0, said so, when it could not be asked)."""
    try:
        return cancel_counts(client, ids).cancelled
    except (ProrlError, OSError) as e:
        tell(app, f"could not cancel {len(ids)} job(s): {e}")
        return 0


#: How long an interrupted submit waits for its cancelled jobs' results (the broker holds each for its
#: node's partial result at most ``broker.cancel_result_grace_s``); a second Ctrl-C stops waiting.
CANCELLED_RESULTS_WAIT_S = 30.0
#: The same after SIGTERM or SIGHUP (a Slurm job cancelled, preempted or at its time limit): well inside KillWait.
TERMINATED_RESULTS_WAIT_S = 10.0


def _collect_cancelled(app: App, client: RolloutClient, ids: list[str], results: list[JobResult],
                       sink: ResultFile, wait_s: float = CANCELLED_RESULTS_WAIT_S) -> None:
    """Write the cancelled jobs' results too: they carry what each job did until the cancel."""
    from prorl_cli.exceptions import BrokerUnavailable

    # ``ids`` are the jobs unfinished when the interrupt came: most were cancelled, a few may have ended first.
    taken = 0
    try:
        for result in client.as_completed(ids, timeout_s=wait_s):
            results.append(result)
            sink.add(result)
            taken += 1
    except (TimeoutError, BrokerUnavailable, KeyboardInterrupt) as e:
        tell(app, f"interrupted: took {taken} of the {len(ids)} unfinished job(s)' results "
                  f"({type(e).__name__} before the rest)" + ("" if sink.out is None else f"; those are in {sink.out}"))
    else:
        tell(app, f"interrupted: took the {len(ids)} unfinished job(s)' results (the cancelled ones' partial "
                  "trajectories)" + ("" if sink.out is None else f", written to {sink.out}"))


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
    """One row per job with a token-level ``trajectory`` (partial ones included unless ``only_done``); see docs/protocol.md.

    For a Parquet file beside results kept whole elsewhere (the quickstart's); ``--out`` goes through
    :class:`ResultFile`, which keeps the results where this cannot write them.
    """
    from prorl_cli.agent.trajectory import write_parquet

    rows = parquet_rows(results, only_done)
    if not rows:
        app.abort(f"{out}: {no_trajectory(results, only_done)}")
    try:
        write_parquet(out, rows)
    except ImportError as e:
        app.abort(str(e))
    return len(rows)


#: Failure groups the summary shows (the largest first); the rest are counted in one line.
FAILURE_GROUPS_SHOWN = 5


def print_failures(app: App, results: list[JobResult]) -> None:
    """Why jobs did not finish: failed and timed-out jobs grouped by stage, error type and first message line,
    the largest groups first, each with a job id to look up (``prorl inspect``, the job's log); then, grouped the
    same way, the jobs done although their agent ended in an error (a harness that exited non-zero)."""
    from prorl_cli.observe.failures import agent_error_key, group_failures

    print_failure_groups(app, group_failures(r for r in results if r.state in ("failed", "timed_out")))
    print_failure_groups(app, group_failures(results, key=agent_error_key), title=AGENT_ERRORS_TITLE)


#: The heading of the done jobs whose agent ended in an error (:func:`prorl_cli.observe.failures.agent_error_key`).
AGENT_ERRORS_TITLE = ("[bold]done, but the agent ended in an error[/bold] or at its time limit (scored as it left "
                      "things; the trajectory's error field of each result has it whole):")


def print_failure_groups(app: App, ranked: list[FailureGroup],
                         title: str = "[bold]why jobs did not finish[/bold] (the error field of each result has it whole):",
                         ) -> None:
    """:func:`print_failures`'s lines for groups already made (``prorl sample`` has them from the sampler's error)."""
    if not ranked:
        return
    app.err_console.print(title)
    for group in ranked[:FAILURE_GROUPS_SHOWN]:
        app.err_console.print(f"  {group.describe()}", markup=False, soft_wrap=True)
    if len(ranked) > FAILURE_GROUPS_SHOWN:
        rest = ranked[FAILURE_GROUPS_SHOWN:]
        app.err_console.print(f"  and {sum(g.count for g in rest)} job(s) in {len(rest)} other group(s)")


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
