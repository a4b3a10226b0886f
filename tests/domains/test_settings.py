"""Domain defaults overridden by prorl.yaml and by the instance; bad settings are named."""

from __future__ import annotations

import pytest

from prorl_cli.config import config_from_dict
from prorl_cli.domains.settings import DomainSettings, resolve_settings
from prorl_cli.exceptions import DomainError

DEFAULTS = DomainSettings(max_turns=6, system_prompt="s", tools=("python",), image="math", extra={"tool_timeout_s": 30.0})


def test_layers_override_in_order() -> None:
    cfg = config_from_dict({"domains": {"math": {"max_turns": 8, "image": "/x.sif", "tool_timeout_s": 5}}})
    s = resolve_settings(DEFAULTS, ("prorl.yaml: domains.math", cfg.domains["math"]), ("instance", {"max_turns": 2}))
    assert (s.max_turns, s.image, s.get("tool_timeout_s"), s.system_prompt) == (2, "/x.sif", 5.0, "s")
    assert DEFAULTS.max_turns == 6  # defaults untouched


def test_bad_settings_name_their_source() -> None:
    with pytest.raises(DomainError, match=r"prorl.yaml: domains.math: unknown setting 'max_turn'; known: \[.*'max_turns'"):
        resolve_settings(DEFAULTS, ("prorl.yaml: domains.math", {"max_turn": 3}))
    with pytest.raises(DomainError, match=r"instance\.run_timeout_s: expected a positive number"):
        resolve_settings(DEFAULTS, ("instance", {"run_timeout_s": -1}))
    with pytest.raises(DomainError, match=r"instance\.tools: expected a list"):
        resolve_settings(DEFAULTS, ("instance", {"tools": "python"}))
