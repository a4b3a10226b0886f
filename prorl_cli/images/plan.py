"""Planning: render every requested image, compute its cache key and say why it is reused or rebuilt."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli import __version__
from prorl_cli.exceptions import ConfigError
from prorl_cli.images.cache import Cache, cache_key, changed_inputs, sha256_file, sha256_path
from prorl_cli.images.dockerfile import convert_dockerfile, find_dockerfile
from prorl_cli.images.dockerfile_mounts import BuildMounts, CacheMount
from prorl_cli.images.published import plain_http, saved_image_digest
from prorl_cli.images.render import (
    bootstrap_header,
    make_environment,
    render_template,
    template_context,
    template_dirs,
)
from prorl_cli.images.settings import BUILD_MODES, ImagesConfig
from prorl_cli.images.spec import (
    SAVED_KINDS,
    Base,
    ImageSpec,
    build_order,
    is_dockerfile,
    stage_base,
)


@dataclass
class Plan:
    """One image to make ready: its rendered definition, key, and the reuse decision."""

    spec: ImageSpec
    mode: str
    key: str
    inputs: dict[str, Any]
    definition: str
    path: Path
    base_path: Path | None
    build_args: list[str]
    reuse: bool = False
    reasons: list[str] = field(default_factory=list)
    # A Dockerfile's kept cache mounts: the builder binds each one's host folder (not part of the key).
    caches: list[CacheMount] = field(default_factory=list)
    # The secrets it reads, by id: a host file or env:NAME (images.build_secrets; not part of the key).
    secrets: dict[str, str] = field(default_factory=dict)
    ssh: dict[str, str] = field(default_factory=dict)  # the SSH agents its steps use, by id (images.build_ssh)


def versioned_inputs(spec: ImageSpec, base_ref: str) -> dict[str, Any]:
    """What a versioned key covers: the image, its base reference and the prorl version."""
    return {"name": spec.name, "base": base_ref, "prorl_version": __version__}


def _files_inputs(spec: ImageSpec) -> dict[str, str]:
    """The hash of each copied file or folder, by destination.

    Several copies into one folder (a Dockerfile's ``COPY src/ /app/`` and
    ``COPY tests/ /app/``) share a destination: each after the first gets its
    own ``DST#N`` entry, so a change to any of them moves the key (the first
    keeps the plain name, so keys without such copies are unchanged).
    """
    out: dict[str, str] = {}
    for f in spec.files:
        name, n = f.dst, 1
        while name in out:
            n += 1
            name = f"{f.dst}#{n}"
        out[name] = sha256_path(f.src)
    return out


def lock_inputs(spec: ImageSpec, definition: str, build_args: list[str], base_ref: str) -> dict[str, Any]:
    """What a lock key covers: the rendered definition, the lockfile and every copied file's bytes."""
    import hashlib

    inputs: dict[str, Any] = {
        "name": spec.name,
        "base": base_ref,
        "definition": hashlib.sha256(definition.encode()).hexdigest(),
        "files": _files_inputs(spec),
        "lockfile": sha256_file(spec.lockfile) if spec.lockfile else None,
        "build_args": build_args,
    }
    digest = _image_digest(spec.base)
    if digest is not None:  # same path, new bytes: a lock build must notice
        inputs["base_image"] = digest
    return inputs


def _image_digest(base: Base) -> str | None:
    """The bytes of a base that is an image on disk, as a digest ("missing" for a .sif not there); None for others."""
    if base.kind == "localimage":
        return sha256_file(Path(base.ref)) if Path(base.ref).is_file() else "missing"
    if base.kind in SAVED_KINDS:
        return saved_image_digest(base.kind, Path(base.ref))
    return None


