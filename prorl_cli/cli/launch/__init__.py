"""``prorl launch / scale / down / render-sbatch``: a deployment on Slurm.

``launch`` submits the broker, the node array and the inference array with
submitit and shows Slurm's view beside the broker's until every task has
registered. ``prorl status`` adds the same Slurm view (:func:`print_slurm_view`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click
from rich.markup import escape

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.common import InterruptSignals, Terminated, command_hint, interruption
from prorl_cli.cli.naming import (
    deployment_option,
    name_deployment,
    named_deployment,
    require_deployment,
)

if TYPE_CHECKING:
    from rich.table import Table

    from prorl_cli.protocol import StatusReport
    from prorl_cli.slurm.deploy import DeployConfig
    from prorl_cli.slurm.record import LaunchRecord
    from prorl_cli.slurm.squeue import SlurmTask
    from prorl_cli.slurm.supervisor import NameState

# Pending reasons that waiting will not cure: launch gives up on them at once.
# (Transient ones such as ReqNodeNotAvail during a maintenance reservation are waited out.)
HOPELESS_REASONS = (
    "BadConstraints", "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "InvalidAccount",
    "InvalidQOS", "QOSMaxGRESPerJob", "QOSMaxCpuPerJobLimit", "QOSMaxWallDurationPerJobLimit", "JobHeldAdmin",
)


@dataclass(frozen=True)
class LaunchFailure:
    """Why a launch will not come up, and the log tail of the task that ended (printed on lines of their own)."""

    reason: str
    log_tail: str = ""


def _load_deploy(app: App, path: str, deployment: str | None) -> DeployConfig:
    from prorl_cli.config import ENV_LOG_LEVEL, find_config_file
    from prorl_cli.exceptions import ConfigError
    from prorl_cli.slurm.deploy import load_deploy

    try:
        cfg = load_deploy(path, deployment=deployment)
    except ConfigError as e:
        app.abort(f"config error: {e}")
    if cfg.home is None and app.overrides.get("home"):
        cfg.home = str(app.overrides["home"])
    # The roles read the prorl.yaml named here, on whatever node and in whatever folder Slurm starts them, so it
    # is settled now, as every other command finds one: deploy.yaml's `config`, else --config, $PRORL_CONFIG or
    # ./prorl.yaml. A --config that names another file than deploy.yaml does is refused, not silently dropped.
    if cfg.config is None:
        try:
            found = find_config_file(app.config_path)
        except ConfigError as e:
            app.abort(f"config error: {e}")
        cfg.config = str(found.resolve()) if found is not None else None
    elif app.config_path is not None and Path(app.config_path).resolve() != Path(cfg.config).resolve():
        app.abort(f"--config {app.config_path} and {cfg.source}'s config: {cfg.config} name different files; "
                  "the deployment file decides what its roles read: give one of them")
    level = app.overrides.get("log_level")
    if level is not None:
        # Slurm's batch scripts export this environment to every role, where $PRORL_LOG_LEVEL beats prorl.yaml
        # as it does for every command.
        os.environ[ENV_LOG_LEVEL] = str(level).upper()
    return cfg


def _deploy_for(app: App, name_or_file: str | None, command: str) -> DeployConfig:
    """A launched deployment named on the command line: its deploy.yaml, or its name (``NAME``, ``-d NAME``,
    ``$PRORL_DEPLOYMENT``), whose launch.json names the deploy file."""
    from prorl_cli.exceptions import ProrlError
    from prorl_cli.slurm.record import load_launched

    if name_or_file is not None and Path(name_or_file).is_file():
        return _load_deploy(app, name_or_file, named_deployment(app))
    name_deployment(app, name_or_file, given_as="NAME")
    name = require_deployment(app, command)
    try:
        record, cfg = load_launched(app.config.home_path / name)
    except ProrlError as e:
        app.abort(str(e))
    cfg.home = record.home
    return cfg


def _launched_for_down(app: App, name_or_file: str | None) -> tuple[LaunchRecord, DeployConfig]:
    """``down``'s deployment, its launch record read once: from its deploy.yaml or its name (``NAME``, ``-d NAME``,
    ``$PRORL_DEPLOYMENT``). One taken down before (no launch now, an ended one in ``history/``) is said so, exit 0
    (cleanup scripts may run ``down`` twice); one never launched, or an unreadable record, is an error."""
    from prorl_cli.exceptions import SlurmError
    from prorl_cli.slurm.record import LAUNCH_NAME, LaunchRecord, deploy_of, not_launched_now

    cfg: DeployConfig | None = None
    if name_or_file is not None and Path(name_or_file).is_file():
        cfg = _load_deploy(app, name_or_file, named_deployment(app))
        deployment_dir = cfg.deployment_dir
    else:
        name_deployment(app, name_or_file, given_as="NAME")
        deployment_dir = app.config.home_path / require_deployment(app, "down")
    try:
        record = LaunchRecord.load(deployment_dir)
        if record is not None:
            return record, cfg if cfg is not None else deploy_of(record)
    except SlurmError as e:
        app.abort(str(e))
    why = not_launched_now(deployment_dir)
    if why is None:
        app.abort(f"deployment {deployment_dir.name!r} was not launched (no {deployment_dir / LAUNCH_NAME})")
    app.console.print(f"nothing to take down: {why}", markup=False, soft_wrap=True, highlight=False)
    raise click.exceptions.Exit(0)


def _require_slurm(app: App) -> None:
    from prorl_cli.slurm.squeue import slurm_available

    if not slurm_available():
        app.abort("no Slurm here: squeue is missing or cannot reach a controller")


def _member_table(cfg: DeployConfig, record: LaunchRecord, rows: list[SlurmTask], report: StatusReport | None) -> Table:
    from rich.table import Table

    from prorl_cli.slurm.launcher import registered_ids

    by_id = {t.job_id: t for t in rows}
    seen = registered_ids(report)
    table = Table(title=f"deployment {cfg.deployment}", title_justify="left")
    for col in ("role", "task", "slurm job", "state", "reason / node", "elapsed", "left", "registered"):
        table.add_column(col, overflow="fold")  # job ids and nodes whole, never cut at 80 columns
    if record.broker_where == "here":
        table.add_row("broker", "-", f"pid {record.broker_pid}", "here", "", "", "", "yes" if report else "no")
    for m in record.members:
        t = by_id.get(m.job_id)
        state = t.state if t else "gone"
        # An ended task has no time left, and Slurm's reason says more of it than the node it ran on (as status).
        ended = t is not None and not t.active
        where = ((t.reason if ended and t.reason not in ("", "None") else t.pending_reason or t.nodes)
                 if t else "")
        if m.role == "broker":
            reg = "yes" if report is not None else "no"
        else:
            reg = "yes" if m.peer_id in seen else "no"
        table.add_row(m.role, m.peer_id, m.job_id, state, where, t.elapsed if t else "",
                      t.time_left if t and not ended else "", reg)
    return table


@dataclass
class SlurmView:
    """What ``prorl status`` printed of Slurm's view, for what it does next."""

    record: LaunchRecord
    rows: list[SlurmTask] | None  # None: squeue did not answer
    #: Taken down (or its launch failed): :func:`~prorl_cli.slurm.record.not_launched_now`'s words; ``record`` is
    #: then the last launch's, from ``history/``, and ``rows`` empty (none of its jobs is asked about).
    taken_down: str | None = None

    @property
    def gone(self) -> bool:
        """Every Slurm job of the deployment is gone (a broker ``here`` aside), or it was taken down."""
        if self.taken_down is not None:
            return True
        return self.rows is not None and not any(t.active for t in self.rows) and self.record.broker_where != "here"

    def local_broker_down(self) -> bool:
        """``broker.where: here``, started on this host, and its process is no longer running (killed, crashed,
        the machine rebooted). False where this host cannot tell (another login node started it)."""
        from prorl_cli.processes import is_local_broker

        record = self.record
        if record.broker_where != "here" or not record.broker_pid:
            return False
        if record.broker_host and record.broker_host != socket.gethostname():
            return False
        return not is_local_broker(record.broker_pid)

    def broker_task(self) -> SlurmTask | None:
        """The broker job's squeue row (None: not on Slurm, not in squeue, or squeue did not answer)."""
        by_id = {t.job_id: t for t in self.rows or []}
        return next((by_id[m.job_id] for m in self.record.of("broker") if m.job_id in by_id), None)

    def broker_restarting(self) -> str | None:
        """Slurm's words for a broker job that is queued or running (so a broker not answering is on its way
        back, e.g. requeued), or for one that ended and that its nodes and bridges are due to replace; None when
        the broker is not a Slurm job, or its job is gone or ended for good."""
        if self.record.broker_where == "here":
            return None
        t = self.broker_task()
        if t is None or not t.active:
            return self._broker_replacement_due()
        where = f" ({t.pending_reason})" if t.pending_reason else (f" on {t.nodes}" if t.nodes else "")
        return f"its Slurm job {t.job_id} is {t.state}{where}"

    def _broker_replacement_due(self) -> str | None:
        """An ended broker job its nodes and bridges will replace (supervision.json names it; some of them run)."""
        from prorl_cli.slurm.supervisor import Supervision

        ids = {m.job_id for m in self.record.of("broker")}
        if self.rows is None or not any(t.active for t in self.rows if t.job_id not in ids):
            return None  # nobody left to replace it
        state = Supervision.load(Path(self.record.home) / self.record.deployment, self.record.launch_id).names.get("broker")
        if state is not None and state.failure is not None and state.failure.job_id in ids and state.gave_up is None:
            return f"its Slurm job {state.failure.job_id} ended {state.failure.ended}; its nodes start a replacement"
        return self._broker_end_not_seen_yet(state)

    def _broker_end_not_seen_yet(self, state: NameState | None) -> str | None:
        """A broker job that ended on its own (killed, FAILED, OUT_OF_MEMORY) which no node or bridge has looked at
        yet (they look in turn, about every 5 s between them): it is replaced all the same while its restarts last,
        so it is restarting, not gone."""
        from prorl_cli.exceptions import ProrlError
        from prorl_cli.slurm import squeue
        from prorl_cli.slurm.record import load_launched

        t = self.broker_task()
        if t is None or t.state not in squeue.UNASKED_END_STATES:
            return None  # asked to end (a scancel), or aged out: the supervisor's judgement is awaited
        if state is not None and state.gave_up is not None and state.gave_up.get("job_id") == t.job_id:
            return None
        try:
            _, cfg = load_launched(Path(self.record.home) / self.record.deployment)
        except ProrlError:
            return None
        restarts = state.restarts if state is not None else 0
        if restarts >= cfg.broker.max_restarts:
            return None
        return (f"its Slurm job {t.job_id} ended {t.state}; its nodes and bridges replace it once one of them sees "
                f"that (restart {restarts + 1} of {cfg.broker.max_restarts})")

    def broker_ended(self) -> str | None:
        """How the broker job ended, when squeue still shows it ended or no longer shows it; for a broker ``here``,
        that its process is gone, and the way back."""
        if self.local_broker_down():
            record = self.record
            # Nothing replaces a broker `here` (no supervisor runs without a broker job), and its nodes and
            # bridges wait only rendezvous_wait_s for a new rendezvous file before they give up.
            home = ["prorl", "--home", record.home]  # as command_hint writes them: for any shell
            down = shlex.join([*home, "down", "-d", record.deployment])
            again = shlex.join([*home, "launch", record.deploy_file or "DEPLOY_FILE", "-d", record.deployment])
            return (f"the local broker (pid {record.broker_pid}, broker.where: here) is not running and nothing "
                    f"replaces it: `{down}`, then `{again}` starts the deployment again")
        if self.record.broker_where == "here" or self.rows is None:
            return None
        t = self.broker_task()
        if t is not None and t.active:
            return None
        ids = ", ".join(m.job_id for m in self.record.of("broker")) or "-"
        if t is None:
            return f"its Slurm job {ids} is not in squeue"  # aged out: its peers judge it from its log
        ended = f"its Slurm job {ids} ended {t.state}"
        why = self._broker_not_replaced(t)
        if why is not None and self.rows and any(r.active for r in self.rows):
            # Its nodes and bridges still run and wait for it (rendezvous_wait_s), and nothing brings it back: the
            # way out, and where its accepted jobs go.
            record = self.record
            home = ["prorl", "--home", record.home]
            down = shlex.join([*home, "down", "-d", record.deployment])
            again = shlex.join([*home, "launch", record.deploy_file or "DEPLOY_FILE", "-d", record.deployment])
            ended += (f", and nothing replaces it ({why}): `{down}` (its unfinished jobs are kept in history/), "
                      f"then `{again}` starts the deployment again")
        return ended

    def _broker_not_replaced(self, t: SlurmTask) -> str | None:
        """Why nothing will replace the ended broker job ``t``, or None when it may still be (or cannot be told)."""
        from prorl_cli.slurm import squeue
        from prorl_cli.slurm.supervisor import Supervision

        if t.state not in squeue.UNASKED_END_STATES:
            return "a broker asked to end (a scancel) is left alone"
        state = Supervision.load(Path(self.record.home) / self.record.deployment, self.record.launch_id).names.get("broker")
        if state is not None and state.gave_up is not None and state.gave_up.get("job_id") == t.job_id:
            return f"its max_restarts are spent ({state.restarts} restart(s))"
        return None

    def to_json(self) -> list[dict[str, str]]:
        """One entry per member of the launch: role, task, Slurm job id and squeue's row (``gone``: aged out)."""
        by_id = {t.job_id: t for t in self.rows or []}
        entries = []
        for m in self.record.members:
            t = by_id.get(m.job_id)
            entry = {"role": m.role, "task": m.peer_id, "job_id": m.job_id}
            if t is not None:
                entry.update(state=t.state, reason=t.reason, nodes=t.nodes, elapsed=t.elapsed, time_left=t.time_left)
            else:
                entry["state"] = "unknown" if self.rows is None else "gone"
            entries.append(entry)
        return entries


