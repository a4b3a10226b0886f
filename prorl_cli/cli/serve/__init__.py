"""``prorl serve``: the long-running servers."""

from __future__ import annotations

import click

from prorl_cli.cli.serve.inference import serve_inference


@click.group()
def serve() -> None:
    """Run a broker, a node server or an inference bridge in the foreground."""


serve.add_command(serve_inference)