def plan_images(
    specs: dict[str, ImageSpec],
    names: list[str],
    *,
    mode: str,
    settings: ImagesConfig,
    mirror: str | None,
    cache: Cache,
) -> list[Plan]:
    """Plans for ``names`` and the images they start from, dependencies first."""
    if mode not in BUILD_MODES:
        raise ConfigError(f"unknown build mode {mode!r}; use one of {list(BUILD_MODES)}")
    # Templates next to the image list win, then images.recipe_dirs, then the shipped sif_recipes/.
    sources = sorted({s.source.parent for s in specs.values() if s.source is not None})
    env = make_environment(template_dirs([*sources, *settings.recipe_dirs]))
    manifest = cache.read_manifest()
    plans: dict[str, Plan] = {}
    for name in build_order(specs, names):
        spec = specs[name]
        dep = plans.get(spec.depends_on) if spec.depends_on else None
        base_path = dep.path if dep else None
        # An image: base is referenced by its dependency's key, so a rebuilt base rebuilds its dependents.
        base_ref = f"image:{spec.base.ref}@{dep.key}" if dep else str(spec.base)
        include = spec.variables.get("include", [])
        if not isinstance(include, list):
            raise ConfigError(f"image {name}: variables.include: expected a list of Debian packages, got {include!r}")
        header = bootstrap_header(spec.base, base_path=base_path, mirror=mirror, docker_registry=settings.docker_registry, include=include)
        if is_dockerfile(spec.template):
            # A Dockerfile recipe (spython converts it); what it COPYs counts toward the lock key.
            conversion = convert_dockerfile(
                find_dockerfile(spec.template, [*sources, *(Path(d) for d in settings.recipe_dirs)]),
                spec, header=header, prorl_version=__version__,
                stage_header=functools.partial(_stage_header, spec, plans, mirror, settings.docker_registry),
                mounts=BuildMounts(settings.build_cache, frozenset(settings.build_secrets), frozenset(settings.build_ssh)),
            )
            definition, stage_images, caches = conversion.definition, conversion.stage_images, conversion.caches
            secrets = {secret_id: settings.build_secrets[secret_id] for secret_id in conversion.secrets}
            ssh = {agent_id: settings.build_ssh[agent_id] for agent_id in conversion.ssh}
            spec = dataclasses.replace(spec, files=[*spec.files, *conversion.files])
        else:
            stage_images, caches, secrets, ssh = [], [], {}, {}
            ctx = template_context(spec, header=header, base_path=base_path, mirror=mirror)
            definition = render_template(env, spec.template, ctx, image=name)
        build_args = [*settings.build_args, *spec.build_args]
        pulled = [b.ref for b in (spec.base, *(stage_base(ref, spec.stage_bases) for ref in stage_images))
                  if b.kind == "docker"]
        if any(plain_http(ref, settings.insecure_registries) for ref in pulled) and "--no-https" not in build_args:
            build_args.append("--no-https")
        if mode == "versioned":
            inputs = versioned_inputs(spec, base_ref)
        else:  # scratch keys are the lock key's inputs: they name what was built, though never reused
            inputs = lock_inputs(spec, definition, build_args, base_ref)
        if spec.stage_bases:  # only then: the keys of every other image stay as they were
            inputs["stage_bases"] = {ref: _base_input(b, plans) for ref, b in sorted(spec.stage_bases.items())}
        key = cache_key(mode, inputs)
        plan = Plan(spec, mode, key, inputs, definition, cache.image_path(name, key), base_path, build_args,
                    caches=caches, secrets=secrets, ssh=ssh)
        decide(plan, cache, manifest, rebuilt_deps={p.spec.name for p in plans.values() if not p.reuse})
        plans[name] = plan
    return list(plans.values())


def _stage_header(spec: ImageSpec, plans: dict[str, Plan], mirror: str | None, docker_registry: str | None,
                  ref: str) -> str:
    """The bootstrap lines of a Dockerfile stage that starts from ``ref`` (see :func:`stage_base`)."""
    base = stage_base(ref, spec.stage_bases)
    path = plans[base.ref].path if base.kind == "image" else None
    return bootstrap_header(base, base_path=path, mirror=mirror, docker_registry=docker_registry)


def _base_input(base: Base, plans: dict[str, Plan]) -> str:
    """What a lock key records of a stage's base: an image of the list by its key, an image on disk by its bytes."""
    if base.kind == "image":
        return f"image:{base.ref}@{plans[base.ref].key}"
    digest = _image_digest(base)
    return str(base) if digest is None else f"{base}@{digest}"


def decide(plan: Plan, cache: Cache, manifest: dict[str, Any], rebuilt_deps: set[str] | None = None) -> None:
    """Set ``plan.reuse`` and ``plan.reasons`` from the manifest (re-checked under the key's lock before building)."""
    name, mode, key = plan.spec.name, plan.mode, plan.key
    entry = manifest["builds"].get(key)
    if mode == "scratch":
        plan.reuse, plan.reasons = False, ["scratch mode always rebuilds"]
        return
    if entry is not None and plan.path.is_file():
        covered = "base reference and prorl version" if mode == "versioned" else "rendered definition, lockfile and copied files"
        plan.reuse = True
        plan.reasons = [f"{mode} key matches the image built {entry.get('built_at', '?')} (same {covered})"]
        return
    plan.reuse = False
    if entry is not None:
        plan.reasons = [f"the manifest lists {key} but {plan.path} is missing"]
        return
    if plan.path.is_file():
        plan.reasons = ["a finished image for this key exists without a manifest entry; it will be adopted"]
        plan.reuse = True
        return
    previous = cache.latest_build(name, mode, manifest)
    if previous is None:
        plan.reasons = [f"no {mode} build of {name} in the cache"]
        return
    changed = changed_inputs(previous.get("inputs", {}), plan.inputs)
    plan.reasons = [f"changed since {previous['key']}: {', '.join(changed) or 'cache key format'}"]
    for dep in plan.spec.dependencies:
        if rebuilt_deps and dep in rebuilt_deps:
            plan.reasons.append(f"base image {dep} is rebuilt")