def slurm_view(app: App, deployment_dir: Path) -> SlurmView | None:
    """Slurm's view of a launched deployment, printing nothing but a warning when squeue does not answer.

    Returns None when the deployment was not launched with ``prorl launch``.
    """
    from prorl_cli.exceptions import SlurmError
    from prorl_cli.slurm import squeue
    from prorl_cli.slurm.record import LaunchRecord

    record = LaunchRecord.load(deployment_dir)
    if record is None:
        return _taken_down(app, deployment_dir)
    try:
        # -t all: a task that ended keeps its final state in squeue for MinJobAge (300 s by default).
        rows = squeue.query(record.job_ids, all_states=True)
    except SlurmError as e:
        app.err_console.print(f"[yellow]Slurm view unavailable:[/] {e}")
        return SlurmView(record, None)
    return SlurmView(record, rows)


def _taken_down(app: App, deployment_dir: Path) -> SlurmView | None:
    """A deployment with no launch.json whose last launch was taken down (or failed): a view that is ``gone``, its
    reason said on stderr in the words ``scale``, ``down`` and ``logs`` use. None when it never had a launch, or a
    broker of that name was started since by hand (its rendezvous file is back): ``status`` then asks that one."""
    from prorl_cli.exceptions import SlurmError
    from prorl_cli.rendezvous import rendezvous_path
    from prorl_cli.slurm.record import LaunchRecord, ended_launches, not_launched_now

    if rendezvous_path(deployment_dir).exists():
        return None
    why = not_launched_now(deployment_dir)
    if why is None:
        return None
    try:
        last = LaunchRecord.load(ended_launches(deployment_dir)[-1])
    except SlurmError:
        last = None
    if last is None:  # an unreadable record in history/: the reason still stands
        last = LaunchRecord(deployment=deployment_dir.name, deploy_file="", home=str(deployment_dir.parent),
                            created_at=0.0)
    app.err_console.print(f"[bold red]error:[/] {escape(why)}", soft_wrap=True, highlight=False)
    return SlurmView(last, [], taken_down=why)


