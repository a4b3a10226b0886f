"""The trainer-side commands: ``submit``, ``status``, ``cancel``, ``stop``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.common import (
    PING_TIMEOUT_S,
    check_out_path,
    command_hint,
    connect,
    interrupt_signals,
    load_task_rows,
    ping_broker,
    sampling_of,
    sampling_options,
)
from prorl_cli.cli.naming import deployment_argument, deployment_option, id_prefix
from prorl_cli.cli.naming import id_prefix as id_prefix_of

if TYPE_CHECKING:
    from prorl_cli.cli.common import InterruptSignals
    from prorl_cli.client import RolloutClient
    from prorl_cli.protocol import JobResult, StatusReport


#: Job ids of a submission without --id-prefix: PREFIX-LINE-K with a fresh PREFIX, so `prorl results --prefix` finds them.
AUTO_PREFIX = "sub"


def run_submission(
    app: App,
    client: RolloutClient,
    task: str,
    instances: list[Any],
    n: int,
    out: Path | None,
    timeout_s: float | None,
    id_prefix: str | None,
    sampling: dict[str, Any] | None = None,
    only_done: bool = False,
    announce: bool = False,
    cancel_hint: str | None = None,
    address: str | None = None,
    lines: list[int] | None = None,
) -> list[JobResult]:
    """Submit, stream results to ``out`` as they finish, show progress and a summary.

    Job ids are ``PREFIX-LINE-K`` and the ``n`` rollouts of one line share the group ``PREFIX-LINE``
    (their GRPO group), so ``prorl results --prefix`` / ``--group`` find them again; ``lines``: each instance's
    row in its file (default: its index). A ``.parquet`` ``out`` that
    cannot be written ends in an error after the summary, the results written as JSONL beside it
    (:class:`~prorl_cli.cli.jobs.collect.ResultFile`).
    """
    from prorl_cli.cli.jobs.collect import (
        SUBMIT_CANCEL_HINT,
        ResultFile,
        cancel_jobs,
        collect,
        print_summary,
        tell,
    )

    started = time.monotonic()
    # From the first job sent: a signal while the jobs go out cancels what the broker took, as one later does.
    with interrupt_signals() as signals:
        prefix, ids = submit_jobs(app, client, task, instances, n, timeout_s, id_prefix, sampling, lines,
                                  signals=signals)
        try:
            sink = ResultFile(app, out, only_done, selection=("--prefix", prefix), address=address)
            if announce:  # a terminal killed (SIGKILL) leaves the jobs running: this is how to find them again
                app.err_console.print(f"submitted {len(ids)} job(s), ids {prefix}-LINE-K; from another terminal: "
                                      f"{sink.recollect} --follow", soft_wrap=True, markup=False)
        except KeyboardInterrupt:  # between the submission and the collection, which cancels from here on
            tell(app, f"{signals.how}: cancelled {cancel_jobs(app, client, ids)} job(s); {resume_hint(prefix)}")
            raise
        selected = id_prefix_of(prefix)
        if cancel_hint is None:
            cancel_hint = f"{SUBMIT_CANCEL_HINT}; {resume_hint(prefix)}"
        results = collect(app, client, list(ids), task, sink, cancel_hint=cancel_hint, signals=signals,
                          poll=lambda: client.list_jobs(prefix=selected))
    print_summary(app, results, time.monotonic() - started, sink.written)
    sink.check()
    return results


def submit_jobs(
    app: App, client: RolloutClient, task: str, instances: list[Any], n: int, timeout_s: float | None,
    id_prefix: str | None, sampling: dict[str, Any] | None, lines: list[int] | None = None,
    signals: InterruptSignals | None = None, detach: bool = False, address: str | None = None,
) -> tuple[str, list[str]]:
    """Submit every instance ``n`` times with ids ``PREFIX-LINE-K``, one group per line; a one-line error if refused.

    LINE is the instance's row in its file (``lines``; default its index), rows left out by --skip-bad-rows
    counted: the same row keeps its ids (and its seeds) once a bad row before it is mended.

    Ctrl-C, or a signal ``signals`` turns into one, while the jobs are sent: the jobs under these ids the broker
    took are cancelled and counted (``detach``: left, with how to send the rest or cancel them), then the
    interrupt goes on.
    """
    import uuid

    from prorl_cli.cli.jobs.collect import Resumed, rerun_cancelled
    from prorl_cli.exceptions import ProrlError

    prefix = id_prefix or f"{AUTO_PREFIX}-{uuid.uuid4().hex[:10]}"
    rows = list(range(len(instances))) if lines is None else lines
    ids = [f"{prefix}-{row}-{k}" for row in rows for k in range(n)]
    resumed = Resumed(0, 0)
    if id_prefix is not None:  # a fresh prefix names no earlier run
        try:
            wanted = set(ids)
            resumed = rerun_cancelled(client, {j: state for j, state in client.list_jobs(prefix=id_prefix_of(prefix))
                                               .items() if j in wanted})
        except ProrlError as e:
            app.abort(f"--id-prefix {prefix}: could not ask the broker for the jobs of an earlier run under it: {e}")
    # One submit op for the whole set (one journal flush); the group of each job is its line. A row's own id
    # goes in the jobs' meta, which every result echoes: results join back to the dataset by it.
    specs = [spec for i, row in enumerate(rows) for spec in client.make_specs(
        task, n, job_ids=ids[i * n:(i + 1) * n], timeout_s=timeout_s, sampling=sampling, group_id=f"{prefix}-{row}",
        meta=row_meta(instances[i]), seed_from=row * n)]
    try:
        submitted = client.submit_specs(specs, [inst for inst in instances for _ in range(n)])
    except KeyboardInterrupt:
        _interrupted_submission(app, client, task, prefix, ids, signals, detach, address)
        raise
    except ProrlError as e:
        taken = getattr(e, "submitted", None)
        if isinstance(e, OSError) or (taken is not None and taken.accepted):
            # The broker may hold part of it (a lost link, a full disk, a big submit refused partway): the same ids
            # resume it, new ones would run the part it took twice.
            app.abort(f"submit failed: {e}; send it again with --id-prefix {prefix} (what the broker took is not "
                      "run twice)")
        app.abort(f"submit failed: {e}")
    if submitted.existing or resumed.again:
        # The same ids resume a submission; a user who changed the seed, the sampling or the rows under an old
        # prefix would otherwise get the earlier rollouts back as if they were new.
        app.err_console.print(
            f"note: {len(submitted.existing)} of {len(ids)} job id(s) under --id-prefix {prefix} already exist at the "
            "broker: their earlier jobs and results are returned, not new rollouts (a resumed submission)"
            + (f"; {resumed.again} it held cancelled (an interrupted run) run again under the same ids"
               if resumed.again else "")
            + "; for new rollouts (another --seed, other sampling or rows) give a new --id-prefix",
            soft_wrap=True, markup=False)
    return prefix, ids


def resume_hint(prefix: str) -> str:
    """How an interrupted submission under ``prefix`` is resumed (:func:`submit_jobs`: what ended is taken as it
    is, what was cancelled runs again)."""
    return (f"the same command with --id-prefix {prefix} resumes (the jobs that ended are taken as they are, the "
            "cancelled ones run again)")


def _interrupted_submission(app: App, client: RolloutClient, task: str, prefix: str, ids: list[str],
                            signals: InterruptSignals | None, detach: bool, address: str | None) -> None:
    """Cancel (or, ``detach``, leave) the jobs under ``ids`` the broker took before the interrupt, and say so.

    The client sends its messages in order, on one connection: a part of the submit already sent is taken
    before this cancel is read, and ids never sent come back ``unknown``.
    """
    from prorl_cli.cli.jobs.collect import cancel_counts, tell
    from prorl_cli.exceptions import ProrlError

    how = signals.how if signals is not None else "interrupted"
    cancel_hint = command_hint(app, "cancel", "--prefix", prefix, address=address)
    if detach:
        tell(app, f"{how} while submitting: the broker may hold part of the {len(ids)} job(s) (ids {prefix}-LINE-K), "
                  f"left running; the same command with --id-prefix {prefix} sends the rest (what it took is not "
                  f"run twice); `{cancel_hint}` cancels them")
        return
    try:
        counts = cancel_counts(client, ids)
    except (ProrlError, OSError) as e:
        tell(app, f"{how} while submitting; could not cancel what the broker took ({e}): `{cancel_hint}` does")
        return
    tell(app, f"{how} while submitting: cancelled {counts.cancelled} job(s) of {task!r} (ids {prefix}-LINE-K); the "
              f"broker had taken {counts.taken} of {len(ids)}"
              + (f", {counts.taken - counts.cancelled} of them ended already" if counts.taken > counts.cancelled else "")
              + f" (--detach leaves a submission running); {resume_hint(prefix)}")


#: A row id longer than this stays out of the meta (ids are short; meta is capped at 4 KiB packed).
ROW_ID_MAX_CHARS = 256


def row_meta(instance: Any) -> dict[str, Any] | None:
    """``{"id": ...}`` for a row with a usable id (``id``, which the domain loaders fill from the source's own
    field, or a SWE row's ``instance_id``), else ``None``."""
    if not isinstance(instance, dict):
        return None
    for key in ("id", "instance_id"):
        value = instance.get(key)
        if isinstance(value, str) and 0 < len(value) <= ROW_ID_MAX_CHARS:
            return {"id": value}
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63:
            return {"id": value}
    return None


@click.command()
@click.argument("tasks_file", metavar="TASKS", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--task", required=True, metavar="NAME", help="Handler (task type) to run every instance with.")
@click.option("-n", "--n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="Rollouts per instance.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Results file. JSONL (any name but .parquet): every job's whole result (meta.id: its row's id), written as it ends. "
                   ".parquet: one row per job with a token-level trajectory (sequence ids, loss mask, log-probs), partial "
                   "ones of failed and timed-out jobs included, with a state column, written at the end; where no job "
                   "recorded a trajectory, the results go whole to a .jsonl beside it and the command exits 1. "
                   "`prorl sample` writes training samples to .parquet instead (docs/training.md).")
@click.option("--only-done", is_flag=True, help="--out keeps only jobs that ended done.")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), help="In-stage time budget per job.")
@click.option("--id-prefix", metavar="PREFIX",
              help="Job ids PREFIX-LINE-K (default: a fresh sub-XXXXXXXXXX): resubmitting resumes instead of rerunning "
                   "(jobs that ended are taken as they are; ones an interrupt cancelled run again under their ids), "
                   "and `prorl results --prefix PREFIX` collects them.")
