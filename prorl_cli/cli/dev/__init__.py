"""``prorl dev``: developer helpers."""

from __future__ import annotations

import click


@click.group()
def dev() -> None:
    """Developer helpers."""


@dev.command("tiny-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--vocab-size", type=int, default=4096, show_default=True, help="BPE vocabulary size (before special tokens).")
def tiny_model(directory: str, seed: int, vocab_size: int) -> None:
    """Make a tiny random Qwen2 model and a BPE tokenizer in DIRECTORY, offline.

    The tokenizer is trained on the Python standard library's sources and has
    a ChatML chat template with Hermes tool calls. Works with vLLM and the
    transformers engine; any local Hugging Face model directory can replace it.
    """
    import time

    from prorl_cli.inference.tiny_model import make_tiny_model

    t0 = time.monotonic()
    try:
        out = make_tiny_model(directory, seed=seed, vocab_size=vocab_size)
    except ImportError as e:
        raise click.ClickException(f"tiny-model needs torch: pip install 'prorl[cpu]' ({e})") from e
    click.echo(f"tiny model written to {out} in {time.monotonic() - t0:.1f} s")
