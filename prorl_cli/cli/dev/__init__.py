"""``prorl dev``: developer helpers (the inference issue adds ``tiny-model``)."""

from __future__ import annotations

import click

from prorl_cli.cli.application import not_implemented


@click.group()
def dev() -> None:
    """Developer helpers."""


@dev.command("tiny-model")
@click.argument("directory")
def tiny_model(directory: str) -> None:
    """Make a tiny random Qwen2 model and tokenizer in DIRECTORY (not implemented yet)."""
    not_implemented("dev tiny-model", "issue: inference nodes")