@click.option("--detach", is_flag=True, help="Submit, print the id prefix and exit; collect later with `prorl results --prefix`.")
@click.option("--strict", is_flag=True, help="Exit 1 when any job did not end done (by default failed and timed-out jobs are counted, not errors).")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@deployment_option
@sampling_options
@click.option("--dapo", is_flag=True, hidden=True)  # moved to `prorl sample`; named in the error
@pass_app
def submit(
    app: App, tasks_file: Path, task: str, n: int, out: Path | None, only_done: bool, timeout_s: float | None,
    id_prefix: str | None, detach: bool, strict: bool, address: str | None,
    fmt: str | None, skip_bad_rows: bool, max_tokens: int | None, temperature: float | None, top_p: float | None, seed: int | None,
    sampling_json: str | None, sampling_file: Path | None, dapo: bool,
) -> None:
    """Submit every instance of TASKS (JSONL, Parquet or JSON) and collect the results.

    \b
    For the domain tasks (math, code, swe, search) public dataset rows are converted to instances.
    Every job gets the same sampling (--max-tokens, --temperature, --top-p, --seed, --sampling):
    handlers pass it to each generate call; unset fields keep their defaults (SamplingParams, docs/protocol.md).
    A seed seeds the submission: rollout K of row LINE gets a seed derived from it and LINE x N + K, so a
    row's N rollouts differ and a rerun repeats them.
    Progress goes to stderr: on a terminal a bar with the jobs ended (by state), running and
    queued; off one (a batch log, 2>&1 | tee) the same as plain lines, one every 30 s and one each
    time another 10 % of the jobs ended.
    Exit status: 0 once every job ended (done, failed, timed out: counted in the summary), 1 when
    the submission or the connection failed (or, with --strict, when a job did not end done).

    
    Ctrl-C, SIGTERM (scancel, a batch job's time limit) or SIGHUP (a dropped ssh session), while
    the jobs are sent or after, cancels what this command submitted and has not ended, says how
    many and how to resume (the same command with its --id-prefix), and exits 130, 143 or 129.
    --out may not be TASKS itself. With --detach a signal while sending leaves what the broker
    took (the same command with its --id-prefix sends the rest); under nohup SIGHUP stays ignored.
    For GRPO groups with DAPO dynamic sampling, see `prorl sample`.
    """
    if dapo:
        app.abort("dynamic sampling is its own command: prorl sample TASKS --task T --group-size G --target-groups N "
                  "(prorl sample --help)")
    sampling = sampling_of(app, max_tokens, temperature, top_p, seed, sampling_json, sampling_file)
    rows = load_task_rows(app, task, tasks_file, fmt, skip_bad_rows)
    instances, lines = [instance for _, instance in rows], [row for row, _ in rows]
    if not instances:
        app.abort(f"{tasks_file}: no instances")
    if detach and (out is not None or only_done):
        app.abort("--detach collects nothing: collect with "
                  f"`{command_hint(app, 'results', '--prefix', 'PREFIX', '--out', 'FILE', address=address)}` "
                  "instead of --out")
    if out is not None:
        check_out_path(app, out, tasks_file=tasks_file)
    with connect(app, address) as client:
        if detach:
            with interrupt_signals() as signals:
                prefix, ids = submit_jobs(app, client, task, instances, n, timeout_s, id_prefix, sampling, lines,
                                          signals=signals, detach=True, address=address)
            # stdout: the prefix alone (PREFIX=$(prorl submit --detach ...)); stderr: what to do with it.
            click.echo(prefix)
            collect_hint = command_hint(app, "results", "--prefix", prefix, "--follow", "--out", "results.jsonl",
                                        address=address)
            app.err_console.print(
                f"submitted {len(ids)} job(s) of {task!r}: ids {prefix}-LINE-K, one group {prefix}-LINE per line\n"
                f"  collect:  {collect_hint}\n"
                f"  cancel:   {command_hint(app, 'cancel', '--prefix', prefix, address=address)}",
                soft_wrap=True, markup=False)
            return
        # Ctrl-C, SIGTERM, SIGHUP: the jobs sent so far, or the unfinished ones, are cancelled and counted; the
        # command ends with one line, exit 130, 143 or 129 (run_submission).
        results = run_submission(app, client, task, instances, n, out, timeout_s, id_prefix, sampling, only_done,
                                 announce=True, address=address, lines=lines)
    if strict and any(r.state != "done" for r in results):
        raise click.exceptions.Exit(1)


