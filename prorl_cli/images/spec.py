"""The image list: a YAML file naming each image's template, base, variables and inputs.

Example (``examples/images.yaml``)::

    images:
      base:
        template: base.def.j2
        base: debootstrap:bookworm
        variables: {include: [python3]}
      python:
        template: python.def.j2
        base: image:base            # another image of this list, built first
        lockfile: requirements.txt  # relative to this file
        files:
          - {src: data/, dst: /opt/data}

Bases: ``debootstrap:SUITE``, ``docker://REF``, ``localimage:PATH`` (or a
path ending in ``.sif``), ``image:NAME`` (an image of this list),
``scratch``, and images saved on disk: ``oci:DIR`` (an OCI layout),
``oci-archive:PATH`` (one as a tar) and ``docker-archive:PATH`` (``docker
save``'s tar). Users add images with their own templates (``template`` may be a
path relative to this file) without touching prorl.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prorl_cli import yamlfiles
from prorl_cli.exceptions import ConfigError

BASE_KINDS = ("debootstrap", "docker", "localimage", "image", "scratch", "oci", "oci-archive", "docker-archive")
#: Bases that are an image saved on disk (a path, converted by Apptainer's bootstrap agent of the same name).
SAVED_KINDS = ("oci", "oci-archive", "docker-archive")


@dataclass(frozen=True)
class FileCopy:
    """One host file or folder copied into the image (``src`` is absolute after loading)."""

    src: Path
    dst: str


@dataclass(frozen=True)
class Base:
    """Where an image starts from."""

    kind: str  # one of BASE_KINDS
    ref: str  # suite, docker reference, absolute .sif, layout or archive path, image name, or ""

    def __str__(self) -> str:
        if self.kind == "scratch":
            return "scratch"
        if self.kind == "docker":
            return f"docker://{self.ref}"
        return f"{self.kind}:{self.ref}"


@dataclass
class ImageSpec:
    """One entry of the image list."""

    name: str
    template: str
    base: Base
    variables: dict[str, Any] = field(default_factory=dict)
    files: list[FileCopy] = field(default_factory=list)
    lockfile: Path | None = None
    build_args: list[str] = field(default_factory=list)
    description: str = ""
    source: Path | None = None  # the YAML file it came from
    # A Dockerfile's other stages: the base for an image reference that a FROM or COPY --from names.
    stage_bases: dict[str, Base] = field(default_factory=dict)

    @property
    def depends_on(self) -> str | None:
        """The image of this list that the entry's ``base`` names, if any."""
        return self.base.ref if self.base.kind == "image" else None

    @property
    def dependencies(self) -> list[str]:
        """Every image of this list built before this one: its base's, then its stages' bases'."""
        deps = [self.depends_on] if self.depends_on else []
        return list(dict.fromkeys(deps + [b.ref for b in self.stage_bases.values() if b.kind == "image"]))


_KEYS = {"template", "base", "variables", "files", "lockfile", "build_args", "description", "stage_bases"}


def is_dockerfile(template: str) -> bool:
    """Whether an image entry's ``template`` names a Dockerfile rather than a Jinja definition."""
    name = Path(template).name
    return name == "Dockerfile" or name.startswith("Dockerfile.") or name.lower().endswith(".dockerfile")


def stage_base(ref: str, stage_bases: dict[str, Base]) -> Base:
    """The base a Dockerfile's other stage bootstraps for the image reference ``ref`` (a ``FROM``'s or a
    ``COPY --from``'s): the entry's ``stage_bases`` for it, else Docker's empty ``scratch`` or ``docker://ref``."""
    return stage_bases.get(ref) or (Base("scratch", "") if ref == "scratch" else Base("docker", ref))