def print_slurm_view(app: App, deployment_dir: Path) -> SlurmView | None:
    """Slurm's view of a launched deployment (for ``prorl status``).

    Returns None when the deployment was not launched with ``prorl launch``,
    else what was seen (``gone`` when none of its Slurm jobs is left, printed as such).
    """
    found = slurm_view(app, deployment_dir)
    if found is None or found.rows is None or found.taken_down is not None:
        return found
    record, rows = found.record, found.rows
    view = SlurmView(record, rows)
    app.console.print(_slurm_table(record, rows, view.local_broker_down()))
    _print_ended(app, record, rows)
    if not view.gone and not record.stopping and view.broker_ended() is None:
        # Being taken down, or its broker gone: scaling is not the way back then (the lines below say what is).
        _print_not_replaced(app, record, rows)
    if view.gone:
        app.console.print(
            f"[bold yellow]deployment {record.deployment}: all its Slurm jobs are gone[/] "
            f"(none of {', '.join(record.job_ids)} is in squeue); "
            f"`{escape(command_hint(app, 'down', deployment=record.deployment, home=record.home))}` cleans up, "
            f"`{escape(command_hint(app, 'launch', record.deploy_file, deployment=record.deployment, home=record.home))}` "
            "starts it again"
        )
    return view


def _print_ended(app: App, record: LaunchRecord, rows: list[SlurmTask]) -> None:
    """For each task that ended on its own (failed, out of memory, node failure, time limit): why, and its log's end."""
    from prorl_cli.exceptions import ProrlError
    from prorl_cli.slurm import squeue
    from prorl_cli.slurm.record import load_launched, log_tail
    from prorl_cli.slurm.supervisor import Supervision, replacement_due_at

    by_id = {t.job_id: t for t in rows}
    # This launch's replacements only: an earlier launch's state (history/) is never read.
    sup = Supervision.load(Path(record.home) / record.deployment, record.launch_id)
    for name, named in sorted(sup.names.items()):
        for old in named.history:
            app.console.print(f"{name}: replaced its Slurm job {old['job_id']}, which ended {old['ended']}")
    cfg: DeployConfig | None = None
    for m in record.members:
        t = by_id.get(m.job_id)
        state = sup.names.get(m.peer_id)
        if t is not None and t.state in squeue.UNASKED_END_STATES:
            ended = squeue.ended(t).describe()
        elif t is None and state is not None and state.failure is not None and state.failure.job_id == m.job_id:
            ended = state.failure.ended  # aged out of squeue: the supervisor's words for how it ended
        else:
            continue
        if cfg is None:
            with contextlib.suppress(ProrlError):
                _, cfg = load_launched(Path(record.home) / record.deployment)
        verdict = ""
        if state is not None and state.gave_up is not None and state.gave_up.get("job_id") == m.job_id:
            verdict = f"; [bold red]failed[/]: not replaced any more ({state.restarts} restart(s), max_restarts spent)"
        elif cfg is not None and state is not None and state.failure is not None and state.failure.job_id == m.job_id:
            opts = cfg.role(m.role)
            budget, backoff_s = opts.max_restarts, opts.restart_backoff_s  # type: ignore[attr-defined]
            due_in_s = max(0.0, replacement_due_at(state.restarts, state.failure.seen_at, backoff_s) - time.time())
            verdict = f"; replacement due in {due_in_s:.0f} s (restart {state.restarts + 1} of {budget})"
        app.console.print(f"[red]{m.peer_id}[/] (Slurm job {m.job_id}) ended {ended}{verdict}")
        if cfg is None:
            continue
        tail = log_tail(cfg, m, lines=8)
        if tail:
            app.console.print("  last lines of its log:\n" + "\n".join(f"    {line}" for line in tail.splitlines()))


