"""``prorl logs ROLE[INDEX]``: a launched deployment's Slurm logs.

The logs are where ``prorl launch`` had submitit write them:
``<log_dir>/<role>/<slurm job>/<slurm job>_0_log.out`` (``log_dir`` defaults to
``$PRORL_HOME/<deployment>/slurm``; array tasks are ``<array>_<index>``), and
``<log_dir>/broker-here.log`` for ``broker.where: here``. The task list comes
from the deployment's launch record, so tasks added by ``prorl scale`` are found too,
and so is every Slurm job a task has had in this launch: one the supervisor
replaced, one ``scale`` took away (launch.json's ``retired``). A task's jobs are
its attempts, numbered from 1 in the order they ran.
"""

from __future__ import annotations

import codecs
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.naming import deployment_option, require_deployment

if TYPE_CHECKING:
    from prorl_cli.slurm.record import LaunchRecord

#: ROLE, ROLE[INDEX], ROLE-INDEX or ROLE:INDEX; node/nodes and backend/inference are the same role.
_MEMBER_RE = re.compile(r"^(?P<role>[a-z]+)(?:\[(?P<a>\d+)\]|[-:](?P<b>\d+))?$")
_ROLES = {"broker": "broker", "node": "nodes", "nodes": "nodes", "inference": "inference", "backend": "inference"}

#: How often ``-f`` looks for new lines (a log on a shared filesystem has no change notification to wait on).
FOLLOW_POLL_S = 0.5


def parse_member(text: str) -> tuple[str, int | None]:
    """``nodes[2]`` -> ("nodes", 2); ``broker`` -> ("broker", None). Raises click.BadParameter naming the forms."""
    m = _MEMBER_RE.match(text.strip().lower())
    role = _ROLES.get(m.group("role")) if m else None
    if m is None or role is None:
        raise click.BadParameter(f"{text!r}: expected broker, nodes[INDEX] or inference[INDEX] (e.g. nodes[0], node-0)")
    index = m.group("a") or m.group("b")
    return role, int(index) if index is not None else None


def job_notes(record: LaunchRecord) -> dict[str, str]:
    """What became of each Slurm job of the launch, by job id: replaced (and how it ended), scaled away, current
    (or the last, once the launch was taken down)."""
    from prorl_cli.slurm.record import HISTORY_NAME, LaunchRecord
    from prorl_cli.slurm.supervisor import Supervision

    deployment_dir = Path(record.home) / record.deployment
    sup = Supervision.load(deployment_dir, record.launch_id)
    if not sup.names:  # taken down: `down` moved the launch's supervision.json into its history folder
        sup = Supervision.load(deployment_dir / HISTORY_NAME / record.launch_id, record.launch_id)
    replaced = {old["job_id"]: old.get("ended", "") for named in sup.names.values() for old in named.history}
    live = LaunchRecord.load(deployment_dir)
    last = "current" if live is not None and live.launch_id == record.launch_id else "last; the launch ended"
    notes = {m.job_id: last for m in record.members}
    for m in record.retired:
        notes[m.job_id] = f"replaced; it ended {replaced[m.job_id]}" if m.job_id in replaced else "scaled away"
    return notes


@click.command()
@click.argument("member", metavar="ROLE[INDEX]")
@deployment_option
@click.option("-f", "--follow", is_flag=True, help="Keep printing lines as they are written (one task), until Ctrl-C; a log truncated or "
              "replaced is followed from its start again.")
@click.option("--lines", type=click.IntRange(min=0), default=0, help="Only the last N lines of each log (0: all).")
@click.option("--attempt", type=click.IntRange(min=1), metavar="N",
              help="The task's Nth Slurm job in this launch (1: the first; a task the supervisor replaced has "
                   "several); default: its latest.")
@click.option("--all", "every", is_flag=True, help="Every Slurm job the task (or role) has had in this launch, oldest first.")
@click.option("--list", "listing", is_flag=True, help="List the task's Slurm jobs (attempt, job, what became of it, log) "
              "instead of printing logs.")