def print_status(app: App, status: StatusReport) -> None:
    from rich.table import Table

    from prorl_cli.observe.dashboard import status_flags

    jobs = " ".join(f"{k}={v}" for k, v in status.jobs.items() if v)
    flags = status_flags(status)
    app.console.print(
        f"deployment [bold]{status.deployment}[/]: up {status.uptime_s:.0f} s; jobs: {jobs or 'none'}"
        + (f"; {', '.join(flags)}" if flags else "")
    )
    nodes = Table(title="nodes")
    for col in ("node", "host", "alive", "sandbox", "inflight/credit", "init a/q", "run a/q", "eval a/q", "tasks"):
        nodes.add_column(col, overflow="fold")  # ids and hosts whole, on two lines if need be, never cut
    for n in status.nodes:
        cells = [f"{n.stages.get(s, {}).get('active', 0)}/{n.stages.get(s, {}).get('queued', 0)}" for s in ("init", "run", "eval")]
        # `local` runs agent code without isolation: make it stand out.
        sandbox = "[yellow]local[/]" if n.sandbox_runtime == "local" else (n.sandbox_runtime or "-")
        nodes.add_row(n.node_id, n.host, _liveness(app, n), sandbox, f"{n.inflight}/{n.credit}", *cells,
                      ",".join(n.tasks))
    app.console.print(nodes)
    print_backends(app, status.backends, status.gone_backends)


