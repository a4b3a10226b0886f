"""``prorl backends``: inference backends of a deployment (the paper's add/clear_llm_server)."""

from __future__ import annotations

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.jobs import connect, print_backends
from prorl_cli.cli.naming import deployment_option

_address = click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")


@click.group()
@deployment_option
def backends() -> None:
    """Register, clear, list, pause and resume inference backends."""


@backends.command("add")
@click.argument("url")
@click.option("--model", metavar="NAME", help="Model name the server serves (default: ask the server).")
@_address
@deployment_option
@pass_app
def backends_add(app: App, url: str, model: str | None, address: str | None) -> None:
    """Route jobs to the OpenAI-compatible server at URL (e.g. http://host:8000/v1)."""
    from prorl_cli.exceptions import RemoteError

    with connect(app, address) as client:
        try:
            b = client.add_backend(url, model)
        except RemoteError as e:
            app.abort(str(e))
    app.console.print(f"added {b.backend_id}")


@backends.command("clear")
@click.argument("url", required=False)
@_address
@deployment_option
@pass_app
def backends_clear(app: App, url: str | None, address: str | None) -> None:
    """Stop routing new jobs to URL (or to every backend); jobs already using them finish."""
    from prorl_cli.exceptions import RemoteError

    with connect(app, address) as client:
        try:
            cleared = client.clear_backends(url)
        except RemoteError as e:
            app.abort(str(e))
    app.console.print(f"cleared {len(cleared)} backend(s): {', '.join(cleared) or '-'}")


@backends.command("list")
@_address
@deployment_option
@pass_app
def backends_list(app: App, address: str | None) -> None:
    """List backends with their in-flight requests and live jobs."""
    with connect(app, address) as client:
        print_backends(app, client.list_backends())


@backends.command("pause")
@_address
@deployment_option
@pass_app
def backends_pause(app: App, address: str | None) -> None:
    """Hold new generate calls at the broker (weight sync); in-flight ones drain."""
    with connect(app, address) as client:
        client.pause_generation()
    app.console.print("generation paused")


@backends.command("resume")
@_address
@deployment_option
@pass_app
def backends_resume(app: App, address: str | None) -> None:
    """Release held generate calls and route new ones again."""
    with connect(app, address) as client:
        client.resume_generation()
    app.console.print("generation resumed")
