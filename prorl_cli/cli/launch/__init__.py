"""``prorl launch`` / ``prorl down``: Slurm arrays through submitit (not built yet)."""

from __future__ import annotations

import click

from prorl_cli.cli.application import not_implemented


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch(args: tuple[str, ...]) -> None:
    """Submit node and inference servers as Slurm arrays (not implemented yet)."""
    not_implemented("launch", "Slurm launch through submitit is a later milestone")


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def down(args: tuple[str, ...]) -> None:
    """Cancel a launched deployment's Slurm jobs (not implemented yet)."""
    not_implemented("down", "Slurm launch through submitit is a later milestone")
