"""Dockerfile recipes: converted to Apptainer definitions with spython.

An image list entry whose ``template`` is a Dockerfile (``Dockerfile``,
``Dockerfile.NAME``, ``NAME.Dockerfile`` or ``NAME.dockerfile``) is parsed
by spython's ``DockerParser`` and written by its ``SingularityWriter``; prorl
then puts its own header first (the entry's ``base`` replaces ``FROM``, so
an offline site can point it at a local image), makes ``COPY``/``ADD``
sources absolute (relative to the Dockerfile, like a build context) and adds
what every prorl image carries (tool server, files, labels). Instructions
that have no Apptainer equivalent are listed in :attr:`Conversion.not_converted`
and logged; the build goes on without them. Multi-stage Dockerfiles are refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prorl_cli.exceptions import ConfigError
from prorl_cli.images.spec import FileCopy, ImageSpec

log = logging.getLogger("prorl.images")

#: Instructions an Apptainer image cannot express, and why.
UNSUPPORTED = {
    "EXPOSE": "ports are not part of an Apptainer image (services listen on the sandbox's loopback IP)",
    "VOLUME": "volumes are bound at run time, not declared in the image",
    "USER": "sandboxes run as the calling user (root inside with fakeroot)",
    "HEALTHCHECK": "Apptainer images have no health checks",
    "ONBUILD": "Apptainer has no build triggers",
    "STOPSIGNAL": "the sandbox runtime decides how its processes stop",
    "SHELL": "%post always runs /bin/sh",
}


def is_dockerfile(template: str) -> bool:
    """Whether an image entry's ``template`` names a Dockerfile rather than a Jinja definition."""
    name = Path(template).name
    return name == "Dockerfile" or name.startswith("Dockerfile.") or name.lower().endswith(".dockerfile")


@dataclass
class Conversion:
    """A Dockerfile converted: the definition, the files it copies, and what it left out."""

    definition: str
    files: list[FileCopy] = field(default_factory=list)
    from_image: str = ""
    not_converted: list[str] = field(default_factory=list)