def _print_not_replaced(app: App, record: LaunchRecord, rows: list[SlurmTask]) -> None:
    """Under the table, per role: its tasks that ended and that nothing will replace, and how to get the count back.

    The supervisor leaves alone a task that was asked to end (a ``scancel``: CANCELLED; a clean exit: COMPLETED;
    one that aged out of squeue and whose log says so, kept as ``left_alone``), and nothing replaces any task of a
    broker ``here`` (no supervisor runs then). Ends the supervisor will act on, or gave up on, are said by
    :func:`_print_ended` instead.
    """
    from prorl_cli.slurm import squeue
    from prorl_cli.slurm.supervisor import Supervision

    by_id = {t.job_id: t for t in rows}
    sup = Supervision.load(Path(record.home) / record.deployment, record.launch_id)
    unsupervised = record.broker_where == "here"
    for role, flag in (("nodes", "--nodes"), ("inference", "--inference")):
        left: list[str] = []
        for m in record.of(role):
            t = by_id.get(m.job_id)
            state = sup.names.get(m.peer_id)
            if t is not None and t.active:
                continue
            if state is not None and ((state.failure is not None and state.failure.job_id == m.job_id)
                                      or (state.gave_up is not None and state.gave_up.get("job_id") == m.job_id)):
                continue  # a replacement is due, or the restarts are spent: _print_ended says which
            if t is None:
                # Aged out of squeue: left alone once the supervisor read its log (until then it may still be judged
                # an end it was not asked for, and replaced).
                if unsupervised or (state is not None and state.left_alone == m.job_id):
                    left.append(f"{m.peer_id} (Slurm job {m.job_id}, gone from squeue)")
            elif unsupervised or t.state not in squeue.UNASKED_END_STATES:
                left.append(f"{m.peer_id} (Slurm job {m.job_id}, {t.state})")
        if not left:
            continue
        why = ("with broker.where: here no supervisor replaces a task" if unsupervised else
               "a task asked to end (a scancel, a clean exit) is left alone by the supervisor")
        hint = command_hint(app, "scale", flag, str(len(record.of(role))), deployment=record.deployment, home=record.home)
        app.console.print(f"[yellow]{role}: {', '.join(left)} ended and will not be replaced[/] ({why}); "
                          f"`{escape(hint)}` restores the count", soft_wrap=True, highlight=False)


