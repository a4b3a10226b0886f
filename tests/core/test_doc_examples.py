"""Every configuration example in README.md and docs/*.md loads as written; the Python snippets use real API.

Examples are found, not listed: inline settings such as ``broker.curve: on``
(a dotted key under a config section, a colon, a value) and fenced ``yaml``
blocks whose top-level keys are config sections; fenced ``python`` blocks
are parsed and every ``client.<method>`` they call must exist on both clients.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from prorl_cli.client import AsyncRolloutClient, RolloutClient
from prorl_cli.config import ProrlConfig, config_from_dict, load_config

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SECTIONS = {f.name for f in dataclasses.fields(ProrlConfig)}
INLINE = re.compile(r"`([a-z_]+(?:\.[a-z_0-9]+)+): ([^`]+)`")
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def _inline_settings() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        for m in INLINE.finditer(doc.read_text()):
            key, value = m.group(1), m.group(2)
            if _is_config_key(key):
                found.append((f"{doc.name}:{key}", key, value))
    return found


def _is_config_key(dotted: str) -> bool:
    """Whether ``dotted`` names a setting of the config schema (not, say, a file name in an error message)."""
    obj: Any = ProrlConfig()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            return False
        obj = getattr(obj, part)
    return True


def _blocks(lang: str) -> list[tuple[str, str]]:
    return [
        (f"{doc.name}:{doc.read_text()[: m.start()].count(chr(10)) + 1}", m.group(2))
        for doc in DOCS
        for m in FENCE.finditer(doc.read_text())
        if m.group(1) == lang
    ]


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cur = out
    *parents, last = dotted.split(".")
    for p in parents:
        cur = cur.setdefault(p, {})
    cur[last] = value
    return out


INLINE_SETTINGS = _inline_settings()


def test_the_docs_have_config_examples_to_check() -> None:
    keys = {key for _, key, _ in INLINE_SETTINGS}
    assert "broker.curve" in keys, "the README's CURVE example is found"


@pytest.mark.parametrize(("where", "key", "value"), INLINE_SETTINGS, ids=[w for w, _, _ in INLINE_SETTINGS])
def test_an_inline_setting_loads_as_written(where: str, key: str, value: str) -> None:
    # As a user writes it in prorl.yaml: the value goes through YAML (``on`` becomes True there).
    data = yaml.safe_load(f"{key.split('.')[-1]}: {value}")
    cfg = config_from_dict(_nest(key, data[key.split(".")[-1]]), where)
    got: Any = cfg
    for part in key.split("."):
        got = getattr(got, part)
    assert got is not None


def test_curve_on_as_the_readme_writes_it_means_on(tmp_path: Path) -> None:
    f = tmp_path / "prorl.yaml"
    f.write_text("broker:\n  curve: on\n")
    assert load_config(f).broker.curve == "on"
    f.write_text("broker:\n  curve: off\n")
    assert load_config(f).broker.curve == "off"
    f.write_text("broker:\n  curve: true\n")
    assert load_config(f).broker.curve == "on"


YAML_BLOCKS = [(w, text) for w, text in _blocks("yaml") if set(yaml.safe_load(text) or {}) <= SECTIONS]


def test_every_yaml_config_block_loads() -> None:
    for where, text in YAML_BLOCKS:  # none today; a block added to the docs is checked from then on
        config_from_dict(yaml.safe_load(text), where)


def test_the_example_config_file_loads() -> None:
    load_config(REPO / "examples" / "prorl.yaml")


PY_BLOCKS = _blocks("python")


@pytest.mark.parametrize(("where", "text"), PY_BLOCKS, ids=[w for w, _ in PY_BLOCKS])
def test_a_python_snippet_uses_real_api(where: str, text: str) -> None:
    tree = ast.parse(text, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prorl_cli"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "client"
        ):
            for cls in (RolloutClient, AsyncRolloutClient):
                assert hasattr(cls, node.func.attr), f"{where}: {cls.__name__} has no {node.func.attr}()"


def _prorl_command_lines() -> list[tuple[str, str]]:
    """``prorl ...`` lines of the docs' bash blocks, comments stripped."""
    found = []
    for where, text in _blocks("bash"):
        for i, line in enumerate(text.splitlines()):
            line = line.split(" #", 1)[0].strip()
            if line.startswith("prorl "):
                found.append((f"{where}+{i + 1}", line))
    return found


PRORL_LINES = _prorl_command_lines()


def test_the_docs_have_prorl_commands_to_check() -> None:
    commands = {line.split()[1] for _, line in PRORL_LINES if not line.split()[1].startswith("-")}
    assert {"launch", "down", "scale"} <= commands, "the README's and docs/slurm.md's Slurm commands are found"


@pytest.mark.parametrize(("where", "line"), PRORL_LINES, ids=[w for w, _ in PRORL_LINES])
def test_a_prorl_command_in_the_docs_names_real_commands_and_options(where: str, line: str) -> None:
    """Every command, subcommand and option a doc line uses exists (placeholders like NAME are not run)."""
    import shlex

    import click

    from prorl_cli.cli import cli

    cmd: click.Command = cli
    takes_value = True
    pending_value = False
    for token in shlex.split(line)[1:]:
        token = token.strip("[]")
        if not token or token == "|" or token == "...":
            continue
        if token.startswith("-"):
            name = token.split("=", 1)[0]
            opt = next((p for p in cmd.params if isinstance(p, click.Option) and name in p.opts + p.secondary_opts), None)
            assert opt is not None, f"{where}: `{line}`: {cmd.name} has no option {name}"
            pending_value = not opt.is_flag and "=" not in token
            continue
        if pending_value:
            pending_value = False
            continue
        if isinstance(cmd, click.Group) and takes_value:
            sub = cmd.get_command(click.Context(cmd), token)
            assert sub is not None, f"{where}: `{line}`: no command {token!r} in {cmd.name}"
            cmd = sub
            continue
        takes_value = False  # an argument of the command: nothing further to look up
