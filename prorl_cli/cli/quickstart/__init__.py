import click


@click.command()
def quickstart() -> None:
    """Quickstart."""
