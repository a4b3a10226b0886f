"""The ``images`` section of prorl.yaml (owned by the image builder).

Only site-wide settings live here; the list of images (templates, variables,
bases, copied files, lockfiles) is its own YAML file, ``images.config_file``,
read by :mod:`prorl_cli.images.spec`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from prorl_cli.exceptions import ConfigError

BuildMode = Literal["scratch", "versioned", "lock"]
BUILD_MODES: tuple[str, ...] = ("scratch", "versioned", "lock")


#: Where images live when nothing says: the default home's images folder.
DEFAULT_CACHE_DIR = "~/.prorl/images"


@dataclass
class ImagesConfig:
    """Where built images live and how ``prorl build-images`` builds them."""

    # None: <home>/images (home is PRORL_HOME, else ~/.prorl), filled in by the configuration it belongs to, so
    # that images (gigabytes) go where a cluster user pointed PRORL_HOME, not into a home folder under quota.
    cache_dir: str | None = None
    # The image list; None: ./images.yaml if present, else the shipped sif_recipes/images.yaml.
    config_file: str | None = None
    mode: BuildMode = "lock"
    # Debian mirror for debootstrap bases; None: the one the host's apt sources use.
    mirror: str | None = None
    # A registry the site mirrors docker:// bases from (rendered as the recipe's Registry:).
    docker_registry: str | None = None
    # Registries (HOST or HOST:PORT) served over plain HTTP: their docker:// pulls get --no-https.
    # Loopback hosts (127.0.0.0/8, ::1, localhost) always do.
    insecure_registries: list[str] = field(default_factory=list)
    # Extra template folders searched before the shipped sif_recipes/.
    recipe_dirs: list[str] = field(default_factory=list)
    # Folders of images built some other way (the provisioned test images, a site's shared images): an image
    # name NAME with no build in cache_dir is DIR/NAME.sif or the sandbox directory DIR/NAME, first found.
    search_dirs: list[str] = field(default_factory=list)
    apptainer: str = "apptainer"
    # Extra arguments for every `apptainer build` (images add their own in the image list).
    build_args: list[str] = field(default_factory=list)
    jobs: int = 1
    build_timeout_s: float = 3600.0
    # Keep a Dockerfile's `RUN --mount=type=cache` folders between builds (cache_dir/build-cache/UID/), as Docker
    # does; false: each such step starts from an empty folder.
    build_cache: bool = True
    # Secrets a Dockerfile's `RUN --mount=type=secret,id=ID` reads, by id: a host file, or env:NAME (a variable of
    # prorl's environment). Never part of a definition, a lock key or an image.
    build_secrets: dict[str, str] = field(default_factory=dict)
    # SSH agents a Dockerfile's `RUN --mount=type=ssh` (id default unless it names one) uses, by id: the agent's
    # socket, $VARS expanded when building ({default: $SSH_AUTH_SOCK} forwards yours, as `docker build --ssh default`).
    build_ssh: dict[str, str] = field(default_factory=dict)

    @property
    def cache_path(self) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(self.cache_dir or DEFAULT_CACHE_DIR)))

    def validate(self, where: str) -> None:
        """Range checks the generic type validation cannot express."""
        if self.jobs < 1:
            raise ConfigError(f"{where}.jobs: must be at least 1, got {self.jobs}")
        if self.build_timeout_s <= 0:
            raise ConfigError(f"{where}.build_timeout_s: must be positive")
        for name, ids in (("build_secrets", self.build_secrets), ("build_ssh", self.build_ssh)):
            for secret_id in ids:
                if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", secret_id):
                    raise ConfigError(f"{where}.{name}: {secret_id!r} is not an id (letters, digits, . _ -)")
        for secret_id, source in self.build_secrets.items():
            if source.startswith("env:") and not re.fullmatch(r"env:[A-Za-z_][A-Za-z0-9_]*", source):
                raise ConfigError(f"{where}.build_secrets.{secret_id}: {source!r}: env: takes a variable name")
