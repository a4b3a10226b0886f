"""``prorl backends``: inference backends of a deployment (the paper's add/clear_llm_server)."""

from __future__ import annotations

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.common import command_hint, connect
from prorl_cli.cli.jobs import print_backends
from prorl_cli.cli.naming import deployment_option

_address = click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: the deployment's rendezvous file).")


@click.group()
@deployment_option
def backends() -> None:
    """Register, clear, list, pause, resume and reload inference backends."""


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
    silent = _unanswered(url)
    if silent is not None:
        # Added all the same: the nodes call it, and they may reach what this machine cannot.
        app.err_console.print(f"warning: {url} does not answer from here ({silent}); calls routed to it fail "
                              f"their jobs unless the nodes reach it: "
                              f"`{command_hint(app, 'backends clear', url, address=address)}` takes it out",
                              markup=False, soft_wrap=True)


#: How long `backends add` waits for the server's model list.
PROBE_TIMEOUT_S = 5.0


def _unanswered(url: str) -> str | None:
    """Why the OpenAI-compatible server at ``url`` does not list its models (``GET /models``), or None."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/models", timeout=PROBE_TIMEOUT_S):
            return None
    except urllib.error.HTTPError as e:
        return None if e.code in (401, 403) else f"HTTP {e.code}"  # a key it wants is the nodes' business
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e))


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


_version = click.option("--policy-version", type=click.IntRange(min=0), metavar="N",
                        help="The trainer's weights version from now on (stamped on every generate reply).")


@backends.command("pause")
@_version
@click.option("--wait", is_flag=True, help="Return only once no generate call is in flight on any backend.")
@click.option("--timeout-s", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="With --wait: give up after this long, naming the calls still running (generation stays paused).")
@_address
@deployment_option
@pass_app
def backends_pause(app: App, policy_version: int | None, wait: bool, timeout_s: float, address: str | None) -> None:
    """Hold new generate calls at the broker (weight sync); in-flight ones drain.

    Held calls do not count against their jobs' timeouts.
    """
    from prorl_cli.exceptions import DrainTimeout

    with connect(app, address) as client:
        try:
            client.pause_generation(policy_version, wait=wait, timeout_s=timeout_s)
        except DrainTimeout as e:
            app.abort(str(e))
    app.console.print("generation paused" + (", no call in flight" if wait else ""))


@backends.command("resume")
@_version
@_address
@deployment_option
@pass_app
def backends_resume(app: App, policy_version: int | None, address: str | None) -> None:
    """Release held generate calls and route new ones again."""
    with connect(app, address) as client:
        client.resume_generation(policy_version)
    app.console.print("generation resumed")


@backends.command("reload")
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False), metavar="DIR",
              help="Model directory with the new weights (every bridge must be able to read it).")
@click.option("--policy-version", type=click.IntRange(min=0), required=True, metavar="N",
              help="The version of these weights (stamped on the generate replies they serve).")
@click.option("--timeout-s", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Give up on bridges that have not loaded the weights by then.")
@_address
@deployment_option
@pass_app
def backends_reload(app: App, checkpoint: str, policy_version: int, timeout_s: float, address: str | None) -> None:
    """Load new weights into every running bridge in place (no restart).

    Calls in flight finish on the old weights first. Bridges whose engine
    cannot reload are named in the error: restart those on the checkpoint.
    """
    from prorl_cli.exceptions import ReloadFailed

    with connect(app, address) as client:
        try:
            done = client.update_weights(checkpoint, policy_version, timeout_s=timeout_s)
        except ReloadFailed as e:
            app.abort(str(e))
    app.console.print(f"policy version {done.policy_version} loaded by {len(done.updated)} bridge(s): "
                      f"{', '.join(done.updated) or '-'}" + (f"; skipped (HTTP): {', '.join(done.skipped)}" if done.skipped else "")
                      + ("" if done.verified else "; UNVERIFIED: no bridge loaded it, each bridge that joins must"))
