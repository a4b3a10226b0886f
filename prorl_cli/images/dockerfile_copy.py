"""COPY and ADD in a definition: what %files copies, and the %post steps that keep Docker's meaning.

Apptainer copies every %files line before %post starts, and copies a folder
into an existing destination rather than its contents; Docker copies in
instruction order and a folder's contents. The steps here stage what must
wait and move it at its turn.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prorl_cli.exceptions import ConfigError
from prorl_cli.images.dockerfile_stages import exclude_steps, from_copy_steps
from prorl_cli.images.dockerfile_text import HEREDOC, Instruction, leading_flags
from prorl_cli.images.dockerfile_user import chown_paths, make_dirs_as
from prorl_cli.images.dockerignore import DockerIgnore

# Where ADD puts a local archive until %post unpacks it, and where a COPY that follows a RUN waits for its
# turn: %files are all copied before %post starts, so `RUN rm -rf /etc/app/*` then `COPY app.conf /etc/app/`
# would delete the copied file.
ADD_STAGING = "/.prorl-add"
COPY_STAGING = "/.prorl-copy"
#: A source with a pattern character: it names what matches it, and several sources make DEST a folder.
_PATTERN = re.compile(r"[*?\[]")


def _in_workdir(dest: str, workdir: str) -> str:
    """``dest`` as an absolute path (Docker resolves a relative one against WORKDIR); a folder keeps its "/"."""
    if dest.startswith("/"):
        return dest
    path = posixpath.normpath(posixpath.join(workdir, dest))
    is_dir = dest.endswith("/") or posixpath.basename(dest) in (".", "..")
    return path.rstrip("/") + "/" if is_dir else path


def _fetch_steps(url: str, dest: str, checksum: str | None) -> tuple[list[str], str]:
    """The %post steps of ``ADD URL DEST`` and the path they write: the file fetched at build time with what the
    image has, mode 600 as Docker leaves it, checked against ``--checksum=sha256:HEX`` when given; a Git URL is
    cloned instead."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.path.endswith(".git"):
        into = dest.rstrip("/") or "/"
        branch = f" --branch {shlex.quote(parsed.fragment.split(':')[0])}" if parsed.fragment else ""
        repo = shlex.quote(url.split("#", 1)[0])
        # Docker keeps no .git folder unless asked (--keep-git-dir), and sees the ref's tree.
        return [f"git clone --quiet --depth 1{branch} {repo} {shlex.quote(into)}", f"rm -rf {shlex.quote(into)}/.git"], into
    name = posixpath.basename(parsed.path)
    if dest.endswith("/") and not name:
        raise ConfigError(f"ADD {url} {dest}: the URL names no file to call it in {dest}; give the file's path")
    target = dest + name if dest.endswith("/") else dest
    t, u = shlex.quote(target), shlex.quote(url)
    fetch = (f"if command -v curl >/dev/null 2>&1; then curl -fsSL -o {t} {u}; "
             f"elif command -v wget >/dev/null 2>&1; then wget -q -O {t} {u}; "
             f"elif command -v python3 >/dev/null 2>&1; then python3 -c "
             f"'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' {u} {t}; "
             f"else echo {shlex.quote(f'ADD {url}: the image has no curl, wget or python3 to fetch it with')} >&2; "
             "exit 1; fi")
    steps = [f"mkdir -p {shlex.quote(posixpath.dirname(target) or '/')}", fetch, f"chmod 600 {t}"]
    if checksum is not None:
        algorithm, _, digest = checksum.partition(":")
        if algorithm != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ConfigError(f"ADD --checksum={checksum}: expected sha256: and 64 hex digits, as Docker does")
        steps.append(f"echo {shlex.quote(f'{digest}  {target}')} | sha256sum -c -")
    return steps, target


@dataclass
class CopyConversion:
    """What one COPY/ADD became: files for %files, and %post lines to run at its place."""

    files: list[tuple[Path, str, str]] = field(default_factory=list)  # (source, %files source, %files dest)
    from_files: list[tuple[str, str, str]] = field(default_factory=list)  # (stage, its path, %files from dest)
    post: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    chown: str | None = None  # --chown's value: the post lines call dockerfile_user's shell functions