@pass_app
def logs(app: App, member: str, follow: bool, lines: int, attempt: int | None, every: bool, listing: bool) -> None:
    """Print the Slurm log of a launched deployment's task: broker, nodes[INDEX], inference[INDEX].

    \b
    A task keeps its name across Slurm jobs: a replacement after a crash is
    nodes[1] again, and a task scaled away is still found by its name. By
    default its latest job's log; --attempt N its Nth job's, --all every
    job's (oldest first), --list the jobs themselves. Without INDEX, every
    live task of the role (with --all, every task it ever had). The
    deployment is -d NAME (or prorl -d NAME, or $PRORL_DEPLOYMENT).
    """
    from prorl_cli.exceptions import ProrlError
    from prorl_cli.slurm.record import LAUNCH_NAME, load_launched, log_files

    try:
        role, index = parse_member(member)
    except click.BadParameter as e:
        # `prorl logs NAME` is the one form the other commands take and logs does not: say how, not only "bad role".
        if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", member) and (app.config.home_path / member).is_dir():
            raise click.BadParameter(f"{member!r} is a deployment, and logs' argument is the task: "
                                     f"`prorl logs -d {member} ROLE[INDEX]` (broker, nodes[INDEX] or "
                                     "inference[INDEX])") from e
        raise
    if attempt is not None and (index is None and role != "broker"):
        app.abort("--attempt N needs one task: ROLE[INDEX]")
    if attempt is not None and every:
        app.abort("give --attempt N or --all, not both")
    # ROLE is logs' one positional argument: the deployment is named with -d only (never `prorl logs NAME`).
    name = require_deployment(app, "logs", positional=False, args=f" {member}")
    try:
        record, cfg = load_launched(app.config.home_path / name, or_last=True)
    except ProrlError as e:
        app.abort(str(e) + _not_on_slurm_hint(app.config.home_path, name))
    if not (app.config.home_path / name / LAUNCH_NAME).exists():
        app.err_console.print(f"deployment {name!r} was taken down: the logs of its last launch ({record.launch_id})")
    cfg.home = record.home
    notes = job_notes(record)
    files: list[tuple[str, Path | None]] = []
    if role == "broker" and record.broker_where == "here":
        files.append(("broker (here)", cfg.log_path / "broker-here.log"))
    if index is not None:
        indices = [index]
    else:  # the role's live tasks; with --all every task it ever had
        pool = [*record.retired, *record.members] if every else record.members
        indices = sorted({m.index for m in pool if m.role == role})
    for i in indices:
        jobs = record.jobs_of(role, i)
        if not jobs:
            continue
        label = role if role == "broker" else f"{role}[{i}]"
        if listing:
            for n, m in enumerate(jobs, 1):
                found = log_files(cfg, m)
                click.echo(f"{label} attempt {n}: Slurm job {m.job_id} ({notes.get(m.job_id, '?')}): "
                           f"{found[-1] if found else 'no log yet'}")
            continue
        if attempt is not None:
            if attempt > len(jobs):
                app.abort(f"{label} has had {len(jobs)} Slurm job(s) in this launch: "
                          + ", ".join(f"attempt {n} = {m.job_id}" for n, m in enumerate(jobs, 1)))
            chosen = [(attempt, jobs[attempt - 1])]
        elif every:
            chosen = list(enumerate(jobs, 1))
        else:
            chosen = [(len(jobs), jobs[-1])]
            if len(jobs) > 1:
                app.err_console.print(
                    f"{label} has had {len(jobs)} Slurm jobs in this launch: "
                    + ", ".join(f"attempt {n} = {m.job_id} ({notes.get(m.job_id, '?')})" for n, m in enumerate(jobs, 1))
                    + f"; showing attempt {len(jobs)} (--attempt N, --all)", soft_wrap=True)
        for n, m in chosen:
            what = f"{label} attempt {n} (Slurm job {m.job_id}, {notes.get(m.job_id, '?')})"
            files += [(what, f) for f in log_files(cfg, m)] or [(what, None)]
    if listing:
        if not any(record.jobs_of(role, i) for i in indices):
            _no_task(app, record, name, member)
        return
    if not files:
        _no_task(app, record, name, member)
    if follow and len(files) != 1:
        app.abort(f"-f follows one log; {member} has {len(files)}: give ROLE[INDEX] (and --attempt N)")
    for label, path in files:
        if path is None or not path.exists():
            app.err_console.print(f"==> {label}: no log yet (the task has not started)")
            continue
        if len(files) > 1 or every:
            app.err_console.print(f"==> {label}: {path}")
        size, inode = _print_log(path, lines)
        if follow:
            _follow(path, size, inode)


