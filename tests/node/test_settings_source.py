"""A handler's deployment settings are named by the config file they were read from, whatever it is called."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import prorl_cli.node.settings as settings_module
from prorl_cli.config import config_from_dict, load_config
from prorl_cli.exceptions import SettingsError
from prorl_cli.node.registry import discover
from prorl_cli.node.settings import deployment_settings, resolve_settings


def _bad_math(path: Path) -> Path:
    path.write_text("handlers:\n  math:\n    max_turns: lots\n")
    return path


@pytest.mark.parametrize("given", ["flag", "env"])
def test_settings_errors_name_the_config_file_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prorl.yaml").write_text("{}\n")  # a ./prorl.yaml that is not the file read
    path = _bad_math(tmp_path / "my-run.yaml")
    monkeypatch.setenv("PRORL_HOME", str(tmp_path / "home"))
    if given == "flag":
        monkeypatch.delenv("PRORL_CONFIG", raising=False)
        cfg = load_config(str(path))
    else:
        monkeypatch.setenv("PRORL_CONFIG", str(path))
        cfg = load_config()
    where, layer = deployment_settings(cfg, "math")
    assert where == f"{path}: handlers.math"
    with pytest.raises(SettingsError, match=rf"^{path}: handlers\.math\.max_turns: expected a positive number"):
        resolve_settings(discover().handlers["math"].defaults, (where, layer))
    # A node serving math refuses to start on it, with the same words.
    assert [e for e in discover().settings_errors(cfg) if "handlers.math" in e] == [
        f"{path}: handlers.math.max_turns: expected a positive number, got 'lots'"]


def test_both_sections_and_the_old_name_warning_name_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PRORL_HOME", str(tmp_path / "home"))
    both = tmp_path / "both.yaml"
    both.write_text("handlers:\n  math: {max_turns: 3}\ndomains:\n  math: {max_turns: 4}\n")
    with pytest.raises(SettingsError, match=rf"^{both}: both handlers\.math and domains\.math are set"):
        deployment_settings(load_config(str(both)), "math")
    old = tmp_path / "old.yaml"
    old.write_text("domains:\n  old_named: {max_turns: 3}\n")
    settings_module._WARNED_OLD_SECTION.discard("old_named")
    with caplog.at_level(logging.WARNING, logger="prorl_cli.node.settings"):
        assert deployment_settings(load_config(str(old)), "old_named") == (f"{old}: domains.old_named", {"max_turns": 3})
    assert f"{old}: domains.old_named is deprecated" in caplog.text


def test_a_config_built_without_a_file_keeps_the_default_name() -> None:
    assert deployment_settings(config_from_dict({}), "math") == ("prorl.yaml: handlers.math", None)
    assert "source" not in config_from_dict({}).to_dict()  # not a key: `prorl config show` and reloads stay as they were
