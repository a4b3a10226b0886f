"""``prorl config``: the effective configuration."""

from __future__ import annotations

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.naming import deployment_option


@click.group()
def config() -> None:
    """Show or check the effective configuration (defaults < prorl.yaml < env < flags)."""


@config.command("show")
@deployment_option
@pass_app
def config_show(app: App) -> None:
    """Print the effective configuration as YAML."""
    from prorl_cli.config import dump_config, find_config_file

    cfg = app.config
    source = find_config_file(app.config_path)
    click.echo(f"# from {source or 'defaults'}")
    click.echo(dump_config(cfg), nl=False)


@config.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def config_check(file: str) -> None:
    """Validate FILE; exit non-zero with the offending key named."""
    from prorl_cli.config import load_config
    from prorl_cli.exceptions import ConfigError

    try:
        load_config(file)
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        raise click.exceptions.Exit(1) from e
    click.echo(f"{file}: ok")