def _liveness(app: App, node: Any) -> str:
    """``yes``; ``silent N s`` once it missed two heartbeats (not yet declared lost); ``left`` or ``lost: why``."""
    from prorl_cli.protocol.records import NODE_LEFT

    if not node.alive:
        if node.lost_reason and node.lost_reason.startswith(NODE_LEFT):
            return node.lost_reason  # a planned exit (drain, scale-down, down): not a loss
        return f"[red]lost[/]: {node.lost_reason}" if node.lost_reason else "[red]no[/]"
    if node.silent_s > 2 * app.config.broker.heartbeat_interval_s:
        return f"[yellow]silent {node.silent_s:.0f} s[/]"
    return "[yellow]draining[/]" if node.draining else "yes"


def print_backends(app: App, backends: list[Any], gone: list[Any] | None = None) -> None:
    """The backends table; bridges that went away (``gone``) last, as ``left`` (a planned exit) or ``lost: why``."""
    from rich.markup import escape
    from rich.table import Table

    from prorl_cli.protocol.records import NODE_LEFT

    table = Table(title="inference backends")
    engine_stats = any(b.stats for b in backends)
    for col in ("backend", "kind", "model", "host", "in-flight", "jobs", "served", "policy", "state"):
        table.add_column(col, overflow="fold")
    if engine_stats:  # simulated engines report what a GPU server's metrics would show
        for col in ("busy", "tokens/s", "prefix hits"):
            table.add_column(col, overflow="fold")
    for b in [*backends, *(gone or [])]:
        state = "dead" if not b.alive else ("cleared" if b.cleared else "loading weights" if b.loading else "active")
        if b.gone_reason is not None:
            state = b.gone_reason if b.gone_reason.startswith(NODE_LEFT) else f"[red]lost[/]: {b.gone_reason}"
        elif b.alive and b.resting_s > 0:  # it failed calls in a row: new calls avoid it meanwhile
            state = f"[yellow]resting {b.resting_s:.0f} s[/]: {escape(b.last_fault or '')}"
        policy = "-" if b.policy_version is None else f"v{b.policy_version}"  # the weights it serves (-: its start ones)
        row = [b.backend_id, b.kind, b.model or "-", b.host or "-", str(b.inflight), str(b.jobs), str(b.served), policy, state]
        if engine_stats:
            st = b.stats
            row += [f"{st['busy_fraction']:.0%}" if "busy_fraction" in st else "-",
                    f"{st['tokens_per_s']:.0f}" if "tokens_per_s" in st else "-",
                    f"{st['prefix_hit_rate']:.0%}" if "prefix_hit_rate" in st else "-"]
        table.add_row(*row)
    app.console.print(table)


