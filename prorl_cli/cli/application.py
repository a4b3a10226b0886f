"""The one application object carried in the click context."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console

if TYPE_CHECKING:
    from prorl_cli.config import ProrlConfig


class App:
    """Carries the rich console and the effective configuration (loaded on first use)."""

    def __init__(self, config_path: str | None, overrides: dict[str, Any]) -> None:
        # soft_wrap: a message is never broken at the console's width (80 columns when output is a file or a
        # pipe, as in a Slurm job's log), so paths and commands in it can be copied whole; tables still fit.
        self.console = Console(highlight=False, soft_wrap=True)
        self.err_console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.config_path = config_path
        self.overrides = overrides
        self._config: ProrlConfig | None = None

    @property
    def config(self) -> ProrlConfig:
        if self._config is None:
            from prorl_cli.config import load_config
            from prorl_cli.exceptions import ConfigError

            try:
                self._config = load_config(self.config_path, self.overrides)
            except ConfigError as e:
                self.abort(f"config error: {e}")
        return self._config

    def override(self, **dotted: Any) -> None:
        """Apply command-specific flags (dotted keys, ``None`` ignored) before first use."""
        self.overrides.update({k.replace("__", "."): v for k, v in dotted.items() if v is not None})
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