def _slurm_table(record: LaunchRecord, rows: list[SlurmTask], local_broker_down: bool = False) -> Table:
    from rich.table import Table

    by_id = {t.job_id: t for t in rows}
    table = Table(title="Slurm", title_justify="left")
    for col in ("role", "task", "slurm job", "state", "reason / node", "elapsed", "left"):
        table.add_column(col, overflow="fold")
    if record.broker_where == "here":  # no Slurm job: its process on the launching machine
        state = "not running" if local_broker_down else "here"
        table.add_row("broker", "broker", f"pid {record.broker_pid}", state, record.broker_host, "", "")
    for m in record.members:
        t = by_id.get(m.job_id)
        reason = (t.pending_reason or (t.reason if not t.active and t.reason not in ("", "None") else t.nodes)) if t else ""
        table.add_row(m.role, m.peer_id, m.job_id, t.state if t else "gone (aged out of squeue)",
                      reason, t.elapsed if t else "", t.time_left if t and t.active else "")
    return table


@click.command()
@click.argument("deploy_file", type=click.Path(dir_okay=False))
@deployment_option
@click.option("--wait-s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Give up (and cancel what was submitted, unless --keep) when not all registered by then; "
                   "0 waits as long as it takes: tasks pending on a busy cluster are never cancelled on a timer.")