@click.command()
@deployment_argument
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@click.option("--watch", is_flag=True, help="Live dashboard refreshed each second (same as `prorl top`).")
@deployment_option
@pass_app
def status(app: App, as_json: bool, address: str | None, watch: bool) -> None:
    """Jobs by state, per-node stage queues, sandbox runtimes and per-backend load.

    \b
    DEPLOYMENT is the same as -d NAME (prorl status NAME, prorl status -d NAME).
    For a deployment started with `prorl launch`, Slurm's view comes first:
    job ids, states, pending reasons or nodes, elapsed and time left. A broker
    that does not answer while its Slurm job is queued or running (requeued,
    starting) is reported as restarting, exit 0; exit 1 when its job is gone
    or ended, or when every Slurm job of the deployment is.

    \b
    --json: the broker's report. For a `prorl launch` deployment, with
    "broker": "up" and "slurm" (one entry per Slurm task); while its broker
    restarts, "broker": "restarting", "broker_detail" (Slurm's words), "error"
    and "slurm", exit 0; "broker": "gone" (every Slurm job gone), "ended" or
    "unreachable" exit 1, as without --json.
    """
    if watch:
        from prorl_cli.cli.observe import run_top

        return run_top(app, address, as_json, 1.0)
    from prorl_cli.cli.launch import print_slurm_view, slurm_view

    view = slurm_view(app, app.config.deployment_dir) if as_json else print_slurm_view(app, app.config.deployment_dir)
    slurm = {"slurm": view.to_json()} if view is not None else {}
    if view is not None and view.gone:
        if as_json:
            _echo_json({"deployment": app.config.deployment, "broker": "gone", **slurm})
        raise click.exceptions.Exit(1)  # every Slurm job of it is gone: say so, do not wait for a broker
    if view is None:
        with connect(app, address) as client:
            report = client.status()
    else:
        found = _broker_report(app, address)
        if isinstance(found, str):
            restarting = view.broker_restarting()
            if restarting is None:
                ended = view.broker_ended()
                if as_json:
                    _echo_json({"deployment": app.config.deployment, "broker": "ended" if ended else "unreachable",
                                "broker_detail": ended, "error": found, **slurm})
                    raise click.exceptions.Exit(1)
                app.abort(f"{found}" + (f"; the broker: {ended}" if ended else ""))
            if as_json:
                _echo_json({"deployment": app.config.deployment, "broker": "restarting", "broker_detail": restarting,
                            "error": found, **slurm})
            else:
                app.console.print(f"[bold yellow]broker restarting[/]: {restarting}, not answering yet; "
                                  f"its view comes back once it is up ({found})", soft_wrap=True)
            return
        report = found
    if as_json:
        # A launch adds the broker's state and Slurm's view; otherwise the report alone (StatusReport.from_wire).
        _echo_json({**report.to_wire(), **({"broker": "up", **slurm} if view is not None else {})})
    else:
        print_status(app, report)


def _echo_json(doc: dict[str, Any]) -> None:
    click.echo(json.dumps(doc, indent=2))


