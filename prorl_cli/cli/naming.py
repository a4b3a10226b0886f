"""One way to name a deployment on every command.

The rule: a command that acts on a deployment takes ``-d/--deployment NAME``
(after the subcommand), the global ``prorl -d NAME`` before it means the same,
a positional DEPLOYMENT is accepted where a command had one, and
``$PRORL_DEPLOYMENT`` (:data:`prorl_cli.config.ENV_DEPLOYMENT`) names it when
none of those does. Two names that differ are refused, never silently merged.

Where deployments live, ``--home DIR`` (``PRORL_HOME``), follows the same
rule: one declaration (:func:`home_option`) serves ``prorl --home DIR`` and
every command that reads the home (each one taking ``-d``, and the image
commands, whose cache is under it), before or after the command alike.
``--config FILE`` and ``--log-level LEVEL`` do too, on every command taking
``-d`` (:func:`config_option`, :func:`log_level_option`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from prorl_cli.cli.application import App
from prorl_cli.observe.logs import LOG_LEVEL_ALIASES, LOG_LEVELS, log_level_name

F = TypeVar("F", bound=Callable[..., Any])

DEPLOYMENT_HELP = "Deployment name (the rendezvous folder under PRORL_HOME); also $PRORL_DEPLOYMENT or prorl -d NAME."
HOME_HELP = ("PRORL_HOME: where deployments keep rendezvous files and run dirs, and images their cache (default "
             "~/.prorl); also $PRORL_HOME. Before the command or after it alike.")
LOG_LEVEL_HELP = "Log level of the processes this command runs (any case); also $PRORL_LOG_LEVEL. Before the command or after it alike."
CONFIG_HELP = "prorl.yaml to read (default: $PRORL_CONFIG, else ./prorl.yaml). Before the command or after it alike."
#: Where the group's own ``prorl --home DIR`` waits (in ``ctx.meta``) for the App its callback makes.
GLOBAL_HOMES = "prorl.global_homes"
#: The same for ``prorl --log-level LEVEL`` and ``prorl --config FILE``.
GLOBAL_LOG_LEVELS = "prorl.global_log_levels"
GLOBAL_CONFIGS = "prorl.global_configs"


def name_deployment(app: App, name: str | None, given_as: str = "DEPLOYMENT") -> None:
    """Record ``name`` as the deployment; a different name given before (``-d``, a positional) is an error."""
    if name is None:
        return
    given = app.overrides.get("deployment")
    if given is not None and given != name:
        app.abort(f"-d {given} and {given_as} {name} name different deployments; give one of them")
    app.override(deployment=name, given_as=given_as if given_as.startswith("-") else f"the {given_as} argument")


def _from_option(ctx: click.Context, param: click.Parameter, value: str | tuple[str, ...] | None) -> None:
    app = ctx.find_object(App)
    if app is None:
        return
    # -d may be given more than once (click would keep the last one without a word): every one must agree.
    names = list(dict.fromkeys(value)) if isinstance(value, tuple) else [] if value is None else [value]
    if len(names) > 1:
        app.abort(f"-d {names[0]} and -d {names[1]} name different deployments; give one of them")
    name_deployment(app, names[0] if names else None, given_as="-d" if isinstance(param, click.Option) else "DEPLOYMENT")


def deployment_option(f: F) -> F:
    """``-d/--deployment NAME`` on a subcommand: the same as ``prorl -d NAME`` before it.

    With :func:`home_option`: a deployment is a name under a home, and whoever names one may have to say where;
    with :func:`config_option` and :func:`log_level_option`, so every global option works after the command too.
    """
    return click.option("-d", "--deployment", "deployment_flag", metavar="NAME", expose_value=False, multiple=True,
                        callback=_from_option, help=DEPLOYMENT_HELP)(home_option(config_option(log_level_option(f))))


def _home_path(home: str) -> str:
    """``home`` as the folder it names (``ProrlConfig.home_path``'s reading), to compare two spellings of one."""
    from prorl_cli.config import home_folder

    return os.path.normpath(home_folder(home))  # normalised: `a/../b` and `b` name one folder


def _recorded_by(meta_key: str, record: Callable[[App, Sequence[str]], None]) -> Callable[..., None]:
    """The callback of an option given before the command or after it: ``record(app, values)`` where the App
    exists (after a command); on the ``prorl`` group itself, parsed before its App exists, the values wait in
    ``ctx.meta[meta_key]`` for the group to record them."""

    def callback(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
        app = ctx.find_object(App)
        if app is None:
            ctx.meta[meta_key] = value
            return
        record(app, value)

    return callback


def name_home(app: App, homes: Sequence[str]) -> None:
    """Record the home given as ``--home`` (each of ``homes``); two that name different folders are an error, the
    one given before the command included. Spellings of one folder (``~/x``, ``/home/me/x/``) agree: the first
    is kept, as the user wrote it."""
    for home in homes:
        given = app.overrides.get("home")
        if given is None:
            app.override(home=home, given_as="--home")
        elif _home_path(str(given)) != _home_path(home):
            app.abort(f"--home {given} and --home {home} name different folders; give one of them")


_from_home_option = _recorded_by(GLOBAL_HOMES, name_home)


def home_option(f: F) -> F:
    """``--home DIR``, the one declaration of it: on the ``prorl`` group and on each command that reads the home,
    where it means the same as before the command (a different folder there is refused)."""
    return click.option("--home", "home_flag", metavar="DIR", expose_value=False, multiple=True,
                        callback=_from_home_option, help=HOME_HELP)(f)


def name_log_level(app: App, levels: Sequence[str]) -> None:
    """Record ``--log-level`` (each of ``levels``, before the command or after it); two different levels are an
    error. The config checks the name (:data:`prorl_cli.observe.logs.LOG_LEVELS`) and keeps it upper-case."""
    for level in levels:
        given = app.overrides.get("log_level")
        if given is None:
            app.override(log_level=level, given_as="--log-level")
        elif log_level_name(str(given)) != log_level_name(level):  # WARN and WARNING are one level
            app.abort(f"--log-level {given} and --log-level {level} differ; give one of them")


_from_log_level_option = _recorded_by(GLOBAL_LOG_LEVELS, name_log_level)


def log_level_option(f: F) -> F:
    """``--log-level LEVEL``, the one declaration of it: on the ``prorl`` group and on each command that takes
    ``-d``, where it means the same as before the command."""
    return click.option("--log-level", "log_level_flag", type=click.Choice((*LOG_LEVELS, *LOG_LEVEL_ALIASES), case_sensitive=False),
                        expose_value=False, multiple=True, callback=_from_log_level_option, help=LOG_LEVEL_HELP)(f)


def name_config(app: App, paths: Sequence[str]) -> None:
    """Record the prorl.yaml given as ``--config`` (each of ``paths``); two naming different files are an error.
    Only records it: the App reads its config on first use, after every option of the command line is parsed."""
    for path in paths:
        if app.config_path is None:
            app.use_config(path)
        elif os.path.abspath(os.path.expanduser(app.config_path)) != os.path.abspath(os.path.expanduser(path)):
            app.abort(f"--config {app.config_path} and --config {path} name different files; give one of them")


_from_config_option = _recorded_by(GLOBAL_CONFIGS, name_config)


def config_option(f: F) -> F:
    """``--config FILE``, the one declaration of it: on the ``prorl`` group and on each command that takes ``-d``,
    where it means the same as before the command. No ``envvar``: :func:`prorl_cli.config.find_config_file`
    reads ``$PRORL_CONFIG`` itself, so the flag beats the variable and an error says which of them named a file."""
    return click.option("--config", "config_flag", metavar="FILE", expose_value=False, multiple=True,
                        callback=_from_config_option, help=CONFIG_HELP)(f)


def deployment_argument(f: F) -> F:
    """An optional positional ``[DEPLOYMENT]``, the same as ``-d NAME`` (kept where commands always had it)."""
    return click.argument("deployment_name", metavar="[DEPLOYMENT]", required=False, expose_value=False,
                          callback=_from_option)(f)


def named_deployment(app: App) -> str | None:
    """The deployment named on the command line or by ``$PRORL_DEPLOYMENT``; None when neither names one."""
    from prorl_cli.config import ENV_DEPLOYMENT

    given = app.overrides.get("deployment")
    return str(given) if given is not None else (os.environ.get(ENV_DEPLOYMENT) or None)


def require_deployment(app: App, command: str, *, positional: bool = True, args: str = "") -> str:
    """The deployment a command that must not guess (``down``, ``scale``, ``logs``) acts on: named on the
    command line, by ``$PRORL_DEPLOYMENT``, or by the prorl.yaml in use (``deployment:``), never the default.

    The error names the forms ``command`` accepts: ``positional`` False for a command whose positional argument is
    something else (``logs ROLE``), ``args`` what follows the name in each form (`` nodes[0]``)."""
    from prorl_cli.config import find_config_file

    name = named_deployment(app)
    path = find_config_file(app.config_path) if name is None else None
    if path is not None:
        import yaml

        from prorl_cli import yamlfiles

        try:
            data = yamlfiles.load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            app.abort(f"{path}: cannot read: {e}")
        if isinstance(data, dict) and isinstance(data.get("deployment"), str):
            name = data["deployment"]
    if name is None:
        forms = [f"prorl {command} NAME{args}"] if positional else []
        forms += [f"prorl {command} -d NAME{args}", f"prorl -d NAME {command}{args}"]
        app.abort(f"name the deployment: {', '.join(forms)}, PRORL_DEPLOYMENT, or deployment: in prorl.yaml")
    return name


def id_prefix(prefix: str | None) -> str | None:
    """``--prefix P`` selects the jobs of the submission whose ids are ``P-...`` (``P-LINE-K``, a DAPO run's
    ``P-sSTEP-...``): so ``run1`` never also selects ``run10``'s jobs."""
    if prefix is None or prefix.endswith("-"):
        return prefix
    return f"{prefix}-"
