"""The domains' settings are every handler's settings (:mod:`prorl_cli.node.settings`)."""

from prorl_cli.node.settings import HandlerSettings, resolve_settings

#: The name the domains used before every handler had settings.
DomainSettings = HandlerSettings

__all__ = ["DomainSettings", "HandlerSettings", "resolve_settings"]
