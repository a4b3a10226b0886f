"""``prorl serve``: the long-running servers, in the foreground."""

from __future__ import annotations

import logging
import os
import sys

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.common import Seconds
from prorl_cli.cli.naming import deployment_option
from prorl_cli.cli.serve.inference import serve_inference


@click.group()
def serve() -> None:
    """Run a broker, a node server or an inference bridge in the foreground."""
    from prorl_cli.processes import die_with_parent

    die_with_parent()  # a server of an embedded stack ends with the process that started it


@serve.command("broker")
@deployment_option
@click.option("--bind-host", metavar="HOST", help="Interface to listen on (default 127.0.0.1; 0.0.0.0 for a cluster).")
@click.option("--port", type=int, help="TCP port (default: a free one, published in the rendezvous file).")
@pass_app
def serve_broker(app: App, bind_host: str | None, port: int | None) -> None:
    """Run the deployment's ZeroMQ broker and write its rendezvous file.

    Refuses to start while another broker serves the deployment (it holds
    <deployment>/broker.lock); the error names that broker's pid and address.
    """
    app.override(broker__bind_host=bind_host, broker__port=port)
    app.setup_logging("broker")
    from prorl_cli.slurm.identity import SlurmIdentity

    if SlurmIdentity.from_env().in_slurm:
        # Inside an allocation: SIGUSR2 (time limit) leaves and requeues the job; the journal is replayed.
        # serve_role takes the broker lock too.
        from prorl_cli.exceptions import ProrlError
        from prorl_cli.slurm.roles import RoleSpec, serve_role

        bc = app.config.broker
        spec = RoleSpec("broker", app.config.deployment, str(app.config.home_path), bind_host=bc.bind_host, port=bc.port)
        try:
            raise SystemExit(serve_role(spec, app.config))
        except ProrlError as e:
            app.abort(str(e))
    import zmq

    from prorl_cli.broker.server import Broker
    from prorl_cli.rendezvous import BrokerLock

    cfg = app.config
    try:
        # Held for the broker's life: a second broker for this deployment refuses here, before it touches
        # the live one's rendezvous file or journal.
        lock = BrokerLock.acquire(cfg.deployment_dir)
    except OSError as e:
        app.abort(f"cannot use the deployment folder {cfg.deployment_dir}: {e.strerror or e}")
    with lock:
        where = f"{cfg.broker.bind_host}:{cfg.broker.port or '*'}"
        try:
            broker = Broker(cfg)
        except zmq.ZMQError as e:
            hint = "the port is in use" if e.errno == zmq.EADDRINUSE else "is --bind-host an address of this machine?"
            app.abort(f"the broker cannot listen on {where}: {e.strerror} ({hint})")
        except OSError as e:
            app.abort(f"the broker cannot start in {cfg.deployment_dir}: {e}")
        app.err_console.print(f"broker of [bold]{cfg.deployment}[/] on {broker.address}")
        broker.serve_forever()


@serve.command("node")
@deployment_option
@click.option("--node-id", metavar="ID", help="Name of this node, unique in the deployment (default: HOST-PID; in Slurm node-<array task or job id>, "
              "plus .<rank> in an srun step of several tasks).")
@click.option("--address", metavar="ENDPOINT", help="Broker endpoint (default: read the rendezvous file).")
@click.option("--n-init", type=int, help="INIT pool size.")
@click.option("--n-run", type=int, help="RUN pool size.")
@click.option("--n-eval", type=int, help="EVAL pool size.")
@click.option("--credit", type=int, help="Jobs held at once (default: the sum of the pools).")
@click.option("--handlers", "handler_paths", multiple=True, metavar="PATH", help="Extra handler file or folder (repeatable).")
@click.option("--task", "tasks", multiple=True, metavar="NAME", help="Serve only this task (repeatable).")
@click.option("--wait-s", type=Seconds(), metavar="S",
              help="Wait this long for the broker's rendezvous file (default: 600 in a Slurm job, else none).")
@pass_app
def serve_node(
    app: App,
    node_id: str | None,
    address: str | None,
    n_init: int | None,
    n_run: int | None,
    n_eval: int | None,
    credit: int | None,
    handler_paths: tuple[str, ...],
    tasks: tuple[str, ...],
    wait_s: float | None,
) -> None:
    """Run a node server: INIT/RUN/EVAL pools and sandboxes for one machine.

    In a Slurm job it is named node-<array task id> (node-<job id> outside an
    array, with .<rank> added per task of an srun step), waits for the broker,
    drains on SIGTERM and on SIGUSR2 (time limit) drains and requeues itself.
    A node waiting for its broker (--wait-s) ends with exit code 0 when the
    deployment is stopped (prorl stop) meanwhile.
    """
    app.override(
        node__n_init=n_init,
        node__n_run=n_run,
        node__n_eval=n_eval,
        node__credit=credit,
        node__handler_paths=list(handler_paths) or None,
        node__tasks=list(tasks) or None,
    )
    app.setup_logging("node")
    import_from_working_directory()
    from prorl_cli.exceptions import ProrlError, RendezvousError
    from prorl_cli.node.server import run_node
    from prorl_cli.slurm.identity import SlurmIdentity

    identity = SlurmIdentity.from_env()
    if identity.in_slurm and address is None and node_id is None:
        from prorl_cli.slurm.roles import RoleSpec, serve_role

        spec = RoleSpec("node", app.config.deployment, str(app.config.home_path),
                        rendezvous_wait_s=600.0 if wait_s is None else wait_s)
        try:
            raise SystemExit(serve_role(spec, app.config))
        except ProrlError as e:
            app.abort(str(e))
    try:
        if wait_s and address is None:
            from prorl_cli.exceptions import DeploymentStopped
            from prorl_cli.rendezvous import wait_rendezvous

            try:
                # A file left by a broker killed here is no broker: wait for the one that replaces it. A deployment
                # stopped on purpose since this node started has none coming: the node ends (exit code 0).
                wait_rendezvous(app.config.deployment_dir, wait_s, live=True)
            except DeploymentStopped as e:
                logging.getLogger(__name__).info("%s while this node started: not waiting for a broker", e)
                return
        run_node(app.config, node_id=node_id, address=address)
    except RendezvousError as e:
        # Outside Slurm a node does not wait for its broker unless told to: a broker started a moment before
        # (`prorl serve broker &`) may not have written its file yet.
        app.abort(str(e) if wait_s or address is not None else
                  f"{e} (a broker just started may not have written it yet: --wait-s 60 waits up to 60 s for it)")
    except ProrlError as e:
        app.abort(str(e))


def import_from_working_directory() -> None:
    """Put the working directory on ``sys.path``, as ``python -m prorl_cli`` does and the ``prorl`` console script
    does not, so that a ``module:function`` setting (a harness scorer, docs/harness.md) may name a module there.

    Last, unlike ``python -m``: a file that happens to be in the folder a node starts in (a ``yaml.py``) must not
    shadow an installed module the node needs. Its absolute path, so a later ``chdir`` changes nothing.
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # "": the working directory already (python -c, a REPL)
        sys.path.append(cwd)


serve.add_command(serve_inference)
