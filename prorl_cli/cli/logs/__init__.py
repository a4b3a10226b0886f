"""``prorl logs ROLE[INDEX]``: a launched deployment's Slurm logs.

The logs are where ``prorl launch`` had submitit write them:
``<log_dir>/<role>/<slurm job>/<slurm job>_0_log.out`` (``log_dir`` defaults to
``$PRORL_HOME/<deployment>/slurm``; array tasks are ``<array>_<index>``), and
``<log_dir>/broker-here.log`` for ``broker.where: here``. The task list comes
from the deployment's launch record, so tasks added by ``prorl scale`` are found too.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.naming import deployment_option, require_deployment

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


@click.command()
@click.argument("member", metavar="ROLE[INDEX]")
@deployment_option
@click.option("-f", "--follow", is_flag=True, help="Keep printing lines as they are written (one task), until Ctrl-C.")
@click.option("--lines", type=click.IntRange(min=0), default=0, help="Only the last N lines of each log (0: all).")
@pass_app
def logs(app: App, member: str, follow: bool, lines: int) -> None:
    """Print the Slurm log of a launched deployment's task: broker, nodes[INDEX], inference[INDEX].

    \b
    Without INDEX, every task of the role, one after the other. The deployment
    is -d NAME (or prorl -d NAME, or $PRORL_DEPLOYMENT).
    """
    from prorl_cli.exceptions import ProrlError
    from prorl_cli.slurm.launcher import load_launched, log_files

    role, index = parse_member(member)
    name = require_deployment(app, "logs")
    try:
        record, cfg = load_launched(app.config.home_path / name)
    except ProrlError as e:
        app.abort(str(e))
    cfg.home = record.home
    files: list[tuple[str, Path | None]] = []
    if role == "broker" and record.broker_where == "here":
        files.append(("broker (here)", cfg.log_path / "broker-here.log"))
    for m in record.of(role):
        if index is None or m.index == index:
            found = log_files(cfg, m)
            files += [(f"{m.role}[{m.index}] (Slurm job {m.job_id})", f) for f in found] or [
                (f"{m.role}[{m.index}] (Slurm job {m.job_id})", None)]
    if not files:
        have = ", ".join(f"{m.role}[{m.index}]" for m in record.members) or "none"
        app.abort(f"deployment {name!r} has no task {member}; its tasks: {have}")
    if follow and len(files) != 1:
        app.abort(f"-f follows one log; {member} has {len(files)}: give ROLE[INDEX]")
    for label, path in files:
        if path is None or not path.exists():
            app.err_console.print(f"==> {label}: no log yet (the task has not started)")
            continue
        if len(files) > 1:
            app.err_console.print(f"==> {label}: {path}")
        data = path.read_bytes()
        text = data.decode(errors="replace")
        shown = text.splitlines(keepends=True)[-lines:] if lines else [text]
        click.echo("".join(shown), nl=False)
        if follow:
            _follow(path, len(data))


def _follow(path: Path, offset: int) -> None:
    """Print what is appended to ``path`` from ``offset`` on, until Ctrl-C (a requeued task appends to the same log)."""
    try:
        while True:
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            if chunk:
                offset += len(chunk)
                click.echo(chunk.decode(errors="replace"), nl=False)
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return