def _instructions(text: str) -> list[tuple[int, str, str]]:
    """``(line, INSTRUCTION, arguments)`` with continuation lines joined and comments skipped."""
    out: list[tuple[int, str, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, args = buf.strip().partition(" ")
        out.append((start, word.upper(), args.strip()))
        buf = ""
    return out


def find_dockerfile(template: str, dirs: list[Path]) -> Path:
    """The Dockerfile an entry names: an absolute path, or relative to the first of ``dirs`` that has it."""
    p = Path(template).expanduser()
    if p.is_absolute():
        if p.is_file():
            return p
    else:
        for d in dirs:
            if (d / p).is_file():
                return (d / p).resolve()
    raise ConfigError(f"Dockerfile {template!r} not found (searched {', '.join(str(d) for d in dirs)})")


def convert_dockerfile(
    path: Path, spec: ImageSpec, *, header: str, prorl_version: str
) -> Conversion:
    """Convert ``path`` for the image ``spec`` (``header``: prorl's bootstrap lines for ``spec.base``)."""
    from spython.main.parse.parsers import DockerParser
    from spython.main.parse.writers import SingularityWriter

    text = path.read_text()
    # The definition (and so the lock key) names the Dockerfile by its bytes, not its path: the same recipe
    # in another folder (another user's copy of a dataset) is the same image in a shared cache.
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    instructions = _instructions(text)
    froms = [args for _, word, args in instructions if word == "FROM"]
    if len(froms) != 1:
        raise ConfigError(f"image {spec.name}: {path}: multi-stage Dockerfiles ({len(froms)} FROM lines) are not "
                          "supported; build the final stage's base as its own image")
    not_converted = [f"line {n}: {word} {args} - {UNSUPPORTED[word]}" for n, word, args in instructions if word in UNSUPPORTED]
    for n, word, args in instructions:
        if word in ("COPY", "ADD") and re.search(r"--(from|chown|chmod)\b", args):
            not_converted.append(f"line {n}: {word} {args} - flags --from/--chown/--chmod are ignored")
        if word == "ADD" and re.search(r"https?://", args):
            not_converted.append(f"line {n}: ADD {args} - URLs are not fetched; download in a RUN step")
    # FROM [--platform=...] IMAGE [AS NAME]: the image is the first word that is not a flag.
    from_image = next((word for word in froms[0].split() if not word.startswith("--")), None)
    if from_image is None:
        raise ConfigError(f"image {spec.name}: {path}: FROM names no image")
    if str(spec.base) != f"docker://{from_image}":
        not_converted.append(f"FROM {from_image}: replaced by the image list's base {spec.base}")

    with spython_messages() as spython_notes:
        recipe = DockerParser(str(path)).recipe
    not_converted += spython_notes
    (stage, parsed), *_ = recipe.items()
    context = path.parent
    files: list[FileCopy] = []
    pairs = []
    for src, dst in parsed.files:
        src_path = (context / src).resolve()
        if not src_path.exists():
            raise ConfigError(f"image {spec.name}: {path}: COPY source {src!r} does not exist in {context}")
        files.append(FileCopy(src_path, dst))
        pairs.append([str(src_path), dst])
    pairs += [[str(f.src), f.dst] for f in spec.files]
    parsed.files = pairs
    # What spython writes for unsupported instructions is dropped: a commented line, or "su - USER" for USER.
    parsed.install = [line for line in parsed.install
                      if not re.match(r"\s*(# ?(EXPOSE|VOLUME)\b|USER\s)", line)]
    parsed.test = None
    parsed.environ += [f"PRORL_IMAGE={spec.name}"]  # no tool server inside: the sandbox runtimes bind it
    # spython writes each label as its list of words joined by spaces.
    parsed.labels += [["org.prorl.image", spec.name], ["org.prorl.version", prorl_version],
                      ["org.prorl.base", str(spec.base)],
                      ["org.prorl.dockerfile", f"{path.name} sha256:{digest}"]]
    body = SingularityWriter(recipe).convert()
    body = body.split(f"Stage: {stage}", 1)[1].strip("\n")
    notes = "".join(f"# prorl: not converted: {note}\n" for note in not_converted)
    definition = f"{header}\n\n# prorl: converted from {path.name} (sha256:{digest}) by spython\n{notes}\n{body}\n"
    for note in not_converted:
        if note.startswith(f"FROM {from_image}: replaced"):
            # The image list's base is what its author asked for (generated --swe recipes always do it): no warning.
            log.debug("image %s: %s: %s", spec.name, path.name, note)
        else:
            log.warning("image %s: %s: not converted: %s", spec.name, path.name, note)
    return Conversion(definition, files, from_image, not_converted)


# spython's warnings that prorl checks better itself: COPY sources are looked up relative to the
# Dockerfile's folder (spython looks in the current directory, so every build warned).
_SPYTHON_CHECKED = (re.compile(r"doesn't exist, ensure exists for build"),)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def spython_messages() -> Iterator[list[str]]:
    """Silence spython's own printing while it parses; yields its warnings that still mean something.

    spython prints every message to stderr with a "WARNING" prefix (colored
    like an error on a terminal); prorl reports the real ones in its own
    not-converted list instead, and exits through spython's ``bot.exit`` become errors.
    """
    from spython.logger import bot
    from spython.logger.message import QUIET

    level, start = bot.level, len(bot.history)
    notes: list[str] = []
    bot.level = QUIET
    try:
        yield notes
    except SystemExit as e:  # spython's bot.exit
        raise ConfigError(f"spython could not parse the Dockerfile: {_spython_text(bot.history[start:])}") from e
    finally:
        bot.level = level
        emitted = list(bot.history[start:])
        del bot.history[start:]
    for message in emitted:
        plain = _ANSI.sub("", message).strip()
        if not plain.startswith(("WARNING ", "ERROR ")):
            continue  # its debug and info lines
        text = _spython_text([plain])
        if text and not any(p.search(text) for p in _SPYTHON_CHECKED):
            notes.append(f"spython: {text}")


def _spython_text(messages: list[str]) -> str:
    """spython's messages without their level prefixes and color codes."""
    text = " ".join(m.strip() for m in messages)
    text = _ANSI.sub("", text)
    return re.sub(r"\b(WARNING|ERROR|LOG|ABORT|CRITICAL) ", "", text).strip()