def convert_copy(ins: Instruction, context: Path, workdir: str, index: int | str, image: str, path: Path,
                 resolve_from: Callable[[str], str], ignore: DockerIgnore, *, deferred: bool = False) -> CopyConversion:
    """COPY/ADD with Docker's meaning: dest relative to WORKDIR, a folder's contents, ADD unpacking local tars.

    ``index``: what names its staging folders (the instruction's place; a RUN's mount adds its own).
    ``resolve_from``: the definition's stage a ``--from`` value reads.
    ``ignore``: the context's ``.dockerignore``: what it leaves out, COPY does not see (a folder goes in as the
    parts that cover the rest: what is left out is never copied).
    ``deferred``: a RUN came before, so the copy goes to a staging folder and a %post step moves it in place.
    """
    context = context.resolve()

    def left_out(p: Path, rules: DockerIgnore = ignore) -> bool:
        return p.is_relative_to(context) and p != context and rules.excludes(p.relative_to(context).as_posix())

    out = CopyConversion()
    where = f"image {image}: {path}: line {ins.line}"
    flags, rest = leading_flags(ins.args)  # COPY [--chown=...] ... SRC... DEST, or the JSON form after the flags
    if rest.startswith("["):
        try:
            words = json.loads(rest)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: {ins.word} {ins.args}: not a JSON list ({e})") from e
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ConfigError(f"{where}: {ins.word} {ins.args}: expected a JSON list of strings")
    else:
        words = rest.split()
    source_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
    checksum = next((f.split("=", 1)[1] for f in flags if f.startswith("--checksum=") and ins.word == "ADD"), None)
    mode = next((f.split("=", 1)[1] for f in flags if f.startswith("--chmod=")), None)
    if mode is not None and not re.fullmatch(r"[0-7]{3,4}|[ugoa]*[-+=][rwxXst]*(,[ugoa]*[-+=][rwxXst]*)*", mode):
        raise ConfigError(f"{where}: {ins.word} --chmod={mode}: not a file mode (755, or u+x as chmod reads it)")
    owner = next((f.split("=", 1)[1] for f in flags if f.startswith("--chown=")), None) or None
    out.chown = owner
    # The folders the copy makes must be the owner's as they are made, before the files land: the copy waits.
    deferred = deferred or owner is not None
    # --exclude=PATTERN (repeatable): as BuildKit reads it, relative to what each source copies from.
    excludes = [f.split("=", 1)[1].strip("/") for f in flags if f.startswith("--exclude=")]
    # --parents: each source keeps its folders (from the context, or from a `/./` in it) under DEST.
    keep_parents = "--parents" in flags or "--parents=true" in flags
    taken = ("--link", "--from=", "--chmod=", "--chown=", "--exclude=", "--parents", *(("--checksum=",) if checksum else ()))
    ignored = [f for f in flags if not f.startswith(taken)]
    if ignored:
        out.notes.append(f"line {ins.line}: {ins.word} {ins.args} - flags {' '.join(ignored)} are ignored")
    if len(words) < 2:
        raise ConfigError(f"{where}: {ins.word} {ins.args}: needs a source and a destination")
    *sources, dest = words
    dest = _in_workdir(dest, workdir)
    docs = {d.delimiter: d for d in ins.heredocs}
    many = len(sources) > 1 or any(_PATTERN.search(s) for s in sources)
    if many and not dest.endswith("/"):
        dest += "/"  # Docker requires it for several sources; it means a folder
    if source_stage is not None:
        stage = resolve_from(source_stage)
        for n, src in enumerate(sources):
            pattern = bool(_PATTERN.search(src))
            at = dest
            if keep_parents and pattern:
                out.notes.append(f"line {ins.line}: {ins.word} {ins.args} - --parents is not applied to a pattern "
                                 "copied from another stage or image: its matches go into DEST")
            elif keep_parents:
                at = dest.rstrip("/") + "/" + posixpath.normpath(src.split("/./", 1)[-1]).lstrip("/")
            # A source in another stage is a path in its image: relative ones are from its root, as in Docker.
            src = posixpath.normpath(posixpath.join("/", src))
            staged = f"{COPY_STAGING}/{index}-{n}" + ("" if pattern else "/" + (posixpath.basename(src) or "root"))
            out.from_files.append((stage, src, staged + "/" if pattern else staged))
            if mode is not None:  # what is copied takes the mode of what was staged
                out.post.append(f"chmod -R {shlex.quote(mode)} {shlex.quote(staged)}")
            if owner is not None:  # and its owner, which the copy keeps
                out.post.append(chown_paths(owner, [staged]))
            if excludes:
                out.post += exclude_steps(staged, posixpath.basename(src), excludes)
            out.post += from_copy_steps(src, at, staged, pattern=pattern, keep_owner=owner is not None)
        parent = dest if dest.endswith("/") else posixpath.dirname(dest) or "/"
        if owner is not None and parent != "/":  # a copied folder takes its staged owner itself (cp -p of DIR/.)
            out.post.insert(0, make_dirs_as(owner, parent, chown=True))
        return out
    # What --chmod applies to once the copy is in place: each path copied, and what a folder holds.
    modes: list[tuple[str, bool]] = []
    for src in sources:
        m = HEREDOC.fullmatch(src)
        if m and m.group(3) in docs:
            doc = docs[m.group(3)]
            target = dest + doc.delimiter if dest.endswith("/") else dest
            quote = "'" if doc.quoted else ""
            # One simple command a line: %post runs with `sh -e`, which does not stop at a failure inside `a && b`.
            out.post.append(f"mkdir -p {shlex.quote(posixpath.dirname(target) or '/')}")
            out.post.append(f"cat > {shlex.quote(target)} <<{quote}{doc.delimiter}{quote}\n{doc.body}\n{doc.delimiter}")
            modes.append((target, False))
            continue
        if ins.word == "ADD" and re.match(r"https?://", src):
            try:
                fetched, target = _fetch_steps(src, dest, checksum)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from e
            out.post += fetched
            modes.append((target, True))
            continue
        pattern = bool(_PATTERN.search(src))
        matches = sorted(context.glob(src)) if pattern else [context / src]
        matches = [p.resolve() for p in matches if p.exists()]
        if not pattern and matches and left_out(matches[0]):
            raise ConfigError(f"{where}: {ins.word} source {src!r} is left out of the context by .dockerignore")
        if not matches and not pattern:
            raise ConfigError(f"{where}: {ins.word} source {src!r} does not exist in {context}")
        rules = ignore
        if excludes and matches:
            # A folder's patterns are relative to it; a file's or a pattern's matches, to the folder they are in.
            root = matches[0] if not pattern and matches[0].is_dir() else context / posixpath.dirname(src)
            base = root.resolve().relative_to(context).as_posix() if root.resolve().is_relative_to(context) else "."
            rules = ignore.excluding([x if base == "." else f"{base}/{x}" for x in excludes])
        matches = [p for p in matches if not left_out(p, rules)]
        # A pattern that matches nothing copies nothing, as BuildKit allows (`COPY requirements.txt* ./` is the
        # idiom for an optional file).
        pivot = (context / src.split("/./", 1)[0]).resolve() if "/./" in src else context
        for src_path in matches:
            at = dest  # with --parents, this match's own place below DEST
            if keep_parents and src_path.is_relative_to(pivot) and src_path != pivot:
                at = dest.rstrip("/") + "/" + src_path.relative_to(pivot).as_posix()
            if ins.word == "ADD" and src_path.is_file() and tarfile.is_tarfile(src_path):
                # Docker unpacks a local tar archive (plain or compressed) that ADD names into the destination.
                staged = f"{ADD_STAGING}/{index}-{src_path.name}"
                out.files.append((src_path, str(src_path), staged))
                into = at if at.endswith("/") else at + "/"
                out.post += [f"mkdir -p {shlex.quote(into)}", f"tar -xf {shlex.quote(staged)} -C {shlex.quote(into)}",
                             f"rm -f {shlex.quote(staged)}"]
            elif src_path.is_dir():
                # Docker copies a folder's contents; Apptainer's `cp -r SRC DEST` would nest SRC inside an existing DEST.
                into = at if at.endswith("/") else at + "/"
                # What .dockerignore leaves out is never copied (a repository's .git or a 5 GB data/ folder, which
                # is why it is there), nor hashed into the lock key: the rest is copied in as few parts as cover it.
                parts, empty = rules.included(context, src_path) if src_path.is_relative_to(context) else ([""], [])
                root = f"{COPY_STAGING}/{index}-{len(out.files)}/" if deferred else into
                for rel in parts:
                    part = src_path / rel
                    # `cp -r SRC/. DEST` fills DEST, whether or not the image has it yet
                    out.files.append((part, f"{part}/." if part.is_dir() and not part.is_symlink() else str(part),
                                      root + rel if rel or deferred else at))
                if deferred or not parts:
                    out.post.append(f"mkdir -p {shlex.quote(into)}")
                out.post += [f"mkdir -p {shlex.quote(into + rel)}" for rel in empty]
                if deferred and parts:
                    out.post.append(f"cp -fR {shlex.quote(root)}. {shlex.quote(into)}")
                tops = sorted({rel.split("/")[0] for rel in [*parts, *empty]}) if parts != [""] else \
                    sorted(entry.name for entry in src_path.iterdir())
                modes += [(into + name, True) for name in tops]
            else:
                target = at + src_path.name if at.endswith("/") else at
                if deferred:
                    # The staged file keeps its name: `cp` into a DEST that is a folder of the image names it so.
                    stage = f"{COPY_STAGING}/{index}-{len(out.files)}/{src_path.name}"
                    out.files.append((src_path, str(src_path), stage))
                    out.post += [f"mkdir -p {shlex.quote(posixpath.dirname(target) or '/')}",
                                 f"cp -f {shlex.quote(stage)} {shlex.quote(target)}"]
                else:
                    out.files.append((src_path, str(src_path), target))
                modes.append((target, False))
    if mode is not None:
        out.post += [f"chmod {'-R ' * recursive}{shlex.quote(mode)} {shlex.quote(target)}" for target, recursive in modes]
    if owner is not None:
        # As BuildKit's: the folders the copy makes and what it copies are the owner's; a folder it copies into
        # that was there keeps its owner.
        parents = dict.fromkeys(posixpath.dirname(target.rstrip("/")) or "/" for target, _ in modes)
        out.post = [make_dirs_as(owner, parent, chown=True) for parent in parents if parent != "/"] + out.post
        if modes:
            out.post.append(chown_paths(owner, [target for target, _ in modes]))
    return out
