"""``prorl build-images`` and ``prorl images list|show|prune``.

Heavy imports (jinja2, the builder) happen inside the commands so ``prorl --help`` stays instant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.images.run import run_builds, size_text
from prorl_cli.cli.naming import home_option

MODES = ("scratch", "versioned", "lock")



@click.command("build-images")
@click.argument("names", nargs=-1)
@click.option("--mode", type=click.Choice(MODES), help="scratch: always rebuild; versioned: reuse while base and prorl version match; lock: reuse while the rendered recipe, lockfile and copied files hash the same. [default: images.mode, lock]")
@click.option("--cache-dir", metavar="DIR", help="Where images and manifest.json live. [default: images.cache_dir]")
@click.option("--jobs", "-j", type=click.IntRange(min=1), help="Builds at once. [default: images.jobs]")
@click.option("--images-file", "-f", metavar="FILE", help="Image list YAML. [default: images.config_file, ./images.yaml, shipped list]")
@click.option("--mirror", metavar="URL", help="Debian mirror for debootstrap bases. [default: the host's apt sources]")
@click.option("--dry-run", is_flag=True, help="Render and print the definitions, keys and decisions; build nothing "
                                              "(with --swe the dataset's recipes are still written to the cache: "
                                              "the keys are taken from them).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
@click.option("--swe", "swe_dataset", metavar="DATASET", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Build the images of a SWE dataset (JSONL/Parquet/JSON): per repository/version an environment and a repository layer; writes the repo_images map.")
@click.option("--base", metavar="REF", help="With --swe: the image environments start from (localimage:PATH, docker://REF, debootstrap:SUITE).")
@click.option("--wheels", type=click.Path(exists=True, file_okay=False, path_type=Path), help="With --swe: install pip_packages from this wheels folder only (offline).")
@click.option("--repos-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), help="With --swe: git repositories as DIR/owner__name or DIR/owner/name (rows without repo_path).")
@click.option("--map-out", type=click.Path(dir_okay=False, path_type=Path), help="With --swe: where to write the repo_images JSON map.")
@click.option("--images-from", metavar="docker://HOST/NS/TEMPLATE|DIR", help="With --swe: published per-instance images instead of building: pulled from a registry, named by TEMPLATE ({swebench}, {swesmith}, {swegym}, {swerebench}, or fields such as {id_1776}; docker://NS alone: SWE-bench's names), or DIR/<instance_id>.sif as is and DIR/<instance_id>.tar or OCI layout DIR/<instance_id>/ converted. See docs/images.md.")
@click.option("--format", "fmt", metavar="SOURCE",
              help="With --swe: the project DATASET's rows come from (as for prorl eval: swe-bench, swe-gym, swe-smith, "
                   "swe-rebench, nebius, swebench-task, prorl). [default: auto]")
@home_option
@pass_app
def build_images(app: App, names: tuple[str, ...], mode: str | None, cache_dir: str | None, jobs: int | None,
                 images_file: str | None, mirror: str | None, dry_run: bool, as_json: bool, swe_dataset: Path | None,
                 base: str | None, wheels: Path | None, repos_dir: Path | None, map_out: Path | None,
                 images_from: str | None, fmt: str | None) -> None:
    """Render sif_recipes templates and build the .sif images NAMES (default: all), or a SWE dataset's (--swe)."""
    app.override(images__mode=mode, images__cache_dir=cache_dir, images__jobs=jobs,
                 images__config_file=images_file, images__mirror=mirror)
    if swe_dataset is not None or base or wheels or repos_dir or map_out or images_from or fmt:
        from prorl_cli.cli.images.swe import build_swe

        if swe_dataset is None or names:
            app.abort("--base, --wheels, --repos-dir, --map-out, --images-from and --format go with --swe DATASET, "
                      "and --swe takes no NAMES")
        build_swe(app, swe_dataset, base, wheels, repos_dir, map_out, dry_run, as_json, images_from, fmt or "auto")
        return
    settings = app.config.images
    from prorl_cli.exceptions import ConfigError, ImageBuildError
    from prorl_cli.images import api

    console = app.err_console if as_json else app.console
    try:
        plans, cache = api.plan(settings, list(names))
    except (ConfigError, ImageBuildError) as e:
        app.abort(str(e))
    for p in plans:
        console.print(f"[bold]{p.spec.name}[/]: {p.mode} key [cyan]{p.key}[/] → {'reuse' if p.reuse else 'build'}: {escape('; '.join(p.reasons))}", soft_wrap=True)
    if dry_run:
        if as_json:
            click.echo(json.dumps([{"name": p.spec.name, "key": p.key, "mode": p.mode, "action": "would-reuse" if p.reuse else "would-build",
                                    "reasons": p.reasons, "path": str(p.path), "definition": p.definition, "inputs": p.inputs} for p in plans], indent=2))
        else:
            for p in plans:
                console.rule(f"{p.spec.name} ({p.spec.template}) → {p.path.name}")
                console.print(p.definition, markup=False, soft_wrap=True)
        return
    results = run_builds(app, plans, cache, settings, console)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    if any(r.action in ("failed", "skipped") for r in results):
        raise click.exceptions.Exit(1)