@click.option("--keep", is_flag=True, help="On failure, timeout, Ctrl-C, SIGTERM or SIGHUP, leave what was submitted queued.")
@click.option("--no-wait", is_flag=True, help="Submit and return at once.")
@click.option("--dry-run", is_flag=True, help="Print the sbatch scripts and Slurm requests of every role; submit nothing.")
@pass_app
def launch(app: App, deploy_file: str, wait_s: float, keep: bool, no_wait: bool, dry_run: bool) -> None:
    """Submit a deployment to Slurm and watch it come up.

    \b
    Submits the broker (its own job, or `broker.where: here`), the node
    array and the inference array from DEPLOY_FILE (see examples/deploy.yaml),
    records every Slurm job id in $PRORL_HOME/<deployment>/launch.json and
    shows Slurm's state beside the broker's until every task registered.
    Exits 0 then. A task that ends, or a pending reason waiting cannot cure,
    fails the launch at once; --wait-s N also gives up after N s. A failed
    launch, or Ctrl-C while it waits, cancels what it submitted unless --keep;
    so do SIGTERM and SIGHUP (a kill, a closed terminal, a dropped ssh
    session), unless ignored (nohup): exit 143 and 129 instead of 130.
    """
    from prorl_cli.exceptions import ConfigError, SlurmError
    from prorl_cli.slurm import launcher
    from prorl_cli.slurm.options import node_start_check, sandbox_runtime

    cfg = _load_deploy(app, deploy_file, named_deployment(app))
    try:
        refused, node_warnings = node_start_check(cfg)
    except ConfigError as e:
        app.abort(f"config error: {e}")
    for warning in [*launcher.path_warnings(cfg), *node_warnings]:
        app.err_console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True, highlight=False)
    why = f"the node tasks would refuse to start: {'; '.join(refused)}" if refused else None
    if dry_run:
        _print_plan(app, cfg, why)
        return
    if why is not None:
        app.abort(f"{why}; nothing submitted")
    _require_slurm(app)
    runtime = sandbox_runtime(cfg)
    if runtime == "local":
        app.err_console.print("[yellow]warning:[/] the nodes' sandbox runtime is local: sandboxes run WITHOUT isolation")
    elif runtime == "auto":
        app.err_console.print("[yellow]note:[/] sandbox runtime auto: a node where neither Apptainer nor bubblewrap works "
                              "falls back to local, without isolation (prorl status shows each node's); "
                              "set sandbox.runtime: apptainer in prorl.yaml to refuse that")
    try:
        record = launcher.launch(cfg)
    except SlurmError as e:
        app.abort(f"launch of {cfg.deployment!r} failed: {e}")
    app.err_console.print(
        f"submitted {cfg.deployment}: {', '.join(f'{m.role}[{m.index}]={m.job_id}' for m in record.members) or '-'}"
        f"{f'; broker here, pid {record.broker_pid}' if record.broker_where == 'here' else ''}"
    )
    if no_wait:
        return
    # SIGTERM or SIGHUP (an ssh session that drops, a terminal closed, a kill, a batch system's stop) as Ctrl-C:
    # every submitted job must not be left queued with nobody watching.
    stop = InterruptSignals()
    try:
        with stop:
            failure = _watch(app, cfg, record, wait_s)
    except BaseException as e:
        # A closed terminal can make the live view's last frame fail (EIO, a broken pipe) as the signal unwinds
        # it: after SIGTERM or SIGHUP that is the same interruption, and what was submitted must still go.
        if not isinstance(e, KeyboardInterrupt) and stop.signum is None:
            raise
        _interrupted(app, cfg, record, keep, stop)
    if not app.err_console.is_terminal:
        app.err_console.line()  # the live view's last frame ends without a newline when not on a terminal
    if failure is None:
        # With --home always: the commands are for any shell (the trainer's), whatever its PRORL_HOME.
        def hint(command: str, *args: str) -> str:
            return escape(command_hint(app, command, *args, deployment=cfg.deployment, home=cfg.home_path))

        app.console.print(
            f"[bold green]{escape(cfg.deployment)} is up[/]: every node and backend registered.\n"
            f"  submit:  {hint('submit', '--task', 'TASK', 'instances.jsonl', '--out', 'results.jsonl')}\n"
            f"  status:  {hint('status')}\n"
            f"  logs:    {hint('logs', 'nodes[0]')}\n"
            f"  down:    {hint('down')}",
            markup=True, highlight=False, soft_wrap=True,
        )
        return
    if failure.log_tail:  # the task's own words, on their own lines: the last of them usually names the cause
        app.err_console.print(f"log tail of the task that ended:\n{failure.log_tail}", markup=False, highlight=False,
                              soft_wrap=True)
    app.abort(f"{failure.reason} {_give_up(app, cfg, record, keep)}")


def _interrupted(app: App, cfg: DeployConfig, record: LaunchRecord, keep: bool, stop: InterruptSignals) -> NoReturn:
    """Ctrl-C, SIGTERM or SIGHUP while ``launch`` waits: give up on the launch as a failure does (what it submitted
    goes, unless --keep), then say so and exit 128 + the signal."""
    how, code = ("interrupted", 130) if stop.signum is None else interruption(Terminated(stop.signum))
    try:
        outcome = _give_up(app, cfg, record, keep)  # first: after a hangup nobody may read what is printed
    finally:
        stop.restore()
    # The terminal may be gone (SIGHUP): writing to it fails, and the exit code is all that is left to tell.
    with contextlib.suppress(OSError):
        app.err_console.line()
    try:
        app.abort(f"{how}: {outcome}", code=code)
    except OSError:
        raise click.exceptions.Exit(code) from None


def _give_up(app: App, cfg: DeployConfig, record: LaunchRecord, keep: bool) -> str:
    """Cancel what a launch that will not come up submitted (unless ``keep``); say what is left."""
    from prorl_cli.slurm import launcher

    if keep:
        return f"Left queued (--keep); `{command_hint(app, 'down', deployment=cfg.deployment, home=cfg.home_path)}` removes it."
    left = launcher.abandon(cfg, record)
    return "Cancelled what was submitted" + (f"; still in squeue: {[t.job_id for t in left]}" if left else
                                             "; nothing left queued.")


