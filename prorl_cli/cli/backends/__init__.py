import click


@click.group()
def backends() -> None:
    """Backends."""
