"""``prorl quickstart --task math|code|swe|search``: one task domain end to end on this machine.

Picks the sandbox runtime (Apptainer when installed, else bubblewrap with the
host's /usr, else the unisolated local runtime, each said out loud), builds
the domain's image on first use with ``prorl build-images`` (cached
afterwards; ``--image`` skips that), and takes instances from the dataset
shipped with the handler (for ``swe``: the tinycalc repository, made here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
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


def check_image(app: App, image: str, cache_dir: str, search_dirs: Sequence[str]) -> str:
    """``--image`` as the node will take it, checked before anything starts: a path (made absolute, since the
    node runs in another folder) that exists, ``host``, or a name that a build or a search folder provides.

    A wrong one is refused here, naming what to change, rather than failing every job of the run in INIT.
    """
    if image == "host":
        return image
    if os.sep in image or image.endswith(".sif"):  # the node's rule for a path rather than a name
        path = Path(image).expanduser().resolve()
        if not path.exists():
            app.abort(f"--image {image}: no such file or folder; give a built .sif or sandbox folder, or an image "
                      "name (prorl images list)")
        return str(path)
    from prorl_cli.exceptions import ImageBuildError
    from prorl_cli.images import resolve_image

    try:
        resolve_image(image, cache_dir, search_dirs)
    except ImageBuildError as e:
        app.abort(f"--image {image}: {e}")
    return image


def plan_domain(app: App, task: str, home: Path, image: str | None, n_instances: int) -> DomainPlan:
    """The runtime, image, configuration and instances of a domain quickstart."""
    from prorl_cli.domains.datasets import load_instances, shipped_dataset

    runtime, notes = _runtime(task)
    if image is not None and task == "search":
        app.abort(f"--image {image}: --task search starts no sandbox (its tools run on the node), so it takes no "
                  "image: drop --image")
    settings: dict[str, Any] = dict(QUICK_SETTINGS)
    # Sandbox starts and test runs share this machine's CPUs with the model: a node whose heartbeats
    # are late by a few seconds is busy, not dead.
    config: dict[str, Any] = {"sandbox": {"runtime": runtime}, "broker": {"heartbeat_liveness": 20}}
    if runtime in ("apptainer", "bwrap") and task != "search":
        # The embedded deployment has a home of its own: its node finds image names where the user's do
        # (`prorl build-images NAME` builds into the user's cache), not in an empty cache in the output folder.
        cache_dir = str(app.config.images.cache_path)
        config["images"] = {"cache_dir": cache_dir, "search_dirs": list(app.config.images.search_dirs)}
        if image is not None:
            image = check_image(app, image, cache_dir, app.config.images.search_dirs)
        elif runtime == "apptainer":
            build_image(app, DOMAIN_IMAGES[task], cache_dir)
            image = DOMAIN_IMAGES[task]
        else:
            image = "host"
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