def _print_plan(app: App, cfg: DeployConfig, refused: str | None = None) -> None:
    """``launch --dry-run``: each role's Slurm request and batch script, as launch would submit them; ``refused``:
    why launch would refuse, known before Slurm is asked."""
    from prorl_cli.config import ENV_LOG_LEVEL
    from prorl_cli.exceptions import SlurmError
    from prorl_cli.slurm import launcher

    try:
        planned = launcher.plan(cfg)
    except RuntimeError as e:  # submitit refuses to render without Slurm's commands
        app.abort(f"--dry-run needs Slurm's commands on this machine: {e}")
    try:
        launcher.check_partitions(cfg)  # what launch refuses, the dry run says it would
    except SlurmError as e:
        refused = "; ".join(filter(None, (refused, str(e).replace("; nothing submitted", ""))))
    out = app.console
    out.print(f"# deployment {cfg.deployment}: PRORL_HOME {cfg.home_path}, Slurm logs in {cfg.log_path}", soft_wrap=True)
    level = os.environ.get(ENV_LOG_LEVEL)
    out.print(f"# the roles read prorl.yaml {cfg.config or '(none: the defaults)'}"
              f"{f', log level {level} (${ENV_LOG_LEVEL})' if level else ''}", soft_wrap=True, markup=False)
    if cfg.broker.where == "here":
        out.print(f"# broker: a process on this machine: {shlex.join(launcher.local_broker_command(cfg))}", soft_wrap=True)
    for p in planned:
        what = "one job" if p.role == "broker" else f"a job array of {p.count} task(s)"
        request = " ".join(f"--{k}" if v is True else f"--{k}={v}" for k, v in p.sbatch.items())
        out.print(f"\n# {p.role}: {what}; Slurm request: sbatch {request}", soft_wrap=True, markup=False)
        click.echo(p.script.rstrip("\n"))
    out.print("\n# dry run: nothing submitted")
    if refused is not None:
        app.abort(f"the launch would be refused: {refused}")


def _watch(app: App, cfg: DeployConfig, record: LaunchRecord, wait_s: float) -> LaunchFailure | None:
    """Live view until all registered; the failure reason otherwise (``wait_s`` 0: no time limit)."""
    from rich.live import Live

    from prorl_cli.slurm import launcher, squeue
    from prorl_cli.slurm.record import log_tail

    deadline = time.monotonic() + wait_s if wait_s > 0 else None  # 0: no timer
    wanted = {m.peer_id for m in record.members if m.role != "broker"}
    client = None
    with Live(console=app.err_console, refresh_per_second=2, transient=False) as live:
        try:
            while True:
                rows = squeue.query(record.job_ids, all_states=True)
                if client is None:
                    client = launcher.broker_client(cfg)
                report = launcher.broker_status(client)
                live.update(_member_table(cfg, record, rows, report))
                seen = launcher.registered_ids(report)
                if report is not None and wanted <= seen:
                    return None
                by_id = {t.job_id: t for t in rows}
                for m in record.members:
                    t = by_id.get(m.job_id)
                    if t is None:
                        continue
                    if not t.active and (m.role == "broker" or m.peer_id not in seen):
                        return LaunchFailure(f"{m.role} task {m.peer_id} (Slurm job {m.job_id}) ended {t.state}.",
                                             log_tail(cfg, m))
                    if t.pending_reason and t.pending_reason.startswith(HOPELESS_REASONS):
                        return LaunchFailure(f"{m.role} task {m.peer_id} (Slurm job {m.job_id}) cannot start: "
                                             f"squeue says {t.pending_reason}.")
                if deadline is not None and time.monotonic() >= deadline:
                    waiting = sorted(wanted - seen)
                    reasons = {m.peer_id: (by_id[m.job_id].pending_reason or by_id[m.job_id].state)
                               for m in record.members if m.job_id in by_id and m.peer_id in waiting}
                    return LaunchFailure(f"not all registered after {wait_s:.0f} s; waiting for {waiting} ({reasons}).")
                time.sleep(1.0)
        finally:
            if client is not None:
                client.close()


@click.command()
@click.argument("name", metavar="[NAME]", required=False)
@deployment_option
@click.option("--nodes", type=click.IntRange(min=0), help="Node array tasks wanted.")
@click.option("--inference", type=click.IntRange(min=0), help="Inference array tasks wanted.")
@click.option("--drain-wait-s", type=click.FloatRange(min=0, min_open=True),
              help="Shrinking: how long a drained node may take to leave before it gets SIGTERM "
                   "(default: the nodes' drain grace + 60 s).")
