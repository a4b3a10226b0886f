"""Handler defaults overridden by prorl.yaml and by the instance; bad settings are named."""

from __future__ import annotations

import logging

import pytest

from prorl_cli.config import config_from_dict
from prorl_cli.exceptions import DomainError, ProrlError, SettingsError
from prorl_cli.node.settings import HandlerSettings, deployment_settings, resolve_settings

DEFAULTS = HandlerSettings(max_turns=6, system_prompt="s", tools=("python",), image="math", tool_timeout_s=30.0,
                           extra={"top_k": 5})


def test_layers_override_in_order() -> None:
    cfg = config_from_dict({"handlers": {"math": {"max_turns": 8, "image": "/x.sif", "tool_timeout_s": 5}}})
    s = resolve_settings(DEFAULTS, deployment_settings(cfg, "math"), ("instance", {"max_turns": 2}))
    assert (s.max_turns, s.image, s.tool_timeout_s, s.system_prompt) == (2, "/x.sif", 5.0, "s")
    assert s.get("tool_timeout_s") == 5.0  # handlers that read it as their own setting still can
    assert DEFAULTS.max_turns == 6  # defaults untouched


def test_bad_settings_name_their_source() -> None:
    with pytest.raises(SettingsError, match=r"prorl.yaml: handlers.math: unknown setting 'max_turn'; known: \[.*'max_turns'"):
        resolve_settings(DEFAULTS, ("prorl.yaml: handlers.math", {"max_turn": 3}))
    with pytest.raises(SettingsError, match=r"instance\.run_timeout_s: expected a positive number"):
        resolve_settings(DEFAULTS, ("instance", {"run_timeout_s": -1}))
    with pytest.raises(SettingsError, match=r"instance\.tools: expected a list"):
        resolve_settings(DEFAULTS, ("instance", {"tools": "python"}))
    with pytest.raises(SettingsError, match=r"instance\.tool_timeout_s: expected a positive number"):
        resolve_settings(DEFAULTS, ("instance", {"tool_timeout_s": 0}))
    # One class for bad settings; code written when they were DomainErrors still catches them.
    assert issubclass(SettingsError, ProrlError) and issubclass(SettingsError, ValueError)
    assert issubclass(SettingsError, DomainError)


def test_the_old_domains_section_is_read_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    import prorl_cli.node.settings as settings_module

    settings_module._WARNED_OLD_SECTION.discard("old_style")
    cfg = config_from_dict({"domains": {"old_style": {"max_turns": 3}}})
    with caplog.at_level(logging.WARNING, logger="prorl_cli.node.settings"):
        first = deployment_settings(cfg, "old_style")
        second = deployment_settings(cfg, "old_style")
    assert first == second == ("prorl.yaml: domains.old_style", {"max_turns": 3})
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert warnings == ["prorl.yaml: domains.old_style is deprecated; rename it handlers.old_style (same keys)"]
    assert deployment_settings(config_from_dict({}), "old_style") == ("prorl.yaml: handlers.old_style", None)


def test_both_sections_for_one_handler_are_an_error() -> None:
    cfg = config_from_dict({"handlers": {"math": {"max_turns": 3}}, "domains": {"math": {"max_turns": 4}}})
    with pytest.raises(SettingsError, match=r"both handlers.math and domains.math are set"):
        deployment_settings(cfg, "math")
    from prorl_cli.node.registry import discover

    # A node serving math refuses to start on it, naming both keys.
    assert [e for e in discover().settings_errors(cfg) if "handlers.math" in e] == [
        "prorl.yaml: both handlers.math and domains.math are set; "
        "domains is the old name of handlers: move its keys to handlers.math"]


def test_tool_timeout_declared_the_old_way_moves_to_the_field() -> None:
    old = HandlerSettings(extra={"tool_timeout_s": 10.0, "corpus": "x"})
    assert (old.tool_timeout_s, old.extra) == (10.0, {"corpus": "x"})
    with pytest.raises(SettingsError, match="tool_timeout_s is given both as a field and in extra"):
        HandlerSettings(tool_timeout_s=5.0, extra={"tool_timeout_s": 10.0})