def parse_base(value: Any, where: str, root: Path) -> Base:
    """Parse a base reference string (see the module docstring)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: expected a base such as 'debootstrap:bookworm', 'docker://python:3.11-slim', 'localimage:/path/x.sif', 'oci-archive:/path/x.tar', 'image:NAME' or 'scratch', got {value!r}")
    value = value.strip()
    if value == "scratch":
        return Base("scratch", "")
    if value.startswith("docker://"):
        ref = value[len("docker://"):]
        if not ref:
            raise ConfigError(f"{where}: docker:// needs an image reference")
        return Base("docker", ref)
    kind, sep, ref = value.partition(":")
    if sep and kind in ("debootstrap", "image", "localimage", *SAVED_KINDS):
        if not ref:
            raise ConfigError(f"{where}: {kind}: needs a value after the colon")
        if kind == "localimage" or kind in SAVED_KINDS:
            return Base(kind, str(_resolve(ref, root)))
        return Base(kind, ref)
    if value.endswith(".sif"):
        return Base("localimage", str(_resolve(value, root)))
    raise ConfigError(f"{where}: unknown base {value!r}; use one of debootstrap:SUITE, docker://REF, localimage:PATH, "
                      "oci:DIR, oci-archive:PATH, docker-archive:PATH, image:NAME, scratch")


def _resolve(path: str, root: Path) -> Path:
    p = Path(os.path.expandvars(os.path.expanduser(path)))
    return p if p.is_absolute() else (root / p).resolve()


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {type(value).__name__} {value!r}")
    return value


def _files(value: Any, where: str, root: Path) -> list[FileCopy]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of {{src, dst}} mappings or 'src:dst' strings")
    out = []
    for i, item in enumerate(value):
        w = f"{where}[{i}]"
        if isinstance(item, str):
            src, sep, dst = item.partition(":")
            if not sep:
                raise ConfigError(f"{w}: expected 'src:dst', got {item!r}")
        elif isinstance(item, dict):
            unknown = sorted(set(item) - {"src", "dst"})
            if unknown:
                raise ConfigError(f"{w}: unknown key(s) {unknown}; known keys: ['dst', 'src']")
            src, dst = _str(item.get("src"), f"{w}.src"), _str(item.get("dst"), f"{w}.dst")
        else:
            raise ConfigError(f"{w}: expected a {{src, dst}} mapping or 'src:dst', got {item!r}")
        if not dst.startswith("/"):
            raise ConfigError(f"{w}.dst: must be an absolute path inside the image, got {dst!r}")
        path = _resolve(src, root)
        if not path.exists():
            raise ConfigError(f"{w}.src: {path} does not exist")
        out.append(FileCopy(path, dst))
    return out


def parse_image(name: str, data: Any, where: str, root: Path, source: Path | None) -> ImageSpec:
    """Validate one entry; errors name ``where`` (file and key)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(_KEYS)}")
    for required in ("template", "base"):
        if required not in data:
            raise ConfigError(f"{where}: missing required key {required!r}")
    template = _str(data["template"], f"{where}.template")
    variables = data.get("variables") or {}
    if not isinstance(variables, dict) or not all(isinstance(k, str) for k in variables):
        raise ConfigError(f"{where}.variables: expected a mapping of names to values, got {variables!r}")
    lockfile = None
    if data.get("lockfile") is not None:
        lockfile = _resolve(_str(data["lockfile"], f"{where}.lockfile"), root)
        if not lockfile.is_file():
            raise ConfigError(f"{where}.lockfile: {lockfile} is not a file")
    build_args = data.get("build_args") or []
    if not isinstance(build_args, list) or not all(isinstance(a, str) for a in build_args):
        raise ConfigError(f"{where}.build_args: expected a list of strings, got {build_args!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{where}.description: expected a string")
    stage_bases = data.get("stage_bases") or {}
    if not isinstance(stage_bases, dict) or not all(isinstance(k, str) and k for k in stage_bases):
        raise ConfigError(f"{where}.stage_bases: expected a mapping of image references (as a Dockerfile's FROM or "
                          f"COPY --from names them) to bases, got {stage_bases!r}")
    if stage_bases and not is_dockerfile(template):
        raise ConfigError(f"{where}.stage_bases: only a Dockerfile template has other stages; {template} is not one")
    return ImageSpec(
        name=name,
        template=template,
        base=parse_base(data["base"], f"{where}.base", root),
        variables=dict(variables),
        files=_files(data.get("files"), f"{where}.files", root),
        lockfile=lockfile,
        build_args=list(build_args),
        description=description,
        source=source,
        stage_bases={ref: parse_base(b, f"{where}.stage_bases.{ref}", root) for ref, b in stage_bases.items()},
    )


def load_image_specs(path: str | os.PathLike[str]) -> dict[str, ImageSpec]:
    """Read and validate an image list file; relative paths in it are relative to the file."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{file}: image config not found")
    try:
        data = yamlfiles.load(file.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: not valid YAML: {e}") from e
    return specs_from_dict(data, file)


def specs_from_dict(data: Any, file: Path) -> dict[str, ImageSpec]:
    """Validate an already parsed image list (``file`` names it in errors and anchors paths)."""
    if not isinstance(data, dict) or set(data) - {"images"}:
        raise ConfigError(f"{file}: top level must be a mapping with one key 'images'")
    images = data.get("images")
    if not isinstance(images, dict) or not images:
        raise ConfigError(f"{file}: images: expected a non-empty mapping of image names to entries")
    root = file.resolve().parent
    specs: dict[str, ImageSpec] = {}
    for name, entry in images.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise ConfigError(f"{file}: images: {name!r} is not a valid image name")
        specs[name] = parse_image(name, entry, f"{file}: images.{name}", root, file)
    for spec in specs.values():
        for dep in spec.dependencies:
            if dep not in specs:
                key = "base" if dep == spec.depends_on else "stage_bases"
                raise ConfigError(f"{file}: images.{spec.name}.{key}: image:{dep} is not in this image list "
                                  f"(known: {sorted(specs)})")
    build_order(specs, list(specs))  # raises on a cycle
    return specs


def build_order(specs: dict[str, ImageSpec], names: list[str]) -> list[str]:
    """``names`` plus the images they start from, dependencies first; raises on a cycle."""
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, chain: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ConfigError(f"image base cycle: {' -> '.join([*chain, name])}")
        if name not in specs:
            raise ConfigError(f"unknown image {name!r}; known: {sorted(specs)}")
        state[name] = "visiting"
        for dep in specs[name].dependencies:
            visit(dep, [*chain, name])
        state[name] = "done"
        order.append(name)

    for n in names:
        visit(n, [])
    return order
