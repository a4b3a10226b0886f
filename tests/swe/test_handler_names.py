"""A subclass of the swe handler is its own task and reads ``domains.swe`` unless it says otherwise."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from prorl_cli.config import config_from_dict
from prorl_cli.node.registry import discover

AGENT = '''
from prorl_cli.handlers.swe_domain import SweHandler


class MyAgentHandler(SweHandler):
    """Another agent on the same grading."""


class OwnSettingsHandler(SweHandler):
    name = "swe_own"
    settings_section = "swe_own"
'''


def test_subclasses_get_their_own_names_and_share_the_swe_settings(tmp_path: Path) -> None:
    (tmp_path / "my_agent.py").write_text(AGENT)
    registry = discover([str(tmp_path)])
    assert registry.errors == []  # no "task 'swe' is defined twice"
    assert {"swe", "swe_oracle", "my_agent", "swe_own"} <= set(registry.tasks)
    config = config_from_dict({"handlers": {"swe": {"test_timeout_s": 42.0}, "swe_own": {"test_timeout_s": 7.0}}})

    def timeout_of(task: str) -> float:
        ctx = SimpleNamespace(state={}, instance={}, config=config, job_id="j1")
        return float(registry.get(task)().settings_for(ctx).get("test_timeout_s"))  # type: ignore[attr-defined]

    assert timeout_of("my_agent") == 42.0 and timeout_of("swe_oracle") == 42.0 and timeout_of("swe") == 42.0
    assert timeout_of("swe_own") == 7.0
