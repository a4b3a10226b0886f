"""``prorl build-images --swe DATASET``: the image list of a SWE dataset, layered and cached like any other.

Layers: the base (``--base``: a local ``.sif`` offline, ``docker://...``
online; shared by every image), then one environment image per
repository/version, ``swe-<repo>-<version>``, an entry of an ordinary image
list (``sif_recipes`` machinery: spython-converted Dockerfile, lock-mode
key, file locks, the manifest) holding:

- the environment: the rows' ``install_config`` ``pre_install`` commands and
  ``pip_packages`` (SWE-rebench's and old SWE-bench specs' keys), and their
  ``requirements`` (SWE-rebench's pinned ``pip freeze`` of the environment:
  editable installs, local paths and option lines left out, the project itself
  being installed by ``install_config.install``), installed from
  ``--wheels DIR`` when given (pip ``--no-index``, or unpacked into the site
  folder where the image has no pip) and from the package index otherwise.
  Rows of one repository/version whose ``requirements`` differ get one image
  per distinct set (``swe-<repo>-<version>-<digest>``), mapped by instance id;
- the repository in ``/testbed``, cloned from a bundle holding the base
  commits of the group's instances and their history, nothing later (INIT
  still checks out each instance's ``base_commit`` and removes whatever is
  not its ancestor), and ``install_config.install`` run there.

Rows that name their own ``image`` (published images: SWE-smith's
``image_name`` and SWE-rebench's ``docker_image`` arrive as ``image``), or all
rows with ``--images-from docker://HOST/NAMESPACE/TEMPLATE`` (naming templates
of :mod:`prorl_cli.images.published`), get an entry pulled from that
reference instead, one per distinct reference; ``--images-from DIR`` maps each
instance to ``DIR/<instance_id>.sif`` as it is and converts OCI archives and
layouts there.

The repository comes from the rows' ``repo_path`` or from ``--repos-dir``
(``DIR/<owner>__<name>`` or ``DIR/<owner>/<name>``). The generated list and recipes live under the
recipes folder; building them again reuses every layer whose inputs did not
change (lock mode), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prorl_cli.exceptions import DatasetError, DomainError
from prorl_cli.images import published
from prorl_cli.swe.history import _git

WHEELS_DST = "/opt/prorl-wheels"
BUNDLE_DST = "/opt/prorl-swe/repo.bundle"
REQUIREMENTS_DST = "/opt/prorl-swe/requirements.txt"
#: First site folder on the image python's path (Debian's python does not search sysconfig's purelib).
_SITE = ("$(python3 -c \"import sys; print([p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))][0])\")")


@dataclass
class RepoGroup:
    """The instances of one repository/version and what their images need."""

    repo: str
    version: str
    instance_ids: list[str] = field(default_factory=list)
    base_commits: list[str] = field(default_factory=list)
    repo_path: str | None = None
    pip_packages: list[str] = field(default_factory=list)
    pre_install: list[str] = field(default_factory=list)
    install: list[str] = field(default_factory=list)
    requirements: list[str] = field(default_factory=list)  # pinned lines, installed with pip -r
    variant: str = ""  # a digest of ``requirements`` when the repository/version has several sets

    @property
    def key(self) -> str:
        return f"{self.repo}@{self.version}" + (f"#{self.variant}" if self.variant else "")

    @property
    def slug(self) -> str:
        raw = f"{self.repo.replace('/', '-')}-{self.version}" + (f"-{self.variant}" if self.variant else "")
        return re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-.") or "repo"


@dataclass
class SwePlan:
    """The generated image list: its file, the image names to build, and the ``repo_images`` map they make."""

    images_file: Path
    names: list[str]
    repo_images: dict[str, str]  # "repo@version" (or instance id) -> image name
    problems: dict[str, str]  # group or instance -> why it has no image
    ready: dict[str, str] = field(default_factory=dict)  # instance id -> a .sif found on disk (nothing to build)


def assign_published(rows: list[dict[str, Any]], images_from: str) -> tuple[list[dict[str, Any]], dict[str, str],
                                                                           dict[str, str]]:
    """Rows pointed at published per-instance images (see :mod:`prorl_cli.images.published`): the rows to pull
    or convert, the ready .sif paths, problems."""
    return published.assign(rows, images_from)


def _list(value: Any, where: str) -> list[str]:
    if value in (None, ""):
        return []
    if isinstance(value, str):
        return value.split() if where.endswith("pip_packages") else [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise DatasetError(f"{where}: expected a string or a list of strings, got {value!r}")


def requirement_lines(text: Any, where: str) -> list[str]:
    """The installable lines of a ``requirements`` field (a ``pip freeze``): no comments, options, editable
    installs or local paths (the project itself is installed by ``install_config.install``)."""
    if text in (None, ""):
        return []
    if isinstance(text, list) and all(isinstance(t, str) for t in text):
        text = "\n".join(text)
    if not isinstance(text, str):
        raise DatasetError(f"{where}: expected the text of a requirements file, got {type(text).__name__}")
    lines = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")) or "@ file:" in line or line.startswith(("file:", "/", ".")):
            continue
        lines.append(line)
    return lines


def group_rows(rows: list[dict[str, Any]], repos_dir: Path | None) -> tuple[dict[str, RepoGroup], dict[str, str]]:
    """Rows by repository/version and requirements set (rows with their own ``image`` apart: instance id -> image
    reference)."""
    by_key: dict[str, dict[str, list[dict[str, Any]]]] = {}
    pulled: dict[str, str] = {}
    for row in rows:
        iid = str(row["instance_id"])
        if isinstance(row.get("image"), str) and row["image"]:
            pulled[iid] = row["image"]
            continue
        reqs = requirement_lines(row.get("requirements"), f"instance {iid} requirements")
        digest = hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:8] if reqs else ""
        key = repo_key(row)
        by_key.setdefault(key, {}).setdefault(digest, []).append(row)
    groups: dict[str, RepoGroup] = {}
    for variants in by_key.values():
        for digest, members in variants.items():
            first = members[0]
            version = str(first.get("version") or "latest")
            # One requirements set keeps the plain repo@version key; several get one image each.
            group = RepoGroup(str(first["repo"]), version, variant=digest if len(variants) > 1 else "")
            group.requirements = requirement_lines(first.get("requirements"), "requirements")
            for row in members:
                _add_row(group, row, repos_dir)
            groups[group.key] = group
    return groups, pulled


def _add_row(group: RepoGroup, row: dict[str, Any], repos_dir: Path | None) -> None:
    iid = str(row["instance_id"])
    group.instance_ids.append(iid)
    if row["base_commit"] not in group.base_commits:
        group.base_commits.append(str(row["base_commit"]))
    if group.repo_path is None:
        group.repo_path = _repo_path(row, repos_dir)
    raw = row.get("install_config")
    config: dict[str, Any] = raw if isinstance(raw, dict) else {}
    where = f"instance {iid} install_config"
    for attr in ("pip_packages", "pre_install", "install"):
        for item in _list(config.get(attr), f"{where}.{attr}"):
            if item not in getattr(group, attr):
                getattr(group, attr).append(item)


def _repo_path(row: dict[str, Any], repos_dir: Path | None) -> str | None:
    if row.get("repo_path"):
        return str(row["repo_path"])
    if repos_dir is not None:
        owner_name = str(row["repo"])
        for candidate in (repos_dir / owner_name.replace("/", "__"), repos_dir / owner_name):
            if candidate.is_dir():
                return str(candidate)
    return None


def bundle_commits(repo_path: str, commits: list[str], dest: Path) -> None:
    """Write a bundle of ``commits`` and their history (nothing later) to ``dest``, the same bytes every time."""
    objects = _git("-C", repo_path, "rev-parse", "--path-format=absolute", "--git-path", "objects").strip()
    resolved = [_git("-C", repo_path, "rev-parse", "--verify", "--end-of-options", f"{c}^{{commit}}").strip()
                for c in commits]
    with tempfile.TemporaryDirectory(prefix="prorl-swe-bundle-") as tmp:
        _git("init", "-q", "--bare", tmp)
        Path(tmp, "objects", "info", "alternates").write_text(objects + "\n")
        refs = ["refs/heads/main"]
        _git("-C", tmp, "update-ref", "refs/heads/main", resolved[-1])
        for n, commit in enumerate(resolved):
            _git("-C", tmp, "update-ref", f"refs/heads/base-{n}", commit)
            refs.append(f"refs/heads/base-{n}")
        _git("-C", tmp, "symbolic-ref", "HEAD", "refs/heads/main")
        new = dest.with_suffix(".tmp")
        _git("-C", tmp, "-c", "pack.threads=1", "bundle", "create", str(new), *refs)
        if dest.is_file() and dest.read_bytes() == new.read_bytes():
            new.unlink()  # unchanged: keep the old file (and its mtime)
        else:
            new.replace(dest)


def _pip_line(packages: list[str], wheels: bool, requirements_file: str | None = None) -> str:
    """A RUN line installing ``packages`` (or the file ``requirements_file`` holding them, one per line)."""
    names = f"-r {requirements_file}" if requirements_file else " ".join(shlex.quote(p) for p in packages)
    if not wheels:
        return f"RUN python3 -m pip install --no-cache-dir {names}"
    stems = " ".join(shlex.quote(re.split(r"[<>=!~\[; ]", p, maxsplit=1)[0].replace("-", "_")) for p in packages)
    return (f"RUN if python3 -m pip --version >/dev/null 2>&1; then "
            f"python3 -m pip install --no-cache-dir --no-index --find-links {WHEELS_DST} {names}; "
            f"else site={_SITE}; for p in {stems}; do "
            f"w=$(ls {WHEELS_DST}/$p-*.whl {WHEELS_DST}/$(echo $p | tr A-Z a-z)-*.whl 2>/dev/null | head -n 1); "
            f"[ -n \"$w\" ] || {{ echo \"no wheel for $p in {WHEELS_DST}\" >&2; exit 1; }}; "
            f"python3 -m zipfile -e \"$w\" \"$site\"; done; fi")


def dockerfile(group: RepoGroup, wheels: bool, repo_dir: str) -> str:
    """The environment of ``group`` (pre_install, pip_packages), then its repository in ``repo_dir`` and install."""
    testbed = shlex.quote(repo_dir)
    lines = ["FROM prorl-swe-base", "ENV PYTHONDONTWRITEBYTECODE=1"]
    lines += [f"RUN {command}" for command in group.pre_install]
    if group.requirements:
        lines += [f"COPY requirements.txt {REQUIREMENTS_DST}",
                  _pip_line(group.requirements, wheels, REQUIREMENTS_DST)]
    if group.pip_packages:
        lines.append(_pip_line(group.pip_packages, wheels))
    lines += [
        f"COPY repo.bundle {BUNDLE_DST}",
        f"RUN git clone -q -b main {BUNDLE_DST} {testbed} && cd {testbed} && git remote remove origin "
        f"&& rm -f {BUNDLE_DST} && (git config --system --add safe.directory '*' || true)",
    ]
    lines += [f"RUN cd {testbed} && {command}" for command in group.install]
    lines.append(f"WORKDIR {repo_dir}")
    return "\n".join(lines) + "\n"


def repo_key(row: dict[str, Any]) -> str:
    """The ``repo_images`` key of ``row``'s repository/version: ``repo@version``, ``repo@latest`` without one.

    The handlers and ``prorl swe validate`` look images up by this same key, so a row without a version finds
    the image built for it (not the settings' default image).
    """
    return f"{row['repo']}@{row.get('version') or 'latest'}"


def plan_dataset(rows: list[dict[str, Any]], recipes_dir: Path, base: str, wheels_dir: Path | None,
                 repos_dir: Path | None, repo_dir: str = "/testbed", images_from: str | None = None) -> SwePlan:
    """Write the image list and recipes of ``rows`` under ``recipes_dir``; nothing is built.

    ``images_from`` points every row without its own ``image`` at a published per-instance image.
    """
    ready: dict[str, str] = {}
    problems: dict[str, str] = {}
    if images_from:
        rows, ready, problems = assign_published(rows, images_from)
    groups, pulled = group_rows(rows, repos_dir)
    recipes_dir.mkdir(parents=True, exist_ok=True)
    images: dict[str, Any] = {}
    names: list[str] = []
    repo_images: dict[str, str] = {}
    for key, group in sorted(groups.items()):
        if group.repo_path is None:
            problems[key] = (f"no repository: instances {group.instance_ids} have no repo_path and --repos-dir "
                             f"has no {group.repo.replace('/', '__')} or {group.repo}")
            continue
        folder = recipes_dir / group.slug
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "Dockerfile").write_text(dockerfile(group, wheels_dir is not None, repo_dir))
        if group.requirements:
            _write_if_changed(folder / "requirements.txt", "\n".join(group.requirements) + "\n")
        try:
            bundle_commits(group.repo_path, group.base_commits, folder / "repo.bundle")
        except DomainError as e:  # a broken repository is this group's problem; the others still build
            problems[key] = f"cannot bundle {group.repo_path}: {e}"
            continue
        name = f"swe-{group.slug}"
        entry: dict[str, Any] = {"template": f"{group.slug}/Dockerfile", "base": base,
                                 "description": f"{group.key}: environment and repository in {repo_dir} "
                                                f"({len(group.instance_ids)} instance(s))"}
        if wheels_dir is not None:
            entry["files"] = [{"src": str(wheels_dir), "dst": WHEELS_DST}]
        images[name] = entry
        names.append(name)
        if group.variant:  # several requirements sets for one repo@version: each instance is mapped on its own
            repo_images.update({iid: name for iid in group.instance_ids})
        else:
            repo_images[key] = name
    first_of: dict[str, str] = {}  # reference -> the first instance pulling it: one image per reference
    for iid, ref in sorted(pulled.items()):
        local = _local_image(ref)
        if local is not None and not local.exists():
            # Said here, naming the row: Apptainer would only say that its conveyor failed to get the file.
            problems[iid] = f"its image {ref}: {local} does not exist"
            continue
        if local is not None and local.suffix == ".sif" and local.is_file():
            ready[iid] = str(local.resolve())  # an Apptainer image already: used as it is, as --images-from DIR does
            continue
        first = first_of.setdefault(ref, iid)
        slug = re.sub(r"[^a-z0-9._-]+", "-", first.lower()).strip("-.")
        if first == iid:
            folder = recipes_dir / "pulled"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "Dockerfile").write_text("FROM published\n")
            users = sorted(i for i, r in pulled.items() if r == ref)
            images[f"swe-i-{slug}"] = {"template": "pulled/Dockerfile",
                                       "base": published.base_reference(ref),
                                       "description": f"published image of {', '.join(users[:3])}"
                                                      + (f" and {len(users) - 3} more" if len(users) > 3 else "")}
            names.append(f"swe-i-{slug}")
        repo_images[iid] = f"swe-i-{slug}"
    images_file = recipes_dir / "images.yaml"
    if images:
        text = yaml.safe_dump({"images": images}, sort_keys=True)
        if not images_file.is_file() or images_file.read_text() != text:
            images_file.write_text(text)
    return SwePlan(images_file, names, repo_images, problems, ready)


def _local_image(ref: str) -> Path | None:
    """The file or folder a row's ``image`` names on this machine (``x.sif``, ``localimage:``, ``oci:``,
    ``oci-archive:``, ``docker-archive:``), or None for a registry reference."""
    kind, sep, rest = ref.partition(":")
    if sep and kind in ("localimage", "oci", "oci-archive", "docker-archive"):
        return Path(rest).expanduser()
    if "://" not in ref and ref.endswith(".sif"):
        return Path(ref).expanduser()
    return None


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` unless ``path`` holds it already (its mtime stays: lock keys hold)."""
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def recipes_folder(dataset: Path, cache_dir: Path) -> Path:
    """Where a dataset's generated recipes live: under the image cache, one folder per dataset file."""
    digest = hashlib.sha256(str(dataset.resolve()).encode()).hexdigest()[:12]
    return cache_dir / "swe-recipes" / f"{dataset.stem}-{digest}"


def write_map(path: Path, repo_images: dict[str, str], results: dict[str, str],
              ready: dict[str, str] | None = None) -> dict[str, str]:
    """``repo_images`` with image names replaced by the built paths (failed ones left out), plus ``ready``, as JSON."""
    mapping = {key: results[name] for key, name in repo_images.items() if name in results}
    mapping.update(ready or {})
    path.write_text(json.dumps(mapping, indent=2, sort_keys=True) + "\n")
    return mapping


def check_git() -> None:
    """git is needed on the host to bundle repositories."""
    try:
        subprocess.run(["git", "--version"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise DatasetError("build-images --swe needs git on this machine") from e
