import click


@click.command()
def submit() -> None:
    """Submit tasks."""


@click.command()
def status() -> None:
    """Status."""


@click.command()
def cancel() -> None:
    """Cancel."""


@click.command()
def stop() -> None:
    """Stop."""
