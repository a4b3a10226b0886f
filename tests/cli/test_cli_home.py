"""``--home DIR`` after the command means what ``prorl --home DIR`` before it does, on every command that reads
the home; the two naming different folders are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner, Result

from prorl_cli.cli import cli
from tests.harness import Deployment

#: Commands that read no home: they make files, check or read a given file, or simulate (quickstart has a
#: --home of its own, for the deployment it makes).
NO_HOME = {"quickstart", "dev", "config check", "trace", "inspect", "report", "plan"}


def _commands(group: click.Group, prefix: str = "") -> Iterator[tuple[str, click.Command]]:
    for name, cmd in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        if path in NO_HOME:
            continue
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, path + " ")
        else:
            yield path, cmd


COMMANDS = list(_commands(cli))


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    # PRORL_HOME and PRORL_DEPLOYMENT of the shell running the tests must not decide anything here.
    return CliRunner().invoke(cli, list(args), env={"PRORL_HOME": None, "PRORL_DEPLOYMENT": None, **(env or {})},
                              catch_exceptions=False)


def test_the_commands_that_read_the_home_are_found() -> None:
    names = {path for path, _ in COMMANDS}
    assert {"status", "submit", "results", "cancel", "stop", "sample", "eval", "top", "launch", "down", "scale", "logs",
            "render-sbatch", "serve broker", "serve node", "serve inference", "backends list", "backends reload",
            "config show", "init", "swe validate", "build-images", "images list", "images prune"} <= names


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[p for p, _ in COMMANDS])
def test_every_command_that_reads_the_home_takes_home_after_it(path: str, cmd: click.Command) -> None:
    """One declaration: the very option of ``prorl --home``, not a look-alike per command."""
    (home,) = [p for p in cmd.params if isinstance(p, click.Option) and "--home" in p.opts]
    (global_home,) = [p for p in cli.params if isinstance(p, click.Option) and "--home" in p.opts]
    assert home.callback is global_home.callback, f"prorl {path} --home is not home_option's"
    assert (home.help, home.multiple, home.expose_value) == (global_home.help, True, False)


def test_home_after_the_command_is_the_home_before_it(tmp_path: Path) -> None:
    home = tmp_path / "scratch"
    after = invoke("config", "show", "--home", str(home), "-d", "exp")
    before = invoke("--home", str(home), "config", "show", "-d", "exp")
    assert after.exit_code == 0, after.output
    assert after.output == before.output
    shown = yaml.safe_load(after.output)
    assert (shown["home"], shown["deployment"]) == (str(home), "exp")
    assert shown["images"]["cache_dir"] == str(home / "images")


def test_home_after_the_command_beats_prorl_home(tmp_path: Path) -> None:
    shown = yaml.safe_load(invoke("config", "show", "--home", str(tmp_path / "flag"),
                                  env={"PRORL_HOME": str(tmp_path / "env")}).output)
    assert shown["home"] == str(tmp_path / "flag")


def test_a_command_acts_on_the_deployment_under_the_home_given_after_it(tmp_path: Path) -> None:
    r = invoke("status", "--home", str(tmp_path), "-d", "ghost")
    assert r.exit_code == 1
    assert f"{tmp_path / 'ghost' / 'broker.json'}: no rendezvous file" in r.output
    listed = invoke("images", "list", "--home", str(tmp_path / "h"))
    assert listed.exit_code == 0, listed.output
    assert listed.output.strip() == f"no images in {tmp_path / 'h' / 'images'}", "the cache under that home"


@pytest.mark.parametrize("args", [
    ["--home", "{a}", "status", "--home", "{b}"],
    ["status", "--home", "{a}", "--home", "{b}"],
    ["--home", "{a}", "backends", "--home", "{a}", "list", "--home", "{b}"],
    ["--home", "{a}", "--home", "{b}", "status"],
], ids=["before-and-after", "twice-after", "group-and-subcommand", "twice-before"])
def test_two_homes_that_differ_are_refused(tmp_path: Path, args: list[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    r = invoke(*(arg.format(a=a, b=b) for arg in args))
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == f"error: --home {a} and --home {b} name different folders; give one of them"


def test_two_spellings_of_one_home_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = invoke("--home", str(tmp_path / "h"), "config", "show", "--home", "h/")
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.output)["home"] == str(tmp_path / "h"), "the first spelling is kept"


def test_prorl_status_finds_a_running_deployment_by_home_after_the_command(tmp_path: Path) -> None:
    """End to end, as a user types it: PRORL_HOME names another folder, --home after the command wins."""
    with Deployment(tmp_path / "home", "homeafter") as d:
        d.start_broker()
        env = {**os.environ, "PRORL_HOME": str(tmp_path / "elsewhere")}
        env.pop("PRORL_DEPLOYMENT", None)
        r = subprocess.run([sys.executable, "-m", "prorl_cli", "status", "homeafter", "--home", str(d.home), "--json"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["deployment"] == "homeafter"
