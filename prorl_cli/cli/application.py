"""The one application object carried in the click context."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console

if TYPE_CHECKING:
    from prorl_cli.config import ProrlConfig

#: The width tables get where output is a file or a pipe (a Slurm job's log, ``| tee``) and ``COLUMNS`` is unset:
#: rich's 80 would squeeze a node table's ids and hosts to "slurm-12…".
PIPE_WIDTH_COLUMNS = 240


def _console(*, stderr: bool) -> Console:
    """A console whose messages never break at its width (``soft_wrap``), so paths and commands in them copy whole.

    Tables fit the width: in a terminal, the terminal's; in a file or a pipe, :data:`PIPE_WIDTH_COLUMNS` (or
    ``COLUMNS``). A table wider still folds its id, host and path columns onto more lines, never cuts them.
    """
    console = Console(stderr=stderr, highlight=False, soft_wrap=True)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = PIPE_WIDTH_COLUMNS
    return console


class App:
    """Carries the rich console and the effective configuration (loaded on first use)."""

    def __init__(self, config_path: str | None, overrides: dict[str, Any], given_as: dict[str, str] | None = None) -> None:
        self.console = _console(stderr=False)
        self.err_console = _console(stderr=True)
        self.config_path = config_path
        self.overrides = overrides
        #: How each override was given (``{"deployment": "-d"}``): a bad value is blamed on that, not on prorl.yaml.
        self.given_as: dict[str, str] = dict(given_as or {})
        self._config: ProrlConfig | None = None

    @property
    def config(self) -> ProrlConfig:
        if self._config is None:
            from prorl_cli.config import load_config
            from prorl_cli.exceptions import ConfigError

            try:
                given_as = {k: self.given_as.get(k, "the command line") for k in self.overrides}
                self._config = load_config(self.config_path, self.overrides, given_as)
            except ConfigError as e:
                self.abort(f"config error: {e}")
        return self._config

    def use_config(self, path: str) -> None:
        """Read ``path`` as prorl.yaml (``--config``, given before first use)."""
        self.config_path = path
        self._config = None

    def override(self, given_as: str | None = None, **dotted: Any) -> None:
        """Apply command-specific flags (dotted keys, ``None`` ignored) before first use; ``given_as`` names the
        flag (``-d``) for the errors of a bad value (without it they say "the command line")."""
        values = {k.replace("__", "."): v for k, v in dotted.items() if v is not None}
        self.overrides.update(values)
        if given_as is not None:
            self.given_as.update(dict.fromkeys(values, given_as))
        self._config = None

    def setup_logging(self, name: str) -> None:
        from prorl_cli.observe.logs import configure_logging

        configure_logging(name, self.config.log_level)

    def abort(self, message: str, code: int = 1) -> NoReturn:
        """Print ``error: message`` as one line on stderr (never wrapped, no markup) and exit ``code``."""
        from rich.markup import escape

        from prorl_cli.exceptions import one_line

        self.err_console.print(f"[bold red]error:[/] {escape(one_line(message))}", soft_wrap=True)
        raise click.exceptions.Exit(code)


pass_app = click.make_pass_decorator(App)


