"""The stages of a multi-stage Dockerfile, as the stages of one Apptainer definition.

Docker builds the target (the last stage) and only the stages it needs: the
one its ``FROM`` names and those its ``COPY --from`` reads, and theirs in turn.
Each needed stage becomes an Apptainer stage (``Bootstrap`` ... ``Stage:
NAME``), and a ``COPY --from`` reads it through ``%files from NAME``. Two
things Apptainer cannot say directly are rewritten:

- a stage that starts ``FROM`` an earlier stage starts from that stage's own
  image with its instructions first (Apptainer bootstraps only from images),
  which is what Docker's build of it holds;
- ``COPY --from=IMAGE`` (``ghcr.io/astral-sh/uv:latest``) reads from a stage
  of its own that only bootstraps the image.

The image a stage starts from is ``docker://`` its ``FROM`` reference unless the
entry's ``stage_bases`` maps that reference to another base (a local image
where there is no registry); the target's is always the entry's ``base``.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prorl_cli.exceptions import ConfigError
from prorl_cli.images.dockerignore import posix_regex

if TYPE_CHECKING:
    from prorl_cli.images.dockerfile_text import Instruction


@dataclass
class Stage:
    """One ``FROM`` and the instructions up to the next: ``image`` is what it names (a stage or an image)."""

    index: int
    line: int
    image: str
    alias: str | None  # the AS name, lower-cased as Docker reads it
    from_args: str = ""  # its FROM line's words, as written
    body: list[Instruction] = field(default_factory=list)  # its Instructions, FROM excluded


def from_words(args: str) -> tuple[str | None, str | None]:
    """``FROM [--platform=...] IMAGE [AS NAME]``: the image and the stage name (lower-cased), or None."""
    words = [w for w in args.split() if not w.startswith("--")]
    image = words[0] if words else None
    alias = words[2].lower() if len(words) >= 3 and words[1].lower() == "as" else None
    return image, alias


def find_stage(stages: list[Stage], name: str, before: int) -> Stage | None:
    """The stage among the first ``before`` that ``name`` means: its AS name, or its index as Docker allows."""
    earlier = stages[:before]
    if name.isdigit():
        return earlier[int(name)] if int(name) < len(earlier) else None
    return next((s for s in reversed(earlier) if s.alias == name.lower()), None)


def stage_name(stage: Stage, taken: set[str]) -> str:
    """The Apptainer stage name of a Docker stage: its AS name where that is a plain word, else ``stageN``."""
    name = stage.alias if stage.alias and re.fullmatch(r"[a-z0-9][a-z0-9_-]*", stage.alias) else f"stage{stage.index}"
    while name in taken:
        name += "_"
    return name


def from_copy_steps(source: str, dest: str, staged: str, *, pattern: bool, keep_owner: bool = False) -> list[str]:
    """The %post steps that move what ``%files from STAGE`` staged at ``staged`` to ``dest``, as Docker copies.

    Whether ``source`` is a folder is known only inside the other stage, so the step decides: a folder's
    contents go into ``dest``; a file goes to ``dest``, or into it when ``dest`` ends with "/". Matches of a
    pattern were staged into the folder ``staged`` and all go into ``dest``. ``keep_owner``: the copies keep
    the staged files' owners (a ``--chown`` gave them), else they are root's, as Docker's are. A file an
    ``--exclude`` took away (see :func:`exclude_steps`) is not copied.
    """
    cp, cp_file = ("cp -fRp", "cp -fp") if keep_owner else ("cp -fR", "cp -f")
    if pattern:
        return [f"mkdir -p {shlex.quote(dest)}", f"{cp} {shlex.quote(staged)}/. {shlex.quote(dest)}"]
    name = posixpath.basename(source.rstrip("/")) or "root"
    target = dest + name if dest.endswith("/") else dest
    into = dest if dest.endswith("/") else dest + "/"
    s = shlex.quote(staged)
    # One step: %post runs with `sh -e`, which stops at a failing command in a branch (not inside `a && b`).
    return [f"if [ -d {s} ]; then mkdir -p {shlex.quote(into)}; {cp} {s}/. {shlex.quote(into)}; "
            f"elif [ -e {s} ] || [ -L {s} ]; then mkdir -p {shlex.quote(posixpath.dirname(target) or '/')}; {cp_file} {s} "
            f"{shlex.quote(target)}; fi"]


def exclude_steps(staged: str, name: str, excludes: list[str]) -> list[str]:
    """The %post step that takes out of what ``%files from STAGE`` staged at ``staged`` what a ``--exclude``'s
    patterns match, as BuildKit reads them: below a folder source, relative to it; a file source, by its
    ``name`` (relative to the folder it is in). The other stage's files are known only as the step runs."""
    s, regex = shlex.quote(staged), shlex.quote(posix_regex(excludes))
    # Deepest first (-depth): a folder goes after what it holds, so find never walks into a folder gone.
    return [f"if [ -d {s} ]; then (cd {s} && find . -mindepth 1 -depth | sed 's|^[.]/||' | grep -E {regex} | "
            f"while IFS= read -r p; do rm -rf \"./$p\"; done); elif printf '%s\\n' {shlex.quote(name)} | "
            f"grep -qE {regex}; then rm -f {s}; fi"]


def needed_stages(stages: list[Stage], copies_from: dict[int, list[tuple[str, int]]], where: str) -> list[int]:
    """The indices of the stages the definition builds, in Dockerfile order: the target and those it copies from
    (an unused stage is skipped, as BuildKit does; one only FROM'd is built inside the stage FROM it).

    ``copies_from``: for each stage, the ``--from`` value and line of each of its copies.
    """
    need: set[int] = set()

    def visit(i: int) -> None:
        if i in need:
            return
        need.add(i)
        # A stage FROM another is built with that one's instructions (see chain), its copies among them.
        stage: Stage | None = stages[i]
        while stage is not None:
            for name, line in copies_from.get(stage.index, []):
                source = find_stage(stages, name, stage.index)
                if source is None and (name.isdigit() or find_stage(stages, name, len(stages)) is not None):
                    raise ConfigError(f"{where}: line {line}: COPY --from={name} names a stage that is not defined "
                                      "before it")
                if source is not None:
                    visit(source.index)
            stage = find_stage(stages, stage.image, stage.index)

    visit(len(stages) - 1)
    return sorted(need)


def chain(stages: list[Stage], i: int) -> tuple[Stage, list[Instruction]]:
    """The stage whose image a stage really starts from, and the instructions on it: those of each stage it is
    ``FROM``, first."""
    stage = stages[i]
    parent = find_stage(stages, stage.image, i)
    if parent is None:
        return stage, list(stage.body)
    root, body = chain(stages, parent.index)
    return root, [*body, *stage.body]
