"""``prorl serve inference`` (the inference issue fills this in)."""

from __future__ import annotations

import click

from prorl_cli.cli.application import not_implemented


@click.command("inference", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve_inference(args: tuple[str, ...]) -> None:
    """Start (or attach to) vLLM and bridge it to the broker (not implemented yet)."""
    not_implemented("serve inference", "issue: inference nodes")
