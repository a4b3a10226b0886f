"""Published per-instance images: naming templates, images saved on disk, and plain-HTTP registries.

``build-images --swe DATASET --images-from SOURCE`` gives every instance an
image someone already built instead of building one:

- ``docker://HOST/NAMESPACE/TEMPLATE``: pulled from a registry. ``TEMPLATE``
  names each instance's image with the fields of :data:`FIELDS` or one of the
  naming schemes of :data:`SCHEMES` (``{swebench}``, ``{swesmith}``,
  ``{swegym}``, ``{swerebench}``), e.g.
  ``docker://127.0.0.1:5000/swebench/{swebench}`` or
  ``docker://mirror.example/ns/sweb.eval.x86_64.{id_1776}:v2``. A source with no
  ``{`` is a namespace for SWE-bench's names (``docker://swebench``).
- ``DIR``: per instance ``DIR/<instance_id>.sif`` is used as it is;
  ``DIR/<instance_id>.tar`` (or ``.oci.tar``), an OCI archive or a ``docker
  save`` archive, and ``DIR/<instance_id>/``, an OCI layout, are converted
  to a ``.sif`` in the image cache (once: the key covers the archive's index).

Every pull or conversion is an ordinary image list entry, so it is cached,
locked and resumed like any build (:mod:`prorl_cli.images.build`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import string
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import ConfigError


@dataclass(frozen=True)
class Scheme:
    """How a published dataset names its per-instance images (the part after the namespace)."""

    template: str
    namespace: str  # where the dataset's authors publish them
    source: str  # where the rule comes from


#: The naming rules of the published SWE datasets, as their own code spells them.
SCHEMES: dict[str, Scheme] = {
    # swebench's TestSpec.instance_image_key: lower case, "__" spelled "_1776_" (Docker Hub refuses "__").
    "swebench": Scheme("sweb.eval.x86_64.{id_1776}:latest", "swebench", "swebench harness, instance_image_key"),
    # SWE-rebench rows carry docker_image in SWE-bench's spelling under their own namespace.
    "swerebench": Scheme("sweb.eval.x86_64.{id_1776}", "swerebench", "SWE-rebench rows' docker_image"),
    # OpenHands' SWE-Gym images: "__" spelled "_s_", lower case.
    "swegym": Scheme("sweb.eval.x86_64.{id_s}", "xingyaoww", "OpenHands get_instance_docker_image"),
    # SWE-smith: one image per repository snapshot, owner_1776_repo.<commit[:8]> (RepoProfile.image_name).
    "swesmith": Scheme("swesmith.x86_64.{smith_repo}", "jyangballin", "SWE-smith RepoProfile.image_name"),
}

#: Fields a template may use, computed from the instance id.
FIELDS = {
    "instance_id": "the instance id as the dataset spells it",
    "id_1776": "lower case, '__' spelled '_1776_' (SWE-bench, SWE-rebench)",
    "id_s": "lower case, '__' spelled '_s_' (SWE-Gym)",
    "smith_repo": "SWE-smith's owner_1776_repo.<commit[:8]> from an id owner__repo.<commit[:8]>.<bug>",
}

# SWE-smith instance ids: <owner>__<repo>.<first 8 hex of the commit>.<how the bug was made>.
_SMITH_ID = re.compile(r"^(?P<owner>[^_][^/]*?)__(?P<repo>[^/]+?)\.(?P<commit>[0-9a-f]{8})\..+$")
# Docker's reference grammar: lower-case path components, an optional tag.
_PATH_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
#: Files in DIR that hold an instance's image, by suffix, before conversion.
ARCHIVE_SUFFIXES = (".tar", ".oci.tar")


def instance_fields(instance_id: str) -> dict[str, str]:
    """The template fields of ``instance_id`` (``smith_repo`` only for ids in SWE-smith's form)."""
    low = instance_id.lower()
    fields = {"instance_id": instance_id, "id_1776": low.replace("__", "_1776_"), "id_s": low.replace("__", "_s_")}
    m = _SMITH_ID.match(instance_id)
    if m:
        fields["smith_repo"] = f"{m['owner']}_1776_{m['repo']}.{m['commit']}".lower()
    return fields


@dataclass(frozen=True)
class RegistryTemplate:
    """``docker://HOST/NAMESPACE/TEMPLATE`` with the scheme names expanded."""

    template: str  # without docker://, e.g. "127.0.0.1:5000/ns/sweb.eval.x86_64.{id_1776}:latest"

    def reference(self, instance_id: str) -> str:
        """The image of ``instance_id`` (without ``docker://``); ConfigError when it cannot be named."""
        fields = instance_fields(instance_id)
        try:
            ref = self.template.format(**fields)
        except KeyError as e:
            raise ConfigError(f"instance {instance_id}: {{{e.args[0]}}} does not apply: {FIELDS[e.args[0]]}") from e
        check_reference(ref, f"instance {instance_id}")
        return ref


def registry_template(source: str) -> RegistryTemplate:
    """Parse ``docker://HOST/NAMESPACE/TEMPLATE`` (no ``{``: a namespace for SWE-bench's names)."""
    if not source.startswith("docker://"):
        raise ConfigError(f"--images-from {source!r}: a registry source starts with docker://")
    body = source[len("docker://"):].rstrip("/")
    if not body:
        raise ConfigError(f"--images-from {source!r}: name a namespace, e.g. docker://swebench or "
                          "docker://127.0.0.1:5000/ns/{swebench}")
    if "{" not in body:
        body += "/{swebench}"
    for name, scheme in SCHEMES.items():
        body = body.replace("{" + name + "}", scheme.template)
    try:
        used = {f for _, f, _, _ in string.Formatter().parse(body) if f is not None}
    except ValueError as e:
        raise ConfigError(f"--images-from {source!r}: {e}") from e
    unknown = sorted(used - set(FIELDS))
    if unknown:
        raise ConfigError(f"--images-from {source!r}: unknown field(s) {unknown}; templates know "
                          f"{sorted(FIELDS)} and the schemes {sorted('{' + s + '}' for s in SCHEMES)}")
    if not used:
        raise ConfigError(f"--images-from {source!r}: the template names no field, so every instance would get the "
                          "same image; use e.g. {instance_id} or {swebench}")
    return RegistryTemplate(body)


def check_reference(ref: str, where: str) -> None:
    """Refuse what no registry would accept, naming the offending part."""
    name, tag = ref, None
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = ref.rsplit(":", 1)
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]  # the registry host may have upper case and a port
    for part in parts:
        if not _PATH_COMPONENT.match(part):
            raise ConfigError(f"{where}: {ref!r} is not a valid image reference: {part!r} (lower-case letters, "
                              "digits and single separators . _ __ - only)")
    if tag is not None and not _TAG.match(tag):
        raise ConfigError(f"{where}: {ref!r} is not a valid image reference: tag {tag!r}")


