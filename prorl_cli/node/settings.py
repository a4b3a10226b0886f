"""A handler's settings: its declared defaults, overridden per deployment and per instance.

Every :class:`~prorl_cli.node.handler.AgentHandler` declares ``defaults`` (a
:class:`HandlerSettings`). The effective settings of one job are those
defaults, overridden by ``handlers.<task>`` in prorl.yaml, overridden by the
instance's own ``settings`` mapping. Unknown keys and wrong types are
:class:`~prorl_cli.exceptions.SettingsError` naming where they came from and
the keys that exist (the deployment's layer by the config file it was read
from: ``my.yaml: handlers.math``). ``domains.<task>``, the old name of the
prorl.yaml section, is still read, with a warning naming the new key.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prorl_cli.exceptions import SettingsError

if TYPE_CHECKING:
    from prorl_cli.config import ProrlConfig

log = logging.getLogger(__name__)

#: The stages a handler may limit (``<stage>_timeout_s``).
LIMITED_STAGES = ("init", "run", "eval")
_LIMIT_FIELDS = {stage: f"{stage}_timeout_s" for stage in LIMITED_STAGES}


@dataclass(frozen=True)
class HandlerSettings:
    """What a user expects to tune per handler; ``extra`` holds the handler's own knobs.

    A stage limit (``init_timeout_s``, ...) of ``None`` leaves the stage to the
    node's limits (``jobs.*_timeout_s``, the job budget); a number is enforced
    by the node's pipeline like its own, so running past it ends the job
    ``timed_out``. ``tools`` names the declared tools the model is offered
    (``None``: all of them). ``tool_timeout_s`` bounds each call of the
    shipped sandbox tools (``None``: the sandbox's ``sandbox.tool_timeout_s``).
    """

    max_turns: int = 8
    system_prompt: str = ""
    tools: tuple[str, ...] | None = None
    image: str | None = None
    init_timeout_s: float | None = None
    run_timeout_s: float | None = None
    eval_timeout_s: float | None = None
    #: ``max_tokens`` of each model turn where the submitter set none (``None``: the job's sampling as is).
    max_tokens: int | None = None
    #: Limit of one sandbox tool call (``bash``, ``python``); ``None``: the sandbox's own default.
    tool_timeout_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A field given in ``extra`` moves to the field: ``tool_timeout_s`` was a handler's own
        # setting before it was a field, and handlers written then declare it there.
        moved = {k: v for k, v in self.extra.items() if k in _FIELDS}
        if not moved:
            return
        for key, value in moved.items():
            if getattr(self, key) != _DEFAULTS[key]:
                raise SettingsError(f"handler defaults: {key} is given both as a field and in extra; keep the field")
            object.__setattr__(self, key, _check(key, value, None, "handler defaults"))
        object.__setattr__(self, "extra", {k: v for k, v in self.extra.items() if k not in moved})

    def stage_timeout_s(self, stage: str) -> float | None:
        """The handler's limit of ``stage`` (``init``, ``run`` or ``eval``), ``None`` for none."""
        try:
            value: float | None = getattr(self, _LIMIT_FIELDS[stage])  # per stage of every job: no string building
        except KeyError:
            raise ValueError(f"unknown stage {stage!r}; stages: {LIMITED_STAGES}") from None
        return value

    def get(self, key: str) -> Any:
        """A handler-specific setting from ``extra`` (or a field, by name); :class:`KeyError` names the known ones."""
        try:
            return self.extra[key]
        except KeyError:
            if key in _FIELDS:
                return getattr(self, key)
            raise KeyError(f"no setting {key!r}; this handler's own settings: {sorted(self.extra)}") from None


_FIELDS = {f.name: f for f in dataclasses.fields(HandlerSettings) if f.name != "extra"}
_DEFAULTS = {name: f.default for name, f in _FIELDS.items()}
_OPTIONAL_NUMBERS = {"init_timeout_s", "run_timeout_s", "eval_timeout_s", "max_tokens", "tool_timeout_s"}
_INTS = {"max_turns", "max_tokens"}


def _number(key: str, value: Any, integer: bool, where: str) -> int | float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise SettingsError(f"{where}.{key}: expected a positive number, got {value!r}")
    if integer:
        if value != int(value):
            raise SettingsError(f"{where}.{key}: expected a whole number, got {value!r}")
        return int(value)
    return float(value)


def _check(key: str, value: Any, default: Any, where: str) -> Any:
    if key == "tools":
        if value is None:
            return None
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise SettingsError(f"{where}.tools: expected a list of tool names, got {value!r}")
        return tuple(value)
    if key in ("image", "system_prompt"):
        if value is not None and not isinstance(value, str):
            raise SettingsError(f"{where}.{key}: expected a string, got {value!r}")
        return value if key == "image" else (value or "")
    if key in _FIELDS:
        if value is None and key in _OPTIONAL_NUMBERS:
            return None
        return _number(key, value, key in _INTS, where)
    # A handler's own setting: checked against the type of its default.
    if isinstance(default, dict):
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise SettingsError(f"{where}.{key}: expected a mapping, got {value!r}")
        return dict(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise SettingsError(f"{where}.{key}: expected true or false, got {value!r}")
        return value
    if isinstance(default, int | float):
        return _number(key, value, isinstance(default, int), where)
    if isinstance(default, str) and not isinstance(value, str):
        raise SettingsError(f"{where}.{key}: expected a string, got {value!r}")
    if isinstance(default, list | tuple) and not isinstance(value, list | tuple):
        raise SettingsError(f"{where}.{key}: expected a list, got {value!r}")
    return value


def resolve_settings(defaults: HandlerSettings, *layers: tuple[str, Any]) -> HandlerSettings:
    """``defaults`` overridden by each ``(where, mapping)`` layer in turn (``None`` layers are skipped).

    Keys are the :class:`HandlerSettings` fields or keys of ``defaults.extra``;
    anything else is a :class:`~prorl_cli.exceptions.SettingsError` naming ``where`` and the known keys.
    """
    top: dict[str, Any] = {name: getattr(defaults, name) for name in _FIELDS}
    extra = dict(defaults.extra)
    for where, layer in layers:
        if layer is None:
            continue
        if not isinstance(layer, dict):
            raise SettingsError(f"{where}: expected a mapping of settings, got {type(layer).__name__} {layer!r}")
        for key, value in layer.items():
            if key in _FIELDS:
                top[key] = _check(key, value, top[key], where)
            elif key in extra:
                extra[key] = _check(key, value, extra[key], where)
            else:
                known = sorted([*_FIELDS, *extra])
                raise SettingsError(f"{where}: unknown setting {key!r}; known: {known}")
    return HandlerSettings(**top, extra=extra)


#: prorl.yaml sections read under their old name (``domains.<name>``) and warned about, once per process.
_WARNED_OLD_SECTION: set[str] = set()


def deployment_settings(config: ProrlConfig, section: str) -> tuple[str, Any]:
    """``(where, mapping)``: the deployment's overrides of handler ``section`` in prorl.yaml (``None``: none).

    ``handlers.<section>``; else ``domains.<section>``, its old name, read with
    a one-time warning naming the new key. Both set is a
    :class:`~prorl_cli.exceptions.SettingsError` (which one wins would be a guess).
    """
    # The file the settings were read from (``--config my.yaml``, ``$PRORL_CONFIG``), whatever it is called.
    source = config.source
    new, old = config.handlers.get(section), config.domains.get(section)
    if old is None:
        return f"{source}: handlers.{section}", new
    if new is not None:
        raise SettingsError(
            f"{source}: both handlers.{section} and domains.{section} are set; "
            f"domains is the old name of handlers: move its keys to handlers.{section}"
        )
    if section not in _WARNED_OLD_SECTION:
        _WARNED_OLD_SECTION.add(section)
        log.warning("%s: domains.%s is deprecated; rename it handlers.%s (same keys)", source, section, section)
    return f"{source}: domains.{section}", old