def _not_on_slurm_hint(home: Path, name: str) -> str:
    """Where the logs of a deployment that ``prorl launch`` never started are, for the error that says so; "" for a
    deployment that was launched (taken down, or its launch failed: the error says that already).

    Servers started otherwise log to their own stderr: ``prorl serve`` by hand wherever it was started, the servers
    of an embedded stack (``prorl quickstart``, ``LocalStack``) to ``$PRORL_HOME/logs/NAME.log``; and every job
    that logged has its own log on its node, whatever started the node.
    """
    from prorl_cli.slurm.record import ended_launches

    deployment_dir = home / name
    if not deployment_dir.is_dir():
        return f". No deployment {name!r} has run under {home} at all (its name, or PRORL_HOME / --home?)"
    if ended_launches(deployment_dir):
        return ""
    lines = ["`prorl logs` prints the Slurm logs of `prorl launch`; servers started otherwise log to their own "
             "stderr (`prorl serve ...`: where it was started)."]
    stack_logs = sorted((home / "logs").glob("*.log"))
    if stack_logs:
        lines.append(f"The servers of an embedded stack (quickstart, LocalStack) log in {home / 'logs'}: "
                     + ", ".join(p.name for p in stack_logs) + ".")
    job_logs = deployment_dir / "nodes"
    nodes = sorted(p.name for p in job_logs.iterdir() if (p / "jobs").is_dir()) if job_logs.is_dir() else []
    if nodes:
        lines.append(f"Each job's own log: {job_logs}/NODE/jobs/JOB/job.log (nodes here: {', '.join(nodes)}; "
                     "`prorl inspect RESULTS --job ID` names a job's).")
    else:
        lines.append(f"Each job that logged has its own log: {job_logs}/NODE/jobs/JOB/job.log.")
    return ". " + " ".join(lines)


def _no_task(app: App, record: LaunchRecord, name: str, member: str) -> NoReturn:
    have = sorted({f"{m.role}[{m.index}]" for m in [*record.members, *record.retired]}) or ["none"]
    app.abort(f"deployment {name!r} has no task {member}; its tasks in this launch: {', '.join(have)}")


#: Bytes read at a time: a log of a long run can be far larger than memory, so it is never read whole.
_BLOCK_BYTES = 1 << 20


def _utf8_decoder() -> codecs.IncrementalDecoder:
    """A decoder that keeps a character split between two blocks whole (bad bytes become U+FFFD)."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _print_log(path: Path, lines: int) -> tuple[int, int]:
    """Print ``path`` (only its last ``lines`` lines when ``lines`` > 0); return the size it had, where ``-f`` goes
    on, and the inode of the file read (``-f`` follows another file at ``path`` from its start).

    Reads block by block (the whole log) or backwards from its end until ``lines`` lines are in hand.
    """
    with path.open("rb") as f:
        inode = os.fstat(f.fileno()).st_ino
        size = f.seek(0, os.SEEK_END)
        if not lines:
            f.seek(0)
            decoder = _utf8_decoder()
            left = size
            while left > 0 and (block := f.read(min(_BLOCK_BYTES, left))):
                left -= len(block)
                click.echo(decoder.decode(block), nl=False)
            click.echo(decoder.decode(b"", final=True), nl=False)
            return size, inode
        # From the end back until more than ``lines`` newlines are in hand: the last ``lines`` lines then all
        # lie after the first of them, never in the partial line the tail starts with.
        tail, pos = b"", size
        while pos > 0 and tail.count(b"\n") <= lines:
            step = min(_BLOCK_BYTES, pos)
            pos -= step
            f.seek(pos)
            tail = f.read(step) + tail
    click.echo("".join(tail.decode(errors="replace").splitlines(keepends=True)[-lines:]), nl=False)
    return size, inode


def _follow(path: Path, offset: int, inode: int) -> None:
    """Print what is appended to ``path`` from ``offset`` on, until Ctrl-C (a requeued task appends to the same log).

    A log cut shorter than what was read (truncated), or another file than ``inode`` now at ``path`` (rotated,
    rewritten), is followed from its start again, as ``tail -F`` does, and stderr says so: from the old offset
    on, nothing new would ever show.
    """
    decoder = _utf8_decoder()
    try:
        while True:
            try:
                f = path.open("rb")
            except FileNotFoundError:  # between a rotation's rename and the new file: wait for it
                time.sleep(FOLLOW_POLL_S)
                continue
            with f:
                st = os.fstat(f.fileno())
                if st.st_ino != inode or st.st_size < offset:
                    what = "was replaced" if st.st_ino != inode else "was truncated"
                    click.echo(f"==> {path} {what}: following it from its start", err=True)
                    inode, offset, decoder = st.st_ino, 0, _utf8_decoder()
                f.seek(offset)
                chunk = f.read(_BLOCK_BYTES)
            if chunk:
                offset += len(chunk)
                click.echo(decoder.decode(chunk), nl=False)
                continue  # more may be there already: read on before waiting
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return

