"""``prorl config``: the effective configuration."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.naming import deployment_option

if TYPE_CHECKING:
    from prorl_cli.config import ProrlConfig


@click.group()
def config() -> None:
    """Show or check the effective configuration (defaults < prorl.yaml < env < flags)."""


@config.command("show")
@deployment_option
@click.option("--deploy", "deploy_file", type=click.Path(dir_okay=False, exists=True),
              help="Also the effective values of this deploy.yaml (default: ./deploy.yaml, else the one the "
                   "deployment was launched from).")
@pass_app
def config_show(app: App, deploy_file: str | None) -> None:
    """Print the effective configuration as YAML: prorl.yaml, then deploy.yaml when there is one.

    deploy.yaml's values are shown as the roles get them: defaults, resolved
    paths, and the broker address and sandbox runtime it leaves to prorl.yaml.
    """
    from prorl_cli.config import dump_config, find_config_file

    cfg = app.config
    source = find_config_file(app.config_path)
    click.echo(f"# prorl.yaml: from {source or 'defaults'}")
    click.echo(dump_config(cfg), nl=False)
    deploy = deploy_file or _default_deploy_file(cfg.deployment_dir)
    if deploy is None:
        return
    import yaml

    from prorl_cli.cli.naming import named_deployment
    from prorl_cli.exceptions import ConfigError
    from prorl_cli.slurm.deploy import load_deploy
    from prorl_cli.slurm.options import effective_deploy

    try:
        effective = effective_deploy(load_deploy(deploy, deployment=named_deployment(app)))
    except ConfigError as e:
        app.abort(f"config error: {e}")
    click.echo(f"---\n# deploy.yaml: from {deploy} (as the roles get it; unset keys from prorl.yaml and the defaults)")
    click.echo(yaml.safe_dump(effective, sort_keys=False), nl=False)


def _default_deploy_file(deployment_dir: Path) -> str | None:
    """./deploy.yaml, else the deploy file the deployment was launched from (its launch.json says)."""
    from prorl_cli.exceptions import SlurmError
    from prorl_cli.slurm.record import LaunchRecord

    if Path("deploy.yaml").is_file():
        return "deploy.yaml"
    try:
        record = LaunchRecord.load(deployment_dir)
    except SlurmError:
        return None
    return record.deploy_file if record is not None and Path(record.deploy_file).is_file() else None


@config.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def config_check(file: str) -> None:
    """Validate FILE, a prorl.yaml or a deploy.yaml; exit non-zero with the offending key named.

    A prorl.yaml gets the checks `prorl serve node` makes at start too: its
    handlers load, and their settings under handlers.<task> are known keys
    of valid types. A deploy.yaml (told by its keys, nested ones included:
    nodes, setup, python, broker.where, inference.count...; on a tie, a
    prorl.yaml; an error says which it was taken for) gets the checks of
    `prorl launch --dry-run`, the prorl.yaml it names (config:) included,
    without Slurm: `prorl launch FILE --dry-run` also shows what it would
    submit.
    """
    from prorl_cli.config import load_config
    from prorl_cli.exceptions import ConfigError, one_line
    from prorl_cli.slurm.deploy import FileKind, file_kind, read_deploy_data

    kind: FileKind | None
    try:
        kind = file_kind(read_deploy_data(file))
    except ConfigError:
        kind = None  # missing, unreadable or not YAML: load_config below says so, as for any prorl.yaml
    is_deploy = kind is not None and kind.deploy

    def taken_for() -> None:
        # The two files share sections (broker, inference): an error about a key is only understood knowing
        # which of the two schemas the file was held against.
        if kind is not None:
            click.echo(f"note: {file} was checked as {kind.describe()}", err=True)

    try:
        if is_deploy:
            warnings = _check_deploy(file)
        else:
            errors = _node_start_errors(load_config(file))
            if errors:
                taken_for()
                for error in errors:
                    click.echo(f"error: {one_line(error)}", err=True)
                raise click.exceptions.Exit(1)
            warnings = []
    except ConfigError as e:
        taken_for()
        click.echo(f"error: {one_line(str(e))}", err=True)
        raise click.exceptions.Exit(1) from e
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    if is_deploy:
        click.echo(f"{file}: ok (a deploy file; `prorl launch {file} --dry-run` shows what it would submit)")
    else:
        click.echo(f"{file}: ok")


def _node_start_errors(cfg: ProrlConfig) -> list[str]:
    """Why ``prorl serve node`` would refuse to start with ``cfg`` here: the node's own check
    (:meth:`~prorl_cli.node.registry.HandlerRegistry.start_errors`) of the handlers it would serve."""
    from prorl_cli.node.registry import discover

    return discover(cfg.node.handler_paths, cfg.node.tasks or None).start_errors(cfg)


def _check_deploy(file: str) -> list[str]:
    """What ``prorl launch`` checks of a deploy file before it needs Slurm: its keys, the prorl.yaml it names
    (read as the roles read it), the node tasks' start check (:func:`~prorl_cli.slurm.options.node_start_check`),
    and the paths this machine cannot see (warnings)."""
    from prorl_cli.exceptions import ConfigError
    from prorl_cli.slurm.deploy import load_deploy
    from prorl_cli.slurm.launcher import path_warnings
    from prorl_cli.slurm.options import effective_deploy, node_start_check

    cfg = load_deploy(file)
    effective_deploy(cfg)
    errors, warnings = node_start_check(cfg)
    if errors:
        raise ConfigError(f"the node tasks would refuse to start: {'; '.join(errors)}")
    return [*path_warnings(cfg), *warnings]
