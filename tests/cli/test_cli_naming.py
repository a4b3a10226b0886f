"""One way to name a deployment: every command that acts on one takes ``-d/--deployment NAME``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from prorl_cli.cli import cli

#: Commands that act on no deployment: they build, make, check, read files or simulate (plan).
NO_DEPLOYMENT = {"quickstart", "build-images", "images", "dev", "config check", "trace", "inspect", "report", "plan"}


def _leaves(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        if path in NO_DEPLOYMENT or path.split()[0] in NO_DEPLOYMENT:
            continue
        out += _leaves(cmd, path + " ") if isinstance(cmd, click.Group) else [(path, cmd)]
    return out


LEAVES = _leaves(cli)


def test_the_commands_are_found() -> None:
    names = {path for path, _ in LEAVES}
    assert {"submit", "results", "status", "cancel", "stop", "backends list", "launch", "down", "scale",
            "render-sbatch", "serve node", "config show"} <= names


@pytest.mark.parametrize(("path", "cmd"), LEAVES, ids=[p for p, _ in LEAVES])
def test_every_command_that_takes_a_deployment_accepts_d_name(path: str, cmd: click.Command) -> None:
    opts = {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts}
    assert {"-d", "--deployment"} <= opts, f"prorl {path} has no -d/--deployment"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "PRORL_DEPLOYMENT"}
    return subprocess.run([sys.executable, "-m", "prorl_cli", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", [["down"], ["scale", "--nodes", "1"], ["logs", "nodes"]])
def test_slurm_commands_take_the_deployment_four_ways(tmp_path: Path, command: list[str]) -> None:
    """NAME, -d NAME after the command, prorl -d NAME before it, PRORL_DEPLOYMENT: each names it (this one was never
    launched, and the error names it); none at all says how to name one."""
    home = str(tmp_path)
    ways = [
        ([*command[:1], "ghost", *command[1:]], None) if command[0] != "logs" else (["logs", "nodes", "-d", "ghost"], None),
        ([*command, "-d", "ghost"], None),
        (["-d", "ghost", *command], None),
        (command, {"PRORL_DEPLOYMENT": "ghost"}),
    ]
    for args, env in ways:
        r = run("--home", home, *args, env=env)
        assert r.returncode == 1 and "'ghost' was not launched" in r.stderr, (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", home, *command], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k not in ("PRORL_DEPLOYMENT", "PRORL_CONFIG")})
    assert r.returncode != 0 and "name the deployment" in r.stderr, r.stderr
    # The prorl.yaml in use names it too (what `prorl init -d NAME` writes).
    (tmp_path / "prorl.yaml").write_text("deployment: ghost\n")
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", home, *command], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k not in ("PRORL_DEPLOYMENT", "PRORL_CONFIG")})
    assert r.returncode == 1 and "'ghost' was not launched" in r.stderr, r.stderr


@pytest.mark.parametrize(("path", "cmd"), LEAVES, ids=[p for p, _ in LEAVES])
def test_every_command_that_takes_a_deployment_takes_config_and_log_level_after_it(path: str, cmd: click.Command) -> None:
    """One declaration each: the very options of ``prorl --config`` and ``prorl --log-level``."""
    for flag in ("--config", "--log-level"):
        (after,) = [p for p in cmd.params if isinstance(p, click.Option) and flag in p.opts]
        (before,) = [p for p in cli.params if isinstance(p, click.Option) and flag in p.opts]
        assert after.callback is before.callback, f"prorl {path} {flag} is not the group's"


def _show(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    from click.testing import CliRunner

    r = CliRunner().invoke(cli, list(args), catch_exceptions=False, env={
        "PRORL_HOME": str(tmp_path / "home"), "PRORL_DEPLOYMENT": None, "PRORL_CONFIG": None, "PRORL_LOG_LEVEL": None,
        **(env or {})})
    return r.exit_code, r.output


def test_config_and_log_level_after_the_command_mean_what_they_mean_before_it(tmp_path: Path) -> None:
    import yaml

    conf = tmp_path / "w.yaml"
    conf.write_text("log_level: warning\ndeployment: fromfile\n")
    other = tmp_path / "other.yaml"
    other.write_text("deployment: other\n")
    after = _show(tmp_path, "config", "show", "--config", str(conf))
    assert after == _show(tmp_path, "--config", str(conf), "config", "show") and after[0] == 0, after
    assert yaml.safe_load(after[1])["deployment"] == "fromfile"
    # The flag beats $PRORL_CONFIG, after the command too.
    code, out = _show(tmp_path, "config", "show", "--config", str(other), env={"PRORL_CONFIG": str(conf)})
    assert code == 0 and yaml.safe_load(out)["deployment"] == "other", out
    code, out = _show(tmp_path, "--config", str(conf), "config", "show", "--config", str(other))
    assert code == 1 and f"--config {conf} and --config {other} name different files" in out, out
    after = _show(tmp_path, "config", "show", "--log-level", "debug")
    assert after == _show(tmp_path, "--log-level", "DEBUG", "config", "show") and after[0] == 0, after
    assert yaml.safe_load(after[1])["log_level"] == "DEBUG"
    code, out = _show(tmp_path, "--log-level", "info", "status", "t1", "--log-level", "debug")
    assert code == 1 and "--log-level" in out and "differ; give one of them" in out, out
    # The aliases log_level: and $PRORL_LOG_LEVEL take, the flag takes too; WARN and WARNING are one level.
    code, out = _show(tmp_path, "--log-level", "warn", "config", "show", "--log-level", "WARNING")
    assert code == 0 and yaml.safe_load(out)["log_level"] == "WARNING", out
    code, out = _show(tmp_path, "config", "show", "--log-level", "Fatal")
    assert code == 0 and yaml.safe_load(out)["log_level"] == "CRITICAL", out


@pytest.mark.parametrize(("command", "forms", "never"), [
    # logs' one positional argument is ROLE: the deployment is -d only.
    (["logs", "nodes[0]"], ["prorl logs -d NAME nodes[0]", "prorl -d NAME logs nodes[0]"], "prorl logs NAME"),
    (["down"], ["prorl down NAME", "prorl down -d NAME", "prorl -d NAME down"], None),
    (["scale", "--nodes", "1"], ["prorl scale NAME", "prorl scale -d NAME"], None),
], ids=["logs", "down", "scale"])
def test_with_no_deployment_named_the_hint_names_forms_the_command_takes(
        tmp_path: Path, command: list[str], forms: list[str], never: str | None) -> None:
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", str(tmp_path), *command], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if k not in ("PRORL_DEPLOYMENT", "PRORL_CONFIG")})
    (error,) = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and error.startswith("error: name the deployment: "), r.stderr
    for form in forms:
        assert form in error, error
    if never is not None:
        assert never not in error, error
    # Each form it names works: logs with -d finds the deployment (here: never launched, and says so).
    if command[0] == "logs":
        r = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", str(tmp_path), "logs", "-d", "ghost",
                            "nodes[0]"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert r.returncode == 1 and "'ghost' was not launched" in r.stderr, r.stderr