@pass_app
def scale(app: App, name: str | None, nodes: int | None, inference: int | None, drain_wait_s: float | None) -> None:
    """Grow or shrink a launched deployment's arrays (shrinking drains the removed tasks).

    \b
    NAME is the deployment name (the same as -d NAME) or its deploy.yaml.
    Growing submits new array tasks under new names (node-4 after node-3).
    Shrinking chooses, in this order: tasks still pending in squeue, then
    starting (running, not registered) and idle ones, then the serving ones
    with the fewest running jobs (load from the broker's status; ties: the
    highest index). A running node is drained as on the time-limit warning,
    without the requeue: it hands back the jobs it has not started, lets
    running ones finish (node.drain_grace_s) and delivers them, then exits.
    Pending and starting tasks and bridges get SIGTERM.
    """
    from prorl_cli.exceptions import SlurmError
    from prorl_cli.slurm import launcher

    if (nodes is None) == (inference is None):
        app.abort("give exactly one of --nodes N or --inference M")
    cfg = _deploy_for(app, name, "scale")
    _require_slurm(app)
    role, count = ("nodes", nodes) if nodes is not None else ("inference", inference)
    assert count is not None
    try:
        result = launcher.scale(cfg, role, count, drain_wait_s=drain_wait_s)
    except SlurmError as e:
        app.abort(str(e))
    for m in result.added:
        app.console.print(f"added {m.peer_id}: Slurm job {m.job_id}")
    for r in result.removed:
        how = "drained and removed" if r.how == "drain" else "removed"
        app.console.print(f"{how} {r.member.peer_id} ({r.describe()}): Slurm job {r.member.job_id}")
    counts = launcher.role_counts(cfg, role)
    if not result.added and not result.removed:
        app.console.print(f"{role} already at {count}: {counts.describe()}")
    else:
        app.console.print(f"{role} now: {counts.describe()}")


@click.command()
@click.argument("name", metavar="[NAME]", required=False)
@deployment_option
@click.option("--wait-s", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="How long to wait for squeue to empty.")
@pass_app
def down(app: App, name: str | None, wait_s: float) -> None:
    """Take a launched deployment down: broker stop, nodes drain, scancel the rest, rendezvous removed.

    NAME is the deployment name (the same as -d NAME) or its deploy.yaml. Exits
    non-zero if any of its jobs is still in squeue after --wait-s; a deployment
    already taken down is said so, exit 0 (cleanup scripts may run it twice).
    """
    from prorl_cli.exceptions import SlurmError
    from prorl_cli.slurm import launcher

    record, cfg = _launched_for_down(app, name)
    _require_slurm(app)
    try:
        report = launcher.down(cfg, wait_s=wait_s, record=record)
    except SlurmError as e:
        app.abort(str(e))
    app.console.print(f"broker stop: {'done' if report.broker_stopped else 'broker not reachable'}")
    lost = report.cancelled_jobs
    if lost:
        # Work the stop ended: said, so whoever submitted with --detach knows `results` will not bring it back.
        states = ", ".join(f"{state} {n}" for state, n in sorted(lost.items()))
        app.console.print(f"[yellow]the broker cancelled {sum(lost.values())} unfinished job(s)[/] ({states}): "
                          "their results will not come; finished ones are no longer served either",
                          soft_wrap=True, highlight=False)
    if report.cancelled:
        app.console.print(f"scancel: {', '.join(report.cancelled)}")
    if report.left:
        app.abort(f"still in squeue after {wait_s:.0f} s: {', '.join(f'{t.job_id} {t.state}' for t in report.left)}")
    app.console.print(f"[bold]{cfg.deployment} is down[/]: nothing of it in squeue; rendezvous file removed")
    if report.journal_kept is not None:
        # The broker was not there to cancel its jobs: say what it held, where it went, and how to run it again.
        from prorl_cli.slurm.launcher import FINISHED_STATES

        counts = report.journal_jobs
        unfinished = sum(n for state, n in counts.items() if state not in FINISHED_STATES)
        finished = sum(n for state, n in counts.items() if state in FINISHED_STATES)
        live = cfg.deployment_dir / report.journal_kept.name
        again = command_hint(app, "launch", str(cfg.source), deployment=cfg.deployment, home=str(cfg.home_path))
        app.console.print(
            f"[yellow]the broker did not take the stop: its journal ({unfinished} job(s) accepted and not finished, "
            f"{finished} finished) is kept in {escape(str(report.journal_kept))}[/]; the next launch starts without "
            f"it. To run them again (and serve the finished ones' results): `cp "
            f"{escape(shlex.quote(str(report.journal_kept)))} {escape(shlex.quote(str(live)))}` before "
            f"`{escape(again)}`", soft_wrap=True, highlight=False)


@click.command("render-sbatch")
@click.argument("deploy_file", type=click.Path(dir_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the scripts.")
@deployment_option
@pass_app
def render_sbatch(app: App, deploy_file: str, out_dir: str) -> None:
    """Render sbatch scripts (broker, node array, inference array, all-in-one) from a deploy.yaml.

    \b
    Submit them with plain sbatch, the broker first:
      sbatch DIR/broker.sbatch; sbatch DIR/node.sbatch; sbatch DIR/inference.sbatch
    or one allocation with everything: sbatch DIR/all-in-one.sbatch
    """
    from prorl_cli.slurm.render import render_all

    cfg = _load_deploy(app, deploy_file, named_deployment(app))
    for path in render_all(cfg, Path(out_dir)):
        app.console.print(str(path))