def registry_host(ref: str) -> str | None:
    """The registry host (with port) a docker reference names, or None for Docker Hub's short names."""
    first, sep, _ = ref.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return None


def plain_http(ref: str, insecure_registries: list[str]) -> bool:
    """Whether pulls of ``ref`` go over plain HTTP: a loopback registry, or one listed in ``images.insecure_registries``."""
    host = registry_host(ref)
    if host is None:
        return False
    if host in insecure_registries:
        return True
    if host.startswith("["):  # [IPv6] or [IPv6]:PORT
        name = host[1:host.find("]")] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def on_disk(folder: Path, instance_id: str) -> tuple[str, Path] | None:
    """The image of ``instance_id`` in ``folder``: ``("sif"|"oci"|"oci-archive"|"docker-archive", path)``, or None."""
    sif = folder / f"{instance_id}.sif"
    if sif.is_file():
        return "sif", sif.resolve()
    layout = folder / instance_id
    if (layout / "oci-layout").is_file() and (layout / "index.json").is_file():
        return "oci", layout.resolve()
    for suffix in ARCHIVE_SUFFIXES:
        archive = folder / f"{instance_id}{suffix}"
        if archive.is_file():
            return archive_kind(archive), archive.resolve()
    return None


def archive_kind(path: Path) -> str:
    """``oci-archive`` (an OCI layout as a tar) or ``docker-archive`` (``docker save``); ConfigError otherwise."""
    names = set(_tar_index(path))
    if "oci-layout" in names and "index.json" in names:
        return "oci-archive"
    if "manifest.json" in names:
        return "docker-archive"
    raise ConfigError(f"{path}: neither an OCI archive (oci-layout, index.json) nor a docker save archive "
                      "(manifest.json)")


