"""Where prorl's shipped data folders are: inside the wheel, or beside a source checkout."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
DATA_DIRS = ("handlers", "slurm_templates", "sif_recipes")


def data_dir(name: str) -> Path:
    """The folder ``name`` (one of :data:`DATA_DIRS`).

    An installed wheel carries them as package data under ``prorl_cli/``; an
    editable install or a source checkout has them at the repository root.
    """
    if name not in DATA_DIRS:
        raise ValueError(f"unknown data folder {name!r}; known: {DATA_DIRS}")
    inside = _PACKAGE_DIR / name
    if inside.is_dir():
        return inside
    return _PACKAGE_DIR.parent / name