def _broker_report(app: App, address: str | None) -> StatusReport | str:
    """The broker's status, or why there is none (no rendezvous file, no answer): ``status`` of a Slurm launch
    then looks at the broker's Slurm job before it calls that an error."""
    from prorl_cli.client import RolloutClient
    from prorl_cli.exceptions import BrokerBusy, BrokerUnavailable, RendezvousError

    client = RolloutClient(app.config.deployment, address=address, config=app.config)
    try:
        ping_broker(app, client, address)
        return client.status()
    except (RendezvousError, BrokerBusy) as e:
        return str(e)
    except (BrokerUnavailable, TimeoutError):
        return (f"the broker at {client.address or address or '?'} does not answer (deployment "
                f"{app.config.deployment!r}, no reply within {PING_TIMEOUT_S:g} s)")
    finally:
        client.close()


@click.command()
@click.argument("job_ids", nargs=-1)
@click.option("--prefix", metavar="PREFIX", help="Cancel the unfinished jobs of a submission: ids PREFIX-... (its --id-prefix, or what --detach printed).")
@click.option("--group", "group_id", metavar="GROUP", help="Cancel every unfinished job of group GROUP (PREFIX-LINE for prorl submit).")
@click.option("--all", "all_jobs", is_flag=True, help="Cancel every unfinished job of the deployment.")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@deployment_option
@pass_app
def cancel(app: App, job_ids: tuple[str, ...], prefix: str | None, group_id: str | None, all_jobs: bool, address: str | None) -> None:
    """Cancel queued or running jobs: by id, --prefix, --group or --all.

    Prints each job's state after the cancel; exits 1 if any id given is unknown
    (a selection that matches nothing unfinished is not an error: it says so).
    """
    from prorl_cli.protocol import TERMINAL_STATES

    chosen = [bool(job_ids), prefix is not None, group_id is not None, all_jobs]
    if sum(chosen) != 1:
        app.abort("give job ids, or one of --prefix PREFIX, --group GROUP, --all")
    with connect(app, address) as client:
        if job_ids:
            targets = list(job_ids)
        else:
            ended = {s.value for s in TERMINAL_STATES}
            held = client.list_jobs(prefix=id_prefix(prefix), group_id=group_id)
            targets = [j for j, state in held.items() if state not in ended]
            if not targets:
                what = f"--prefix {prefix}" if prefix is not None else f"--group {group_id}" if group_id is not None else "--all"
                app.console.print(f"{what}: no unfinished job ({len(held)} matching job(s) had ended)")
                return
        states = client.cancel(targets)
    for job_id, state in states.items():
        app.console.print(f"{job_id}: {state}")
    if not job_ids:
        app.console.print(f"cancelled {sum(s == 'cancelled' for s in states.values())} job(s)")
    unknown = [j for j, state in states.items() if state == "unknown"]
    if unknown and job_ids:
        app.abort(f"{len(unknown)} unknown job id(s): {', '.join(unknown)}")


@click.command()
@deployment_argument
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@deployment_option
@pass_app
def stop(app: App, address: str | None) -> None:
    """Stop the deployment: cancel every job, shut nodes and bridges down, stop the broker.

    DEPLOYMENT is the same as -d NAME. On Slurm, `prorl down NAME` does this and also
    empties squeue and removes the launch record. A broker of this host that was killed
    (its process gone) cannot take the stop: its stop record is written here instead, and
    the nodes and bridges still waiting for it leave.
    """
    if address is None and _record_stop_of_a_killed_broker(app):
        return
    with connect(app, address) as client:
        client.stop()
    app.console.print(f"deployment {app.config.deployment} is stopping")


def _record_stop_of_a_killed_broker(app: App) -> bool:
    """Write the stop record a broker writes as it takes ``stop``, when the deployment's broker ran on this host
    and its process is gone (killed outright: nothing else removes its rendezvous file). Its peers, silent
    broker and stop record both, then leave instead of registering again for ever. A broker elsewhere that does
    not answer may be starved or on its way back (Slurm): that one is :func:`connect`'s to report."""
    from prorl_cli.exceptions import RendezvousError
    from prorl_cli.rendezvous import read_rendezvous, record_stop

    try:
        info = read_rendezvous(app.config.deployment_dir)
    except RendezvousError:
        return False
    if not info.process_gone():
        return False
    record_stop(app.config.deployment_dir, info.address)
    app.console.print(f"deployment {app.config.deployment} is stopped: its broker (pid {info.pid} on this host) was "
                      "killed before; its stop record is written, so the nodes and bridges waiting for it leave. Its "
                      "journal still holds the jobs it had: a broker started again under this name "
                      f"(`{command_hint(app, 'serve broker')}`) takes them up")
    return True
