"""The ``images`` section of prorl.yaml (owned by the image builder)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ImagesConfig:
    """Where built images live."""

    cache_dir: str = "~/.prorl/images"
