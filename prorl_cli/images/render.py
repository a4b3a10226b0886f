"""Rendering ``*.def.j2`` templates into Apptainer definition files.

Missing variables are errors (``StrictUndefined``); every template error is
reported as a :class:`ConfigError` naming the template, the line and, for an
undefined name, the variable.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2

from prorl_cli import __version__
from prorl_cli.exceptions import ConfigError
from prorl_cli.images.published import registry_host
from prorl_cli.images.spec import SAVED_KINDS, Base, ImageSpec
from prorl_cli.resources import data_dir

# Where recipes put what prorl adds to every image. (The tool server is not in images:
# every sandbox runtime binds prorl_cli/sandbox/toolserver.py at start.)
LOCKFILE_DIR = "/opt/prorl/lock"


def template_dirs(extra: Sequence[str | Path] = ()) -> list[Path]:
    """Where templates are looked up: ``extra`` first, then the shipped ``sif_recipes/``."""
    return [Path(p).expanduser().resolve() for p in extra] + [data_dir("sif_recipes")]


def host_debian_mirror(sources_dir: Path = Path("/etc/apt/sources.list.d"), sources_list: Path = Path("/etc/apt/sources.list")) -> str | None:
    """The Debian archive URI the host's apt uses (deb822 ``*.sources`` first, then one-line lists).

    Only a stanza whose suites include a plain release (no ``-security``) and
    whose URI ends in ``/debian`` counts, so security or third-party
    repositories are never taken for the Debian archive.
    """
    for f in sorted(sources_dir.glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", f.read_text(errors="replace")):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                k, _, v = line.partition(":")
                fields[k.strip().lower()] = v.strip()
            if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
                continue
            suites = fields.get("suites", "").split()
            for uri in fields.get("uris", "").split():
                if uri.rstrip("/").endswith("/debian") and any("-" not in s for s in suites):
                    return uri.rstrip("/")
    lists = [sources_list, *sorted(sources_dir.glob("*.list"))]
    for f in lists:
        if not f.is_file():
            continue
        for line in f.read_text(errors="replace").splitlines():
            parts = [p for p in line.split() if not p.startswith("[")] if line.startswith("deb ") else []
            if len(parts) >= 3 and parts[1].rstrip("/").endswith("/debian") and "-" not in parts[2]:
                return parts[1].rstrip("/")
    return None


def bootstrap_header(base: Base, *, base_path: Path | None, mirror: str | None, docker_registry: str | None, include: Sequence[str] = ()) -> str:
    """The definition's header lines for ``base`` (``base_path``: the built .sif of an ``image:`` base)."""
    if base.kind == "scratch":
        return "Bootstrap: scratch"
    if base.kind == "debootstrap":
        if not mirror:
            raise ConfigError(
                f"base {base}: no Debian mirror: set images.mirror in prorl.yaml, or configure one in /etc/apt/sources.list.d/"
            )
        lines = ["Bootstrap: debootstrap", f"OSVersion: {base.ref}", f"MirrorURL: {mirror}"]
        if include:
            lines.append("Include: " + " ".join(include))
        return "\n".join(lines)
    if base.kind == "docker":
        lines = ["Bootstrap: docker", f"From: {base.ref}"]
        # The mirror stands for Docker Hub: Apptainer puts it in front of From, so a reference that names its own
        # registry (127.0.0.1:5000/ns/img, a published image's) would become "MIRROR/127.0.0.1:5000/ns/img".
        if docker_registry and registry_host(base.ref) is None:
            lines.append(f"Registry: {docker_registry}")
        return "\n".join(lines)
    if base.kind in ("localimage", *SAVED_KINDS):
        return f"Bootstrap: {base.kind}\nFrom: {base.ref}"
    if base.kind == "image":
        assert base_path is not None, "an image: base needs the path of its built image"
        return f"Bootstrap: localimage\nFrom: {base_path}"
    raise ConfigError(f"unknown base kind {base.kind!r}")


def make_environment(dirs: Sequence[Path]) -> jinja2.Environment:
    """A Jinja environment over ``dirs`` that fails on undefined names."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in dirs]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # definition files are shell and text, not HTML
    )


def template_context(
    spec: ImageSpec, *, header: str, base_path: Path | None, mirror: str | None
) -> dict[str, Any]:
    """What a template sees: the image's variables at top level, plus prorl's names."""
    lockfile = None
    if spec.lockfile is not None:
        lockfile = {"src": str(spec.lockfile), "dst": f"{LOCKFILE_DIR}/{spec.lockfile.name}", "name": spec.lockfile.name}
    ctx: dict[str, Any] = dict(spec.variables)
    ctx.update(
        name=spec.name,
        bootstrap=header,
        base={"kind": spec.base.kind, "ref": spec.base.ref, "str": str(spec.base), "path": str(base_path) if base_path else None},
        mirror=mirror,
        files=[{"src": str(f.src), "dst": f.dst} for f in spec.files],
        lockfile=lockfile,
        prorl_version=__version__,
        variables=dict(spec.variables),
    )
    return ctx


def _template_line(exc: BaseException, filename: str | None) -> int | None:
    """The template line where a render-time error happened (Jinja rewrites tracebacks so frames carry template lines)."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if filename and tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def render_template(env: jinja2.Environment, template: str, context: dict[str, Any], *, image: str) -> str:
    """Render ``template``; a template error becomes a :class:`ConfigError` naming template, line and variable."""
    try:
        tmpl = env.get_template(template)
    except jinja2.TemplateNotFound as e:
        searched = getattr(env.loader, "searchpath", [])
        raise ConfigError(f"image {image}: template {e.name!r} not found (searched {', '.join(searched)})") from e
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"image {image}: template {e.filename or e.name or template}, line {e.lineno}: syntax error: {e.message}") from e
    try:
        return tmpl.render(**context)
    except jinja2.UndefinedError as e:
        line = _template_line(e, tmpl.filename)
        where = f"{tmpl.filename or template}" + (f", line {line}" if line else "")
        m = re.search(r"'([^']+)' is undefined", str(e))
        what = f"undefined variable {m.group(1)!r}" if m else str(e)
        raise ConfigError(f"image {image}: template {where}: {what} (set it under images.{image}.variables)") from e
    except jinja2.TemplateError as e:
        line = _template_line(e, tmpl.filename)
        where = f"{tmpl.filename or template}" + (f", line {line}" if line else "")
        raise ConfigError(f"image {image}: template {where}: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        # A filter or expression failed on a variable of the wrong type.
        line = _template_line(e, tmpl.filename)
        where = f"{tmpl.filename or template}" + (f", line {line}" if line else "")
        raise ConfigError(f"image {image}: template {where}: {type(e).__name__}: {e}") from e

