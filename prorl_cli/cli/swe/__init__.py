"""``prorl swe``: SWE dataset tools; ``prorl swe validate`` cleans a dataset by running its gold and base tests.

Heavy imports happen inside the commands so ``prorl --help`` stays instant.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.common import interrupt_signals, warning_printer
from prorl_cli.cli.naming import deployment_option

FLAKY_CHOICES = ("remove-ids", "drop-row")


@click.group("swe")
def swe() -> None:
    """SWE datasets: validate and clean them (prorl swe validate)."""


@swe.command("validate")
@click.argument("dataset", metavar="DATASET", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("prorl-validate"), show_default=True,
              help="Folder for clean.jsonl, report.json, report.html and results.jsonl; run again to resume.")
@click.option("-k", "--runs", type=click.IntRange(min=1), default=3, show_default=True,
              help="Gold-patch runs per instance (a listed test that both passes and fails across them is flaky).")
@click.option("--flaky", "flaky_policy", type=click.Choice(FLAKY_CHOICES), default="remove-ids", show_default=True,
              help="A flaky row in clean.jsonl: its flaky ids removed from the lists, or the row dropped.")
@click.option("--format", "fmt", metavar="SOURCE", default="auto", show_default=True,
              help="The project DATASET's rows come from (as for prorl eval: swe-bench, swe-gym, swe-smith, swe-rebench, "
                   "nebius, swebench-task, prorl).")
@click.option("--instance-id", "instance_ids", multiple=True, metavar="ID", help="Only these instances (repeatable).")
@click.option("--repo-images", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A repo_images JSON map (prorl build-images --swe writes one) for the instances' images.")
@click.option("--base", metavar="REF", help="Build the images first: prorl build-images --swe DATASET --base REF.")
@click.option("--images-from", metavar="docker://NS|DIR",
              help="Pull the images first: prorl build-images --swe DATASET --images-from SOURCE.")
@click.option("--wheels", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="With --base: install pip packages from this wheels folder only (offline).")
@click.option("--repos-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="With --base: git repositories as DIR/owner__name or DIR/owner/name.")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), help="Time budget per job.")
@click.option("--retry-not-evaluated", is_flag=True,
              help="Run again the runs kept in OUT that could not be evaluated (a lost node, a timeout); "
                   "by default a second run keeps them.")
@click.option("--parallel", type=click.IntRange(min=1), default=4, show_default=True,
              help="Without -d: jobs per stage at once on this machine.")
@deployment_option
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint of the deployment (default: its rendezvous file).")
@pass_app
def validate(app: App, dataset: Path, out: Path, runs: int, flaky_policy: str, fmt: str, instance_ids: tuple[str, ...],
             repo_images: Path | None, base: str | None, images_from: str | None, wheels: Path | None,
             repos_dir: Path | None, timeout_s: float | None, retry_not_evaluated: bool, parallel: int,
             address: str | None) -> None:
    """Validate every instance of DATASET (SWE rows: JSONL, Parquet or JSON) and write the clean rows.

    \b
    Each instance: its image (built or pulled first with --base / --images-from), then
    K runs with the gold patch (swe_oracle) and one with the test patch alone (swe_no_fix).
    Classes: valid; env-broken (a run could not be evaluated: reported, never scored);
    gold-fails; f2p-passes-without-fix; flaky (flaky ids found and reported).
    Writes OUT/clean.jsonl (valid rows; flaky ones by --flaky), OUT/report.json and OUT/report.html.
    Runs on this machine (broker and node as child processes) unless a deployment is named
    (-d NAME, prorl -d NAME, $PRORL_DEPLOYMENT). Running it again on the same OUT resumes.
    Exits 1 while instances are pending (jobs cancelled or cut short).
    """

    from prorl_cli.cli.common import dataset_errors
    from prorl_cli.cli.naming import named_deployment
    from prorl_cli.domains.datasets import load_instances
    from prorl_cli.exceptions import DatasetError
    from prorl_cli.swe.validate_run import read_repo_images, run_id_for

    if base and images_from:
        app.abort("give --base (build the images) or --images-from (pull them), not both")
    if out.exists() and not out.is_dir():
        app.abort(f"--out {out}: is not a folder")
    try:
        instances: list[dict[str, Any]] = load_instances(
            "swe", dataset, fmt, warn=warning_printer(app))
        if instance_ids:
            unknown = sorted(set(instance_ids) - {str(i["instance_id"]) for i in instances})
            if unknown:
                raise DatasetError(f"{dataset}: no instance(s) {unknown}")
            instances = [i for i in instances if str(i["instance_id"]) in instance_ids]
        ids = [str(i["instance_id"]) for i in instances]
        if not ids:
            raise DatasetError(f"{dataset}: no instances")
        if len(set(ids)) != len(ids):
            raise DatasetError(f"{dataset}: instance ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
        run_id = run_id_for(out, dataset)
        images: dict[str, str] = read_repo_images(repo_images) if repo_images else {}
    except dataset_errors() as e:
        app.abort(str(e))
    if base or images_from:
        images = {**_build_images(app, dataset, out, base, images_from, wheels, repos_dir, fmt), **images}
    deployment = named_deployment(app) if address is None else app.config.deployment
    _run(app, dataset, out, instances, images, run_id, runs, flaky_policy, timeout_s, retry_not_evaluated, parallel,
         deployment, address)


def _build_images(app: App, dataset: Path, out: Path, base: str | None, images_from: str | None, wheels: Path | None,
                  repos_dir: Path | None, fmt: str) -> dict[str, str]:
    """``prorl build-images --swe`` in a child (its own log in OUT), then the repo_images map it wrote.

    The child reads DATASET with validate's ``--format``: under ``auto`` it could read other rows (or none).
    """
    from prorl_cli.swe.validate_run import read_repo_images

    map_out = out / "repo_images.json"
    log = out / "build-images.log"
    cmd = [sys.executable, "-m", "prorl_cli", *(["--config", app.config_path] if app.config_path else []),
           "build-images", "--swe", str(dataset), "--format", fmt, "--map-out", str(map_out)]
    cmd += ["--base", base] if base else ["--images-from", str(images_from)]
    cmd += ["--wheels", str(wheels)] if wheels else []
    cmd += ["--repos-dir", str(repos_dir)] if repos_dir else []
    app.err_console.print(f"images: {shlex.join(['prorl', *cmd[3:]])} (log: {log})", soft_wrap=True, markup=False)
    with log.open("wb") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, check=False)
    if not map_out.is_file():
        app.abort(f"build-images --swe made no repo_images map (exit {done.returncode}); see {log}")
    if done.returncode != 0:
        app.err_console.print(f"[yellow]warning:[/] some images were not built (exit {done.returncode}; see {log}): "
                              "their instances are env-broken", soft_wrap=True)
    from prorl_cli.exceptions import DatasetError

    try:
        return read_repo_images(map_out)
    except DatasetError as e:
        app.abort(str(e))


def _run(app: App, dataset: Path, out: Path, instances: list[dict[str, Any]], images: dict[str, str], run_id: str,
         runs: int, policy: str, timeout_s: float | None, retry_not_evaluated: bool, parallel: int,
         deployment: str | None, address: str | None) -> None:
    """Plan the jobs, run those without a result (on the deployment or an embedded one), classify, write."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from prorl_cli.cli.common import interruption
    from prorl_cli.swe.validate_run import (
        Ledger,
        job_instance,
        plan_jobs,
        submit_and_collect,
        to_run,
    )
    from prorl_cli.swe.validation import ENV_BROKEN, NO_FIX, RunOutcome, Verdict, classify

    ledger = Ledger(out)
    submitted: dict[str, dict[str, Any]] = {}
    verdicts: dict[str, Verdict] = {}
    for row in instances:
        # Without an image map, the images come from the deployment's swe settings.
        inst, image = job_instance(row, images)
        iid = str(inst["instance_id"])
        if images and image is None:  # an image map was given (or built) and has none for this instance
            verdicts[iid] = Verdict(iid, ENV_BROKEN, "no image: the repo_images map has none for this instance "
                                    "(by instance id, repo@version or repo)", False)
        else:
            submitted[iid] = inst
    jobs = plan_jobs(list(submitted.values()), runs, run_id)
    todo = to_run(jobs, ledger, retry_not_evaluated)
    if ledger.unreadable:
        app.err_console.print(f"{ledger.path}: {ledger.unreadable} unreadable line(s) skipped; their jobs run again")
    done_before = len(jobs) - len(todo)
    app.err_console.print(f"{dataset}: {len(instances)} instance(s), {len(jobs)} job(s) ({runs} gold run(s) + 1 with the "
                          f"test patch alone each); {done_before} already have a result in {ledger.path}",
                          soft_wrap=True, markup=False)

    by_instance: dict[str, list[Any]] = {}
    for job in jobs:
        by_instance.setdefault(job.instance_id, []).append(job)

    def classify_all() -> None:
        for iid, inst in submitted.items():
            mine = by_instance[iid]
            last = [ledger.latest(j)[0] for j in mine]
            if all(r is not None and r.state != "cancelled" for r in last):
                outcomes = [RunOutcome.from_result(j.kind, j.k, r) for j, r in zip(mine, last, strict=True)]
                gold = [o for o in outcomes if o.kind != NO_FIX]
                verdicts[iid] = classify(inst, gold, next(o for o in outcomes if o.kind == NO_FIX))

    if todo:
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[note]}"), TimeElapsedColumn())
        # SIGTERM (a batch job's time limit) and SIGHUP as Ctrl-C: the results so far are written and the embedded
        # deployment is stopped, not left running without its parent.
        with interrupt_signals(), _Deployment(app, out, deployment, address, parallel) as client, \
                Progress(*columns, console=app.err_console) as progress:
            bar = progress.add_task("validate", total=len(jobs), completed=done_before, note="")

            def on_result(result: Any) -> None:
                ledger.add(result)
                if result.state != "cancelled":
                    progress.update(bar, advance=1, note=f"last: {result.job_id} {result.state}")

            try:
                submit_and_collect(client, todo, submitted, timeout_s, on_result)
            except KeyboardInterrupt as e:
                classify_all()
                _write(app, out, dataset, instances, verdicts, runs, policy)
                how, code = interruption(e)
                app.abort(f"{how}: {len(ledger.results)} result(s) kept in {ledger.path}; "
                          "run the same command again to resume", code=code)
    classify_all()
    summary = _write(app, out, dataset, instances, verdicts, runs, policy)
    if summary.pending:
        raise click.exceptions.Exit(1)


