"""Per-domain defaults (max turns, stage limits, image, tools, system prompt) and their overrides.

A domain handler declares its defaults as a :class:`DomainSettings`. The
effective settings of one job are those defaults, overridden by
``domains.<task>`` in prorl.yaml, overridden by the instance's own
``settings`` mapping. Unknown keys and wrong types are errors that name where
they came from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.exceptions import DomainError


@dataclass(frozen=True)
class DomainSettings:
    """What a user expects to tune per domain; ``extra`` holds the domain's own knobs."""

    max_turns: int
    system_prompt: str
    tools: tuple[str, ...]
    image: str | None = None
    init_timeout_s: float = 300.0
    run_timeout_s: float = 1800.0
    eval_timeout_s: float = 600.0
    max_tokens: int = 1024
    extra: dict[str, Any] = field(default_factory=dict)

    def stage_timeout_s(self, stage: str) -> float:
        value: float = getattr(self, f"{stage}_timeout_s")
        return value

    def get(self, key: str) -> Any:
        """A domain-specific setting from ``extra``."""
        return self.extra[key]


_FIELDS = {f.name: f for f in dataclasses.fields(DomainSettings) if f.name != "extra"}


def _check(key: str, value: Any, default: Any, where: str) -> Any:
    if key == "tools":
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise DomainError(f"{where}.tools: expected a list of tool names, got {value!r}")
        return tuple(value)
    if key == "image":
        if value is not None and not isinstance(value, str):
            raise DomainError(f"{where}.image: expected an image name or path, got {value!r}")
        return value
    if isinstance(default, dict):
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise DomainError(f"{where}.{key}: expected a mapping, got {value!r}")
        return dict(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise DomainError(f"{where}.{key}: expected true or false, got {value!r}")
        return value
    if isinstance(default, int | float) and not isinstance(default, bool):
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise DomainError(f"{where}.{key}: expected a positive number, got {value!r}")
        return int(value) if isinstance(default, int) else float(value)
    if isinstance(default, str) and not isinstance(value, str):
        raise DomainError(f"{where}.{key}: expected a string, got {value!r}")
    return value


def resolve_settings(defaults: DomainSettings, *layers: tuple[str, Any]) -> DomainSettings:
    """``defaults`` overridden by each ``(where, mapping)`` layer in turn.

    Keys are the :class:`DomainSettings` fields or keys of ``defaults.extra``;
    anything else is a :class:`DomainError` naming ``where`` and the known keys.
    """
    top: dict[str, Any] = {name: getattr(defaults, name) for name in _FIELDS}
    extra = dict(defaults.extra)
    for where, layer in layers:
        if layer is None:
            continue
        if not isinstance(layer, dict):
            raise DomainError(f"{where}: expected a mapping of settings, got {type(layer).__name__} {layer!r}")
        for key, value in layer.items():
            if key in _FIELDS:
                top[key] = _check(key, value, top[key], where)
            elif key in extra:
                extra[key] = _check(key, value, extra[key], where)
            else:
                known = sorted([*_FIELDS, *extra])
                raise DomainError(f"{where}: unknown setting {key!r}; known: {known}")
    return DomainSettings(**top, extra=extra)
