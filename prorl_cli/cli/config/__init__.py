import click


@click.group()
def config() -> None:
    """Config."""
