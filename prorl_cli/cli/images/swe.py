"""``prorl build-images --swe DATASET``: the images of a SWE dataset (see :mod:`prorl_cli.swe.images`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from prorl_cli.cli.application import App


def build_swe(app: App, dataset: Path, base: str | None, wheels: Path | None, repos_dir: Path | None,
              map_out: Path | None, dry_run: bool, as_json: bool, images_from: str | None = None,
              fmt: str = "auto") -> None:
    """Plan (and unless ``dry_run`` build) the dataset's images; write the ``repo_images`` map.

    ``fmt`` is the dataset's source format, as ``load_instances`` takes it (``auto``: told from the rows).
    """
    from prorl_cli.cli.common import dataset_errors
    from prorl_cli.cli.images.run import run_builds
    from prorl_cli.domains.datasets import load_instances
    from prorl_cli.exceptions import ConfigError, DatasetError, DomainError, ImageBuildError
    from prorl_cli.images.cache import Cache
    from prorl_cli.images.plan import plan_images
    from prorl_cli.images.render import host_debian_mirror
    from prorl_cli.images.spec import load_image_specs
    from prorl_cli.swe.images import check_git, plan_dataset, recipes_folder, write_map

    settings = app.config.images
    console = app.err_console if as_json else app.console
    try:
        rows = load_instances("swe", dataset, fmt)
        check_git()
    except dataset_errors() as e:
        app.abort(str(e))
    needs_base = not images_from and any(not (isinstance(r.get("image"), str) and r["image"]) for r in rows)
    if needs_base and not base:
        app.abort("--swe: give --base (the image the environments start from: localimage:/path/base.sif offline, "
                  "docker://python:3.11-slim online)")
    if wheels is not None and not any(wheels.glob("*.whl")):
        app.abort(f"--wheels {wheels}: no .whl files there")
    recipes = recipes_folder(dataset, settings.cache_path)
    try:
        plan = plan_dataset(rows, recipes, base or "scratch", wheels.resolve() if wheels else None,
                            repos_dir.resolve() if repos_dir else None, images_from=images_from)
    except (DatasetError, DomainError, ConfigError) as e:
        app.abort(str(e))
    for where, why in plan.problems.items():
        console.print(f"[bold]{escape(where)}[/]: [bold red]no image[/]: {escape(why)}", soft_wrap=True)
    out = map_out or recipes / "repo_images.json"
    if not plan.names:
        if plan.ready:
            mapping = write_map(out, {}, {}, plan.ready)
            console.print(f"repo_images ({len(mapping)} ready .sif) → {out}", soft_wrap=True)
            if plan.problems:
                raise click.exceptions.Exit(1)
            return
        app.abort(f"{dataset}: nothing to build")
    try:
        specs = load_image_specs(plan.images_file)
        cache = Cache(settings.cache_path)
        mirror = settings.mirror or (host_debian_mirror() if any(s.base.kind == "debootstrap" for s in specs.values())
                                     else None)
        plans = plan_images(specs, plan.names, mode=settings.mode, settings=settings, mirror=mirror, cache=cache)
    except (ConfigError, ImageBuildError) as e:
        app.abort(str(e))
    console.print(f"{dataset}: {len(plan.repo_images)} image(s) for {len(rows)} instance(s); "
                  f"{len(plans)} layer(s), recipes in {recipes}", soft_wrap=True)
    for p in plans:
        console.print(f"[bold]{p.spec.name}[/]: {p.mode} key [cyan]{p.key}[/] → {'reuse' if p.reuse else 'build'}: "
                      f"{escape('; '.join(p.reasons))}", soft_wrap=True)
    if dry_run:
        if as_json:
            click.echo(json.dumps([{"name": p.spec.name, "key": p.key, "action": "would-reuse" if p.reuse else "would-build",
                                    "path": str(p.path), "definition": p.definition} for p in plans], indent=2))
        else:
            for p in plans:
                console.rule(f"{p.spec.name} → {p.path.name}")
                console.print(p.definition, markup=False, soft_wrap=True)
        return
    results = run_builds(app, plans, cache, settings, console)
    paths = {r.name: r.path for r in results if r.action in ("built", "reused")}
    mapping = write_map(out, plan.repo_images, paths, plan.ready)
    failed: dict[str, Any] = {r.name: r.log for r in results if r.action in ("failed", "skipped")}
    console.print(f"repo_images ({len(mapping)}/{len(plan.repo_images) + len(plan.ready)}) → {out}; use it as domains.swe.repo_images",
                  soft_wrap=True)
    for name, log in failed.items():
        console.print(f"[bold]{name}[/]: [bold red]not built[/]; build log: {log}", soft_wrap=True)
    if as_json:
        click.echo(json.dumps({"results": [r.to_dict() for r in results], "repo_images": mapping,
                               "problems": plan.problems}, indent=2))
    if failed or plan.problems:
        raise click.exceptions.Exit(1)
