"""``prorl quickstart --task math|code|swe|search``: one task domain end to end on this machine.

Picks the sandbox runtime (Apptainer when installed, else bubblewrap with the
host's /usr, else the unisolated local runtime, each said out loud), builds
the domain's image on first use with ``prorl build-images`` (cached
afterwards; ``--image`` skips that), and takes instances from the dataset
shipped with the handler (for ``swe``: the tinycalc repository, made here).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli.cli.application import App

DOMAIN_TASKS = ("math", "code", "swe", "search")
#: The image each domain's sandboxes use (an entry of the shipped sif_recipes/images.yaml).
DOMAIN_IMAGES = {"math": "math", "code": "python", "swe": "swe"}
#: Short loops: the tiny model's turns are random and slow on a CPU.
QUICK_SETTINGS: dict[str, Any] = {"max_turns": 2, "max_tokens": 32}


@dataclass
class DomainPlan:
    """What the quickstart of one domain runs with."""

    task: str
    runtime: str
    image: str | None
    instances: list[Any]
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _runtime(task: str) -> tuple[str, list[str]]:
    if task == "search":
        return "local", ["search runs its tools on the node (no sandbox)"]
    if shutil.which("apptainer"):
        return "apptainer", []
    if shutil.which("bwrap"):
        return "bwrap", ["Apptainer is not installed: bubblewrap with the host's /usr as the image "
                         "(the host's python3 needs sympy for math, git and pytest for swe)"]
    return "local", ["neither Apptainer nor bubblewrap is installed: the LOCAL runtime, NO ISOLATION"]


def build_image(app: App, name: str, cache_dir: str) -> None:
    """``prorl build-images NAME`` in lock mode, its progress shown as it goes (a no-op once cached)."""
    app.console.print(f"  image [bold]{name}[/]: building on first use (minutes; cached in {cache_dir} afterwards)")
    cmd = [sys.executable, "-m", "prorl_cli", "build-images", "--mode", "lock", "--cache-dir", cache_dir, name]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT, start_new_session=True, check=False)
    if proc.returncode != 0:
        app.abort(f"building image {name!r} failed (exit {proc.returncode}); pass --image PATH to use a built one")


def plan_domain(app: App, task: str, home: Path, image: str | None, n_instances: int) -> DomainPlan:
    """The runtime, image, configuration and instances of a domain quickstart."""
    from prorl_cli.domains.datasets import load_instances, shipped_dataset

    runtime, notes = _runtime(task)
    settings: dict[str, Any] = dict(QUICK_SETTINGS)
    # Sandbox starts and test runs share this machine's CPUs with the model: a node whose heartbeats
    # are late by a few seconds is busy, not dead.
    config: dict[str, Any] = {"sandbox": {"runtime": runtime}, "broker": {"heartbeat_liveness": 20}}
    if runtime == "apptainer" and task != "search":
        if image is None:
            cache_dir = str(app.config.images.cache_path)
            build_image(app, DOMAIN_IMAGES[task], cache_dir)
            config["images"] = {"cache_dir": cache_dir}
            image = DOMAIN_IMAGES[task]
    elif runtime == "bwrap":
        image = image or "host"
    elif task != "search":
        image = None
    settings["image"] = image  # None: the runtime's default (the local runtime has no images)
    if image is not None:
        config["sandbox"]["image"] = image
    config["handlers"] = {task: settings}
    if task == "swe":
        from prorl_cli.domains.tinyrepo import make_tinyrepo

        repo_dir = home / "tinycalc"
        if repo_dir.exists():
            shutil.rmtree(repo_dir)
        repo = make_tinyrepo(repo_dir)
        instances = [{**repo.instance, "repo_path": str(repo.path)}]
        notes.append(f"swe: the tinycalc repository (made in {repo.path}) is cloned into each sandbox")
    else:
        instances = load_instances(task, shipped_dataset(task))[:n_instances]
    return DomainPlan(task, runtime, image, instances, config, notes)
