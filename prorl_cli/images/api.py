"""The Python entry points behind ``prorl build-images`` (also used by benchmarks)."""

from __future__ import annotations

import os
from pathlib import Path

from prorl_cli.exceptions import ConfigError
from prorl_cli.images.build import Builder, Event, Result
from prorl_cli.images.cache import Cache
from prorl_cli.images.plan import Plan, plan_images
from prorl_cli.images.render import host_debian_mirror
from prorl_cli.images.settings import ImagesConfig
from prorl_cli.images.spec import ImageSpec, load_image_specs
from prorl_cli.resources import data_dir

LOCAL_IMAGES_FILE = "images.yaml"


def images_file(settings: ImagesConfig) -> Path:
    """The image list: ``images.config_file``, else ``./images.yaml``, else the shipped ``sif_recipes/images.yaml``."""
    if settings.config_file:
        return Path(os.path.expandvars(os.path.expanduser(settings.config_file)))
    local = Path(LOCAL_IMAGES_FILE)
    return local if local.is_file() else data_dir("sif_recipes") / "images.yaml"


def load_specs(settings: ImagesConfig) -> dict[str, ImageSpec]:
    return load_image_specs(images_file(settings))


def plan(settings: ImagesConfig, names: list[str] | None, mode: str | None = None) -> tuple[list[Plan], Cache]:
    """Render and key ``names`` (all images when empty) and their bases; nothing is built."""
    specs = load_specs(settings)
    unknown = [n for n in names or [] if n not in specs]
    if unknown:
        raise ConfigError(f"unknown image(s) {unknown}; {images_file(settings)} defines {sorted(specs)}")
    cache = Cache(settings.cache_path)
    needs_mirror = any(s.base.kind == "debootstrap" for s in specs.values())
    mirror = settings.mirror or (host_debian_mirror() if needs_mirror else None)
    plans = plan_images(
        specs, list(names or specs), mode=mode or settings.mode, settings=settings,
        mirror=mirror, cache=cache,
    )
    return plans, cache


def build(settings: ImagesConfig, names: list[str] | None, mode: str | None = None, jobs: int | None = None,
          on_event: Event | None = None, on_plan: Event | None = None) -> list[Result]:
    """Make the images ready (reuse or build); returns one :class:`Result` per image, bases first."""
    plans, cache = plan(settings, names, mode)
    if on_plan is not None:
        for p in plans:
            on_plan(p.spec.name, f"{p.key}: {'reuse' if p.reuse else 'build'}: {'; '.join(p.reasons)}")
    builder = Builder(cache, apptainer=settings.apptainer, timeout_s=settings.build_timeout_s, on_event=on_event or (lambda n, m: None))
    return builder.run(plans, jobs or settings.jobs)