@click.group()
def images() -> None:
    """Inspect and prune built images (the cache's manifest.json)."""


def _cache(app: App, cache_dir: str | None) -> Any:
    from prorl_cli.images.cache import Cache

    app.override(images__cache_dir=cache_dir)
    return Cache(app.config.images.cache_path)


def _manifest(app: App, cache: Any) -> dict[str, Any]:
    from prorl_cli.exceptions import ConfigError

    try:
        data: dict[str, Any] = cache.read_manifest()
    except ConfigError as e:
        app.abort(str(e))
    return data


_cache_opt = click.option("--cache-dir", metavar="DIR", help="Image cache. [default: images.cache_dir]")


@images.command("list")
@_cache_opt
@click.option("--json", "as_json", is_flag=True, help="Print the manifest's current images as JSON.")
@home_option
@pass_app
def images_list(app: App, cache_dir: str | None, as_json: bool) -> None:
    """List the current image of each name."""
    cache = _cache(app, cache_dir)
    data = _manifest(app, cache)
    # Paths as `show` and `build-images` print them: one relative to the cache would be read against the cwd.
    current = {n: {**data["builds"][k], "path": str(cache.root / data["builds"][k]["path"]),
                   "definition": str(cache.root / data["builds"][k]["definition"])}
               for n, k in sorted(data["images"].items()) if k in data["builds"]}
    if as_json:
        click.echo(json.dumps(current, indent=2))
        return
    if not current:
        app.console.print(f"no images in {cache.root}", soft_wrap=True)
        return
    from rich.table import Table

    table = Table(title=str(cache.manifest_path))
    for col in ("name", "mode", "key", "base", "built", "size", "path"):
        table.add_column(col, overflow="fold")  # names and paths whole, never cut at 80 columns
    for name, e in current.items():
        exists = Path(e["path"]).is_file()
        table.add_row(name, e["mode"], e["key"], e["base"], e["built_at"], size_text(e["size_bytes"]),
                      e["path"] if exists else f"[red]{e['path']} (missing)[/]")
    app.console.print(table, soft_wrap=True)


@images.command("show")
@click.argument("name")
@_cache_opt
@click.option("--definition", is_flag=True, help="Also print the rendered definition it was built from.")
@home_option
@pass_app
def images_show(app: App, name: str, cache_dir: str | None, definition: bool) -> None:
    """Show the manifest entry of image NAME."""
    cache = _cache(app, cache_dir)
    entry = cache.current(name, _manifest(app, cache))
    if entry is None:
        app.abort(f"image {name!r} is not in {cache.manifest_path}")
    click.echo(json.dumps({**entry, "path": str(cache.root / entry["path"])}, indent=2))
    if definition:
        click.echo((cache.root / entry["definition"]).read_text())


@images.command("prune")
@_cache_opt
@click.option("--dry-run", is_flag=True, help="Say what would be removed.")
@click.option("--build-cache", is_flag=True,
              help="Also remove your kept RUN --mount=type=cache folders (CACHE/build-cache/UID/) no build holds now.")
@home_option
@pass_app
def images_prune(app: App, cache_dir: str | None, dry_run: bool, build_cache: bool) -> None:
    """Remove builds that are no image's current one, leftovers of killed builds, failed builds' logs, and entries
    whose file is gone."""
    from prorl_cli.images.prune import prune, prune_build_cache

    cache = _cache(app, cache_dir)
    _manifest(app, cache)
    removed = prune(cache, dry_run=dry_run)
    if build_cache:
        removed += prune_build_cache(cache, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for what in removed:
        app.console.print(f"{verb} {what}", soft_wrap=True)
    summary = f"{len(removed)} item(s) {'would be removed' if dry_run else 'removed'}"
    app.console.print(summary if removed else "nothing to prune", soft_wrap=True)
