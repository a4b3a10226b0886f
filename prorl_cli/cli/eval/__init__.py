"""``prorl eval``: run a SWE-bench-format dataset on a deployment and write SWE-bench-compatible results."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.common import warning_printer
from prorl_cli.cli.naming import deployment_option

if TYPE_CHECKING:
    from prorl_cli.protocol import JobResult


@click.command("eval")
@click.argument("dataset", metavar="DATASET", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--task", required=True, metavar="NAME",
              help="Handler to run each instance with: swe, swe_oracle (the gold patch), or a subclass of swe.")
@click.option("-n", "--n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="Samples per instance (pass@k up to n).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("prorl-eval"), show_default=True,
              help="Folder for predictions.jsonl, samples.jsonl, reports/, details/ and summary.json.")
@click.option("--run-id", metavar="ID",
              help="Job ids ID-DIGEST-K (DIGEST: the row's): running the same ID again resumes instead of rerunning "
                   "(jobs that ended are taken as they are; one cancelled by an interrupt runs again as ID-DIGEST-K-a2).")
@click.option("--model-name", metavar="NAME", help="model_name_or_path in the predictions (default: the task name).")
@click.option("--instance-id", "instance_ids", multiple=True, metavar="ID", help="Only these instances (repeatable).")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), help="In-stage time budget per job.")
@click.option("--format", "fmt", metavar="SOURCE", default="auto", show_default=True,
              help="The project DATASET's rows come from, where auto should not guess: swe-bench, swe-gym, swe-smith, "
                   "swe-rebench, nebius, swebench-task, prorl (docs/domains.md, 'SWE datasets: sources').")
@deployment_option
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")
@pass_app
def eval_command(app: App, dataset: Path, task: str, n: int, out: Path, run_id: str | None, model_name: str | None,
                 instance_ids: tuple[str, ...], timeout_s: float | None, fmt: str, address: str | None) -> None:
    """Run every instance of DATASET (SWE-bench rows: JSONL, Parquet or JSON) N times and grade it.

    Writes SWE-bench predictions (instance_id, model_name_or_path, model_patch), swebench's
    per-instance report.json under reports/, per-instance details under details/ (stage timings,
    missing tests with the closest id run, log tail, infra failure step), and summary.json with
    swebench's run-report keys, the resolved rate and pass@k. Fields of DATASET prorl cannot use
    are named on stderr, once each. Reports and details of instances not in this run, left in
    the folder by an earlier one, are removed. Exits 1 when a job did not finish (state other
    than done): such samples are counted, by state, on stderr and count as unresolved.
    Progress (jobs ended by state, running, queued, resolved) goes to stderr: a bar on a
    terminal, plain lines off one (every 30 s and every 10 % of the jobs). Ctrl-C, SIGTERM or
    SIGHUP cancels the unfinished jobs, says how many and the command that resumes the run
    (its run id), writes nothing, and exits 130, 143 or 129.
    """
    from prorl_cli.cli.common import connect, dataset_errors, interrupt_signals
    from prorl_cli.cli.jobs.collect import ResultFile, cancel_jobs, collect, tell
    from prorl_cli.domains.datasets import load_instances
    from prorl_cli.exceptions import ProrlError
    from prorl_cli.swe.evaluation import Sample, attempt_ids, remove_stale, write_outputs
    from prorl_cli.swe.evaluation import job_ids as eval_job_ids

    _check_swe_task(app, task, dataset)
    try:
        instances: list[dict[str, Any]] = load_instances(
            "swe", dataset, fmt, warn=warning_printer(app))
    except dataset_errors() as e:
        app.abort(str(e))
    if instance_ids:
        unknown = sorted(set(instance_ids) - {i["instance_id"] for i in instances})
        if unknown:
            app.abort(f"{dataset}: no instance(s) {unknown}")
        instances = [i for i in instances if i["instance_id"] in instance_ids]
    ids = [str(i["instance_id"]) for i in instances]
    if not ids:
        app.abort(f"{dataset}: no instances")
    if len(set(ids)) != len(ids):
        app.abort(f"{dataset}: instance ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    if out.exists() and not out.is_dir():
        app.abort(f"--out {out}: is not a folder")
    # Ids made here, a fresh run id without --run-id: an interrupt while they are sent cancels them by id.
    run = run_id or f"eval-{uuid.uuid4().hex[:10]}"
    job_ids = eval_job_ids(run, instances, n)
    samples: list[Sample] = []
    resume = _resume_hint(app, dataset, task, n, out, run, model_name, instance_ids, timeout_s, fmt, address)
    # Ctrl-C, SIGTERM (a batch job's time limit), SIGHUP (a dropped ssh session): the unfinished jobs are cancelled
    # and counted, nothing is graded or written, and the command exits 130, 143 or 129. The jobs that ended stay
    # with the broker under the run id, which the message names: the same command with it resumes.
    with interrupt_signals() as signals, connect(app, address) as client:
        if run_id is not None:
            try:
                held = client.list_jobs(prefix=f"{run}-")
            except ProrlError as e:
                app.abort(f"--run-id {run}: could not ask the broker for the run's jobs: {e}")
            job_ids, again = attempt_ids(job_ids, held)
            kept = sum(1 for j in job_ids if j in held)
            if kept or again:
                tell(app, f"run {run}: {kept} job(s) of an earlier run taken as they are (ended or still running)"
                          + (f"; {again} it cancelled run again" if again else ""))
        try:
            submitted = client.submit(task, instances, n=n, job_ids=job_ids, timeout_s=timeout_s)
        except KeyboardInterrupt:
            tell(app, f"{signals.how} while submitting: cancelled {cancel_jobs(app, client, job_ids)} job(s); "
                      f"`{resume}` resumes")
            raise
        except ProrlError as e:
            app.abort(f"submit failed: {e}")
        which = {job_id: (ids[pos // n], pos % n) for pos, job_id in enumerate(submitted)}
        chosen = set(submitted)
        resolved = 0

        def graded(result: JobResult) -> str:
            """Take ``result`` as its instance's sample; the progress's note."""
            nonlocal resolved
            instance_id, k = which[result.job_id]
            samples.append(Sample.from_result(instance_id, k, result))
            resolved += bool(samples[-1].resolved)
            return f"resolved samples {resolved}"

        try:
            collect(app, client, list(submitted), f"eval {task}", ResultFile(app, None), cancel_hint="",
                    signals=signals, on_result=graded,
                    poll=lambda: {j: s for j, s in client.list_jobs(prefix=f"{run}-").items() if j in chosen})
        except KeyboardInterrupt:
            tell(app, f"nothing written to {out}; the jobs that ended stay with the broker under run id {run}: "
                      f"`{resume}` resumes (the cancelled ones run again)")
            raise
    stale = remove_stale(out, ids)
    if stale:
        tell(app, f"{out}: removed {len(stale)} report/details file(s) of instances not in this run (an earlier run "
                  f"into the same folder), e.g. {stale[0]}")
    summary = write_outputs(out, ids, samples, model_name or task, n)
    at_k = "  ".join(f"pass@{k} {v:.3f}" for k, v in summary["pass_at_k"].items())
    app.console.print(f"{task}: resolved {summary['resolved_instances']}/{summary['total_instances']} "
                      f"({summary['resolved_rate']:.1%})  {at_k}  -> {out}")
    ungraded = [s for s in samples if s.report and s.report.get("infra_failure")]
    if ungraded:
        reasons = sorted({str(s.report.get("infra_failure_reason") or "?") for s in ungraded if s.report})
        app.err_console.print(f"{len(ungraded)} sample(s) not graded (infra_failure: {', '.join(reasons)}; reward None): "
                              f"see {out / 'details'}", soft_wrap=True, markup=False)
    unfinished: dict[str, int] = {}
    for s in samples:
        if s.state != "done":
            unfinished[s.state] = unfinished.get(s.state, 0) + 1
    if unfinished:
        states = ", ".join(f"{state} {count}" for state, count in sorted(unfinished.items()))
        app.err_console.print(f"{sum(unfinished.values())} sample(s) did not finish ({states}): counted as unresolved "
                              f"in the resolved rate and pass@k (each one's state in samples.jsonl, its failure "
                              f"under {out / 'details'}); exit status 1",
                              soft_wrap=True, markup=False)
        raise click.exceptions.Exit(1)


def _resume_hint(app: App, dataset: Path, task: str, n: int, out: Path, run: str, model_name: str | None,
                 instance_ids: tuple[str, ...], timeout_s: float | None, fmt: str, address: str | None) -> str:
    """The ``prorl eval`` command that resumes this run: the same arguments with its run id."""
    from prorl_cli.cli.common import command_hint

    args: list[str | Path] = [dataset, "--task", task, "--n", str(n), "--run-id", run, "--out", out]
    for iid in instance_ids:
        args += ["--instance-id", iid]
    if model_name is not None:
        args += ["--model-name", model_name]
    if timeout_s is not None:
        args += ["--timeout-s", str(timeout_s)]
    if fmt != "auto":
        args += ["--format", fmt]
    return command_hint(app, "eval", *args, address=address)


def _check_swe_task(app: App, task: str, dataset: Path) -> None:
    """Refuse a ``--task`` whose handler is known here and is not ``swe`` or a subclass of it, before DATASET is
    read: its rows would be read as SWE rows and the error would be about a missing ``instance_id``.

    Known here: the handlers this machine finds as a node would (built-in, ``node.handler_paths``,
    ``$PRORL_HANDLER_PATHS``, entry points). A task found nowhere here may be served by the deployment's nodes
    (a handler of theirs): it goes through, and the broker refuses it if no node serves it.
    """
    from prorl_cli.cli.common import command_hint
    from prorl_cli.handlers.swe_domain import SweHandler
    from prorl_cli.node.registry import discover

    handlers = discover(app.config.node.handler_paths).handlers
    cls = handlers.get(task)
    if cls is None or issubclass(cls, SweHandler):
        return
    swe_tasks = ", ".join(sorted(name for name, c in handlers.items() if issubclass(c, SweHandler)))
    submit = command_hint(app, "submit", dataset, "--task", task, "--out", "results.jsonl")
    app.abort(f"--task {task}: eval runs swe, swe_oracle or a subclass of swe (here: {swe_tasks}), which grade "
              f"SWE-bench rows by their tests; {task!r} is {cls.__module__}.{cls.__qualname__}, not one: "
              f"`{submit}` runs it")