def _tar_index(path: Path) -> dict[str, bytes]:
    """The small index files at the top of an image archive (reads headers only, skipping the layers)."""
    wanted = {"oci-layout", "index.json", "manifest.json"}
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(path, "r:") as tar:  # image archives are plain tar: seeking skips each layer
            for member in tar:
                name = member.name.removeprefix("./")
                if name in wanted and member.isfile():
                    f = tar.extractfile(member)
                    found[name] = f.read() if f is not None else b""
    except (tarfile.TarError, OSError) as e:
        raise ConfigError(f"{path}: not a readable tar archive ({e})") from e
    return found


def saved_image_digest(kind: str, path: Path) -> str:
    """What a lock key records of an image saved on disk: its index, which names every blob by digest.

    Hashing the index rather than the whole archive keeps planning of
    thousands of multi-gigabyte archives cheap; a changed image has a new index.
    """
    if kind == "oci":
        index = path / "index.json"
        return hashlib.sha256(index.read_bytes()).hexdigest() if index.is_file() else "missing"
    if not path.is_file():
        return "missing"
    found = _tar_index(path)
    h = hashlib.sha256()
    for name in sorted(found):
        h.update(name.encode() + b"\0" + found[name] + b"\0")
    h.update(str(path.stat().st_size).encode())
    return h.hexdigest()


def base_reference(ref: str) -> str:
    """An image list ``base`` for a published image reference (a bare ``owner/name`` is a docker:// one)."""
    if "://" in ref or ref.endswith(".sif") or ref.split(":", 1)[0] in ("oci", "oci-archive", "docker-archive",
                                                                       "localimage"):
        return ref
    return f"docker://{ref}"


def assign(rows: list[dict[str, Any]], images_from: str) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, str]]:
    """Point every row at its published image from ``images_from`` (a registry template or a folder).

    Returns the rows to pull or convert (each with ``image`` set), the
    instances whose ``.sif`` is ready on disk (id -> path), and the instances
    left without an image (id -> why). The source given on the command line
    wins over a row's own ``image`` (a local mirror of SWE-smith's images, say).
    """
    ready: dict[str, str] = {}
    problems: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    if images_from.startswith("docker://"):
        template = registry_template(images_from)
        for row in rows:
            iid = str(row["instance_id"])
            try:
                out.append({**row, "image": f"docker://{template.reference(iid)}"})
            except ConfigError as e:
                problems[iid] = str(e)
        return out, ready, problems
    folder = Path(images_from)
    if not folder.is_dir():
        raise ConfigError(f"--images-from {images_from}: not a folder (and not docker://...)")
    for row in rows:
        iid = str(row["instance_id"])
        try:
            found = on_disk(folder, iid)
        except ConfigError as e:
            problems[iid] = str(e)
            continue
        if found is None:
            problems[iid] = (f"no {iid}.sif, {iid}{ARCHIVE_SUFFIXES[0]} (OCI or docker save archive) or OCI layout "
                             f"{iid}/ in {folder}")
        elif found[0] == "sif":
            ready[iid] = str(found[1])
        else:
            out.append({**row, "image": f"{found[0]}:{found[1]}"})
    return out, ready, problems