def _write(app: App, out: Path, dataset: Path, instances: list[dict[str, Any]], verdicts: dict[str, Any], runs: int,
           policy: str) -> Any:
    from prorl_cli.swe.validate_report import write_outputs
    from prorl_cli.swe.validation import clean_row

    rows = [row for inst in instances if (v := verdicts.get(str(inst["instance_id"]))) is not None
            and (row := clean_row(inst, v, policy)) is not None]
    summary = write_outputs(out, dataset, [str(i["instance_id"]) for i in instances], verdicts, rows, runs, policy)
    counts = "  ".join(f"{k} {n}" for k, n in summary.counts.items() if n)
    app.console.print(f"{dataset.name}: {counts}  -> {summary.clean_rows} row(s) in {summary.clean}; "
                      f"report {summary.report}, {summary.html}", soft_wrap=True, markup=False)
    unevaluated = sorted(i for i, v in verdicts.items() if not v.evaluated)
    if unevaluated:
        app.err_console.print(f"{len(unevaluated)} instance(s) not evaluated (no score given), e.g. {unevaluated[0]}: "
                              f"the reasons are in {summary.report} (not_evaluated, results)", soft_wrap=True, markup=False)
    return summary


class _Deployment:
    """A client of the named deployment, or of one started on this machine for this run (stopped after)."""

    def __init__(self, app: App, out: Path, deployment: str | None, address: str | None, parallel: int) -> None:
        self.app, self.out, self.deployment, self.address, self.parallel = app, out, deployment, address, parallel
        self.stack: Any = None
        self.client: Any = None

    def __enter__(self) -> Any:
        if self.deployment is not None or self.address is not None:
            from prorl_cli.cli.jobs import connect

            self.client = connect(self.app, self.address)
            return self.client
        from prorl_cli.embedded import LocalStack
        from prorl_cli.swe.validate_run import embedded_config

        home = (self.out / "deployment").resolve()
        self.stack = LocalStack(home, "validate", embedded_config(self.app.config, self.parallel))
        self.app.err_console.print(f"no deployment named: running broker and node on this machine (logs in {self.stack.logs})",
                                   soft_wrap=True, markup=False)
        try:
            self.stack.start_broker()
            self.stack.start_node("node-0")
        except BaseException:
            self.stack.close()
            raise
        return self.stack.client

    def __exit__(self, *exc: object) -> None:
        if self.stack is not None:
            self.stack.close()
        elif self.client is not None:
            self.client.close()
