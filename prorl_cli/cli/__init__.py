"""``prorl``: the command line. Heavy imports happen inside the commands that need them."""

from __future__ import annotations

import contextlib

import click

from prorl_cli import __version__
from prorl_cli.cli.application import App
from prorl_cli.cli.backends import backends
from prorl_cli.cli.config import config
from prorl_cli.cli.dev import dev
from prorl_cli.cli.eval import eval_command
from prorl_cli.cli.images import build_images, images
from prorl_cli.cli.init import init
from prorl_cli.cli.jobs import cancel, status, stop, submit
from prorl_cli.cli.jobs.results import results
from prorl_cli.cli.launch import down, launch, render_sbatch, scale
from prorl_cli.cli.logs import logs
from prorl_cli.cli.naming import (
    GLOBAL_CONFIGS,
    GLOBAL_HOMES,
    GLOBAL_LOG_LEVELS,
    config_option,
    home_option,
    log_level_option,
    name_config,
    name_home,
    name_log_level,
)
from prorl_cli.cli.observe import OBSERVE_COMMANDS
from prorl_cli.cli.plan import plan
from prorl_cli.cli.quickstart import quickstart
from prorl_cli.cli.sample import sample
from prorl_cli.cli.serve import serve
from prorl_cli.cli.swe import swe


class ProrlGroup(click.Group):
    """The ``prorl`` group: a prorl error from any command, an OS error on a named path, or a Ctrl-C, ends in one
    line on stderr, never a traceback (exit 1, or 130 for the Ctrl-C)."""

    def invoke(self, ctx: click.Context) -> object:
        from prorl_cli.exceptions import ProrlError, one_line

        try:
            return super().invoke(ctx)
        except ProrlError as e:
            click.echo(f"error: {one_line(str(e))}", err=True)
            raise click.exceptions.Exit(1) from e
        except OSError as e:
            if e.filename is None:  # not about a path the user gave or a folder of theirs: a bug, with its traceback
                raise
            # A file or folder the command could not read, write or create (--out in a folder that cannot be made,
            # one not writable): its path and the OS's reason.
            where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
            click.echo(f"error: {where}: {e.strerror or e}", err=True)
            raise click.exceptions.Exit(1) from e
        except KeyboardInterrupt as e:
            # A command that does not handle Ctrl-C itself (what it started is stopped by its own cleanup, which
            # ran as the interrupt unwound): one line and the shell's 128 + the signal, not click's bare "Aborted!".
            # The newline first (as click's own "Aborted!"): the terminal's ^C, or a live progress line, has none.
            from prorl_cli.cli.common import interruption

            how, code = interruption(e)
            # The terminal may be gone (SIGHUP): writing to it fails, and the exit code is all that is left to tell.
            with contextlib.suppress(OSError):
                click.echo(err=True)
                click.echo(f"error: {how}", err=True)
            raise click.exceptions.Exit(code) from None


@click.group(cls=ProrlGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="prorl")
@config_option
@click.option("-d", "--deployment", metavar="NAME", multiple=True,
              help="Deployment name (the rendezvous folder under PRORL_HOME); the same as -d NAME after a command, or $PRORL_DEPLOYMENT.")
@home_option
@log_level_option
@click.pass_context
def cli(ctx: click.Context, deployment: tuple[str, ...]) -> None:
    """prorl: multi-turn LLM-agent rollouts as a service for RL training on Slurm.

    \b
    Login node:   prorl build-images, prorl launch / scale / down / logs / render-sbatch
    Allocations:  prorl serve broker | node | inference
    Trainer:      prorl submit, sample, results, status, cancel, backends, stop
    Planning:     prorl plan (rollouts/s and informative groups per GPU-hour of a cluster shape)
    One machine:  prorl quickstart
    Start here:   prorl init [--slurm] (commented prorl.yaml, deploy.yaml), prorl config show
    """
    # -d may be given more than once (click would keep the last one without a word): every one must agree.
    names = list(dict.fromkeys(deployment))
    ctx.obj = App(None, {"deployment": names[0]} if names else {}, given_as={"deployment": "-d"})
    if len(names) > 1:
        ctx.obj.abort(f"-d {names[0]} and -d {names[1]} name different deployments; give one of them")
    # --home, --config and --log-level before the command (their callbacks kept them for now); the same option
    # after the command is checked against them.
    name_home(ctx.obj, ctx.meta.get(GLOBAL_HOMES, ()))
    name_config(ctx.obj, ctx.meta.get(GLOBAL_CONFIGS, ()))
    name_log_level(ctx.obj, ctx.meta.get(GLOBAL_LOG_LEVELS, ()))


for command in (serve, submit, sample, results, status, cancel, stop, backends, init, config, quickstart, build_images, images, dev, launch, down, scale, logs, render_sbatch, eval_command, swe, plan):
    cli.add_command(command)
for command in OBSERVE_COMMANDS:  # trace, inspect, report, top
    cli.add_command(command)


def main() -> None:
    try:
        cli(prog_name="prorl")
    finally:
        _forget_handled_interrupt()


def _forget_handled_interrupt() -> None:
    """Exit with the code the command chose after a Ctrl-C it handled, not by SIGINT.

    CPython (3.11, 3.12) marks an interpreter to die of SIGINT at exit when a KeyboardInterrupt ends a string
    ``exec`` (``dataclasses`` and ``namedtuple`` build their methods so, so a Ctrl-C that lands while one is being
    made, say in a lazy import, sets the mark), even when a caller catches it; under ``python -m prorl_cli`` the
    mark wins over ``sys.exit(130)``. Every string ``exec`` clears it first, so one that raises nothing forgets
    a handled interrupt. An interrupt nobody handled is marked again as it leaves, and still ends the process
    by SIGINT as the shell expects."""
    exec("None", {})  # noqa: S102 - a constant string, run for its side effect on the interpreter's mark
