"""``prorl build-images`` and ``prorl images`` (the image builder's issue fills these in)."""

from __future__ import annotations

import click

from prorl_cli.cli.application import not_implemented


@click.command("build-images", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def build_images(args: tuple[str, ...]) -> None:
    """Render sif_recipes and build .sif images (not implemented yet)."""
    not_implemented("build-images", "issue: prorl build-images")


@click.group()
def images() -> None:
    """Inspect and prune built images (not implemented yet)."""


@images.command("list")
def images_list() -> None:
    """List built images."""
    not_implemented("images list", "issue: prorl build-images")
