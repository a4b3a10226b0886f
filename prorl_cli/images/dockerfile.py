"""Dockerfile recipes: converted to Apptainer definitions, with spython's help.

An image list entry whose ``template`` is a Dockerfile (``Dockerfile``,
``Dockerfile.NAME``, ``NAME.Dockerfile`` or ``NAME.dockerfile``) is read by
prorl as Docker reads it (continuation lines joined, comment lines inside
them dropped, here-documents read as bodies). prorl converts ``COPY``/``ADD``
(sources relative to the Dockerfile, destinations relative to ``WORKDIR``, a
folder's contents, local archives unpacked) and here-documents itself; spython's
``DockerParser`` (with ``ENV``/``ARG`` exported to later steps) and
``SingularityWriter`` convert the rest. prorl then puts its own header first
(the entry's ``base`` replaces ``FROM``, so an offline site can point it at a
local image) and adds its labels. Instructions that have no Apptainer
equivalent are listed in :attr:`Conversion.not_converted` and logged; the
build goes on without them. A multi-stage Dockerfile becomes a definition of
several stages (:mod:`prorl_cli.images.dockerfile_stages`); ``ADD`` of a URL
is fetched in %post.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import posixpath
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import ConfigError
from prorl_cli.images.dockerfile_copy import ADD_STAGING, COPY_STAGING, CopyConversion, convert_copy
from prorl_cli.images.dockerfile_mounts import (
    CACHE_MOUNTS,
    NO_MOUNTS,
    SECRET_MOUNTS,
    SSH_MOUNTS,
    BuildMounts,
    CacheMount,
    MountedStep,
    convert_mounts,
    mount_stages,
)
from prorl_cli.images.dockerfile_stages import (
    Stage,
    chain,
    find_stage,
    from_words,
    needed_stages,
    stage_name,
)
from prorl_cli.images.dockerfile_text import (
    HEREDOC,
    KNOWN,
    Instruction,
    assignments,
    expand,
    inherit,
    leading_flags,
    platform_args,
    read_instructions,
    with_build_args,
)
from prorl_cli.images.dockerfile_user import USER_FUNCTIONS, home_of, is_root, make_dirs_as, run_as
from prorl_cli.images.dockerignore import DockerIgnore
from prorl_cli.images.render import bootstrap_header
from prorl_cli.images.spec import FileCopy, ImageSpec, stage_base

log = logging.getLogger("prorl.images")

#: Instructions an Apptainer image cannot express, and why.
UNSUPPORTED = {
    "EXPOSE": "ports are not part of an Apptainer image (services listen on the sandbox's loopback IP)",
    "VOLUME": "volumes are bound at run time, not declared in the image",
    "USER": "an Apptainer image runs as whoever runs it (root inside with fakeroot); the build's steps after it run "
            "as that user, with its HOME",
    "HEALTHCHECK": "Apptainer images have no health checks",
    "ONBUILD": "Apptainer has no build triggers",
    "STOPSIGNAL": "the sandbox runtime decides how its processes stop",
}


@dataclass
class Conversion:
    """A Dockerfile converted: the definition, the files it copies, and what it left out."""

    definition: str
    files: list[FileCopy] = field(default_factory=list)
    from_image: str = ""
    not_converted: list[str] = field(default_factory=list)
    stage_images: list[str] = field(default_factory=list)  # what the other stages bootstrap, as the file names them
    caches: list[CacheMount] = field(default_factory=list)  # kept cache mounts the builder binds
    secrets: list[str] = field(default_factory=list)  # the ids of the secrets the builder binds
    ssh: list[str] = field(default_factory=list)  # the ids of the SSH agents the builder binds


def _run_script(ins: Instruction) -> str:
    """The shell script of a RUN: its command line, with any here-document bodies as they were written."""
    if len(ins.heredocs) == 1 and HEREDOC.sub("", ins.args).strip() == "":
        return ins.heredocs[0].body  # RUN <<EOF alone: the body is the script
    return ins.args + "".join(f"\n{d.body}\n{d.delimiter}" for d in ins.heredocs)


def _runscript(entrypoint: list[str] | None, cmd: list[str] | None, shell_entrypoint: bool) -> list[str]:
    """What ``docker run IMAGE [ARGS]`` runs, as runscript lines: the arguments replace CMD, ENTRYPOINT stays."""
    if entrypoint is not None and shell_entrypoint:
        return [f"exec {shlex.join(entrypoint)}"]  # a shell-form ENTRYPOINT ignores CMD and the arguments
    lines = [f'if [ "$#" -eq 0 ]; then set -- {shlex.join(cmd)}; fi'] if cmd else []
    if entrypoint is not None:
        return [*lines, f'exec {shlex.join(entrypoint)} "$@"']
    return [*lines, 'exec "$@"'] if cmd else []


def _json_argv(ins: Instruction, image: str, path: Path) -> list[str]:
    """The JSON list of an exec-form RUN, CMD or ENTRYPOINT, or of SHELL."""
    try:
        argv = json.loads(ins.args)
    except json.JSONDecodeError as e:
        raise ConfigError(f"image {image}: {path}: line {ins.line}: {ins.word} {ins.args}: not a JSON list ({e})") from e
    empty_ok = ins.word in ("CMD", "ENTRYPOINT")  # `ENTRYPOINT []` clears the base image's
    if not isinstance(argv, list) or not (argv or empty_ok) or not all(isinstance(a, str) for a in argv):
        raise ConfigError(f"image {image}: {path}: line {ins.line}: {ins.word} {ins.args}: expected a JSON list of strings")
    return argv


class _ExportingParser:
    """spython's ``DockerParser``, but ENV and ARG values reach the RUN steps after them, as in Docker.

    spython writes ``NAME=value`` into %post: a shell variable, not exported, so
    ``ENV DEBIAN_FRONTEND=noninteractive`` or ``ENV PIP_INDEX_URL=...`` never
    reached the programs the later steps ran.
    """

    @staticmethod
    def parse(lines: list[str], filename: str) -> Any:
        from spython.main.parse.parsers import DockerParser

        class Parser(DockerParser):
            def _exported(self, parse: Callable[[str], None], line: str) -> None:
                install = self.recipe[self.active_layer].install
                before = len(install)
                parse(line)
                install[before:] = [f"export {assignment}" for assignment in install[before:]]

            def _env(self, line: str) -> None:
                self._exported(super()._env, line)

            def _arg(self, line: str) -> None:
                self._exported(super()._arg, line)

        parser = Parser(None, load=False)
        parser.filename = filename
        parser.recipe = {parser.active_layer: parser.recipe[parser.active_layer]}
        parser.recipe[parser.active_layer].source = filename
        parser.lines = lines
        return parser.parse()


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
    path: Path, spec: ImageSpec, *, header: str, prorl_version: str,
    stage_header: Callable[[str], str] | None = None, mounts: BuildMounts = NO_MOUNTS,
) -> Conversion:
    """Convert ``path`` for the image ``spec`` (``header``: prorl's bootstrap lines for ``spec.base``).

    ``stage_header``: the bootstrap lines for an image another stage starts from or a ``COPY --from`` reads
    (its ``FROM`` reference as written); ``Bootstrap: docker`` with it when not given.
    ``mounts``: what the builder gives ``RUN --mount``s: kept cache folders (``Conversion.caches``), secrets
    (``Conversion.secrets``) and SSH agents (``Conversion.ssh``).
    """
    text = path.read_text()
    # The definition (and so the lock key) names the Dockerfile by its bytes, not its path: the same recipe
    # in another folder (another user's copy of a dataset) is the same image in a shared cache.
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    where = f"image {spec.name}: {path}"
    try:
        instructions = read_instructions(text)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e
    unknown = [ins for ins in instructions if ins.word not in KNOWN]
    if unknown:
        raise ConfigError(f"{where}: line {unknown[0].line}: unknown instruction {unknown[0].word}")
    first_from = next((n for n, ins in enumerate(instructions) if ins.word == "FROM"), None)
    if first_from is None:
        raise ConfigError(f"{where}: no FROM line")
    # The entry's variables are the Dockerfile's build arguments (docker build --build-arg NAME=VALUE).
    build_args = {k: str(v) for k, v in spec.variables.items() if k != "include"}
    consumed: set[str] = set()
    # An ARG before FROM is Docker's global build argument: FROM sees it, the steps after FROM only when the stage
    # declares it again (`ARG NAME`, which then takes the global value). Exported in %post it leaked into every step,
    # and a bare `ARG NAME` after FROM was reported as an ARG "without a default" though Docker gives it one.
    global_args: dict[str, str] = platform_args()
    for ins in instructions[:first_from]:
        if ins.word == "ARG":
            global_args.update(assignments("ARG", with_build_args(ins.args, build_args, consumed)))
    stages: list[Stage] = []
    copies_from: dict[int, list[tuple[str, int]]] = {}
    for ins in instructions[first_from:]:
        if ins.word == "FROM":
            image, alias = from_words(expand(ins.args, global_args))
            if image is None:
                raise ConfigError(f"{where}: line {ins.line}: FROM names no image")
            stages.append(Stage(len(stages), ins.line, image, alias, ins.args))
            continue
        if ins.word in ("COPY", "ADD"):
            # BuildKit names the stage a --from reads before any stage runs: by the global build arguments.
            flags, rest = leading_flags(ins.args)
            if any(f.startswith("--from=$") for f in flags):
                flags = [expand(f, global_args) if f.startswith("--from=") else f for f in flags]
                ins = dataclasses.replace(ins, args=" ".join([*flags, rest]))
            copies_from.setdefault(stages[-1].index, []).extend(
                (f.split("=", 1)[1], ins.line) for f in flags if f.startswith("--from="))
        if ins.word == "RUN":
            copies_from.setdefault(stages[-1].index, []).extend(
                (name, ins.line) for name in mount_stages(leading_flags(ins.args)[0], global_args))
        stages[-1].body.append(ins)
    needed = needed_stages(stages, copies_from, where)
    names: dict[int, str] = {}
    for i in needed:
        names[i] = stage_name(stages[i], set(names.values()))
    images: dict[str, str] = {}  # an image a COPY --from reads: the stage that bootstraps it

    def resolve_from(name: str, at: int) -> str:
        source = find_stage(stages, name, at)
        if source is not None and source.index not in names:
            # Only a --from whose value comes from the stage's own ARG: the stages to build were chosen without it.
            raise ConfigError(f"{where}: COPY --from={name}: the stage's own build argument names stage {name}; "
                              "name it in the Dockerfile or with a global ARG (before the first FROM)")
        if source is not None:
            return names[source.index]
        if name not in images:
            images[name] = f"image{len(images)}"
            while images[name] in names.values():
                images[name] += "_"
        return images[name]

    converter = _StageConverter(spec, path, build_args, consumed, global_args, mounts)
    parts: list[tuple[int, str, str]] = []  # (stage index, its bootstrap lines, its sections)
    files: list[FileCopy] = []
    not_converted: list[str] = []
    last = len(stages) - 1
    read: set[str] = set()  # the images the other stages bootstrap, and those a COPY --from reads
    for i in needed:
        root, body = chain(stages, i)
        sections, stage_files, notes = converter.convert(
            root.from_args, body, final=i == last, resolve_from=functools.partial(resolve_from, at=i),
            labels=[["org.prorl.image", spec.name], ["org.prorl.version", prorl_version],
                    ["org.prorl.base", str(spec.base)], ["org.prorl.dockerfile", f"{path.name} sha256:{digest}"]])
        files += stage_files
        not_converted += notes
        if i != last:
            read.add(root.image)
        parts.append((i, header if i == last else _stage_header(root.image, stage_header), sections))
    read |= set(images)
    from_image = chain(stages, last)[0].image
    not_converted += [f"variables.{name}: the Dockerfile has no ARG {name}" for name in sorted(set(build_args) - consumed)]
    not_converted += [f"stage_bases.{ref}: no stage of the Dockerfile starts from it or copies from it"
                      for ref in sorted(set(spec.stage_bases) - read)]
    if str(spec.base) != f"docker://{from_image}":
        not_converted.append(f"FROM {from_image}: replaced by the image list's base {spec.base}")
    notes_text = "".join(f"# prorl: not converted: {note}\n" for note in not_converted)
    converted = f"# prorl: converted from {path.name} (sha256:{digest}) by spython\n{notes_text}"
    # Apptainer binds only into a folder the image has: every stage makes the kept caches' folders before its %post
    # (a build's binds are every stage's).
    setup = "".join(f'mkdir -p "$APPTAINER_ROOTFS"{shlex.quote(f"{CACHE_MOUNTS}/{c.key}")}\n' for c in converter.caches)
    for folder, ids in ((SECRET_MOUNTS, converter.secrets), (SSH_MOUNTS, converter.ssh)):
        if ids:  # a file (or a socket) bound onto a file
            setup += f'mkdir -p "$APPTAINER_ROOTFS"{folder}\n' + "".join(
                f'touch "$APPTAINER_ROOTFS"{shlex.quote(f"{folder}/{i}")}\n' for i in ids)
    setup = f"\n%setup\n{setup}" if setup else ""
    if len(parts) == 1 and not images:
        definition = f"{header}\n\n{converted}\n{parts[0][2]}\n{setup}"
    else:
        # Apptainer builds the stages in order and keeps the last: each stage before the one that reads it.
        blocks = [f"{_stage_header(image, stage_header)}\nStage: {name}\n{setup}" for image, name in images.items()]
        for i, stage_lines, sections in parts:
            top = f"{converted}\n" if i == last else ""
            blocks.append(f"{stage_lines}\nStage: {names[i]}\n\n{top}{sections}\n{setup}")
        definition = "\n".join(blocks)
    for note in not_converted:
        if note.startswith(f"FROM {from_image}: replaced"):
            # The image list's base is what its author asked for (generated --swe recipes always do it): no warning.
            log.debug("image %s: %s: %s", spec.name, path.name, note)
        else:
            log.warning("image %s: %s: not converted: %s", spec.name, path.name, note)
    return Conversion(definition, files, from_image, not_converted, sorted(read), list(converter.caches),
                      list(converter.secrets), list(converter.ssh))


def dockerignore_of(dockerfile: Path) -> DockerIgnore:
    """The ignore file of a Dockerfile's context: ``NAME.dockerignore`` beside ``NAME`` first, as BuildKit reads it,
    else the context's ``.dockerignore``."""
    own = dockerfile.parent / f"{dockerfile.name}.dockerignore"
    return DockerIgnore(own.read_text(errors="replace")) if own.is_file() else DockerIgnore.of_context(dockerfile.parent)


def _stage_header(image: str, stage_header: Callable[[str], str] | None) -> str:
    """The bootstrap lines of a stage that starts from ``image`` (a Dockerfile's reference)."""
    if stage_header is not None:
        return stage_header(image)
    return bootstrap_header(stage_base(image, {}), base_path=None, mirror=None, docker_registry=None)


class _StageConverter:
    """One stage's instructions as definition sections: spython converts what prorl does not itself."""

    def __init__(self, spec: ImageSpec, path: Path, build_args: dict[str, str], consumed: set[str],
                 global_args: dict[str, str], mounts: BuildMounts) -> None:
        self.spec, self.path = spec, path
        self.build_args, self.consumed, self.global_args = build_args, consumed, global_args
        self.ignore = dockerignore_of(path)
        self.mounts = mounts
        self.caches: list[CacheMount] = []  # every stage's, in the order first met
        self.secrets: list[str] = []  # likewise
        self.ssh: list[str] = []  # likewise

    def convert(self, from_args: str, instructions: list[Instruction], *, final: bool, resolve_from: Callable[[str], str],
                labels: list[list[str]]) -> tuple[str, list[FileCopy], list[str]]:
        """The stage's sections, the host files it copies and what it did not convert.

        ``final``: the image's own stage, which gets prorl's labels, the image list's ``files`` and the runscript.
        """
        from spython.main.parse.writers import SingularityWriter

        spec, path = self.spec, self.path
        context = path.parent
        not_converted: list[str] = []
        files: list[FileCopy] = []
        pairs: list[list[str]] = []
        from_pairs: dict[str, list[tuple[str, str]]] = {}
        # What spython parses: one line per instruction; COPY/ADD and here-documents are prorl's (placeholders
        # keep their place among the RUN steps), instructions Apptainer cannot express are left out.
        feed: list[str] = [f"FROM {from_args}"]
        steps: list[str] = []

        def step(text: str) -> None:
            feed.append(f"RUN prorl-step-{len(steps)}")
            steps.append(text)

        def take(staged: CopyConversion | MountedStep) -> None:
            """What a copy or a RUN's mounts stage: host files for %files, other stages' for %files from."""
            not_converted.extend(staged.notes)
            if isinstance(staged, MountedStep):
                self.caches += [c for c in staged.caches if c not in self.caches]
                self.secrets += [s for s in staged.secrets if s not in self.secrets]
                self.ssh += [s for s in staged.ssh if s not in self.ssh]
            for src_path, src, dst in staged.files:
                files.append(FileCopy(src_path, dst))
                pairs.append([src, dst])
            for stage, src, dst in staged.from_files:
                from_pairs.setdefault(stage, []).append((src, dst))

        workdir, workdir_set = "/", False
        user: str | None = None  # USER's value, while it names someone other than root
        functions = False  # USER_FUNCTIONS are defined in this stage's %post

        def as_user(line: str) -> None:
            """A step that calls USER_FUNCTIONS: they are defined first, once a stage."""
            nonlocal functions
            if not functions:
                step(USER_FUNCTIONS)
                functions = True
            step(line)

        shell = ["/bin/sh", "-c"]
        run_argv: dict[str, list[str]] = {}  # CMD, ENTRYPOINT: the command each stands for
        shell_entrypoint = False
        known: dict[str, str] = {}  # ENV and ARG values so far
        docker_labels: list[list[str]] = []
        for ins in instructions:
            if ins.word in ("WORKDIR", "COPY", "ADD", "LABEL"):
                ins = dataclasses.replace(ins, args=expand(ins.args, known))
            if ins.word == "ARG":
                args = with_build_args(inherit(ins.args, self.global_args), self.build_args, self.consumed)
                ins = dataclasses.replace(ins, args=args)
                known.update(assignments(ins.word, ins.args))
            env: dict[str, str] = {}
            if ins.word == "ENV":
                # Docker splits ENV into words first, then expands each value: `ENV B=$A` with A="x y" is one variable.
                env = {k: expand(v, known) for k, v in assignments("ENV", ins.args).items()}
                known.update(env)
            mounted = MountedStep()
            if ins.word == "RUN":
                # BuildKit's RUN --mount/--network/--security are options of the step, not words of its command: left
                # in, `sh -c '--mount=type=cache,... pip install ...'` failed the build with "not found".
                run_flags, run_args = leading_flags(ins.args)
                if run_flags:
                    # A mount's from= may name a stage by a global build argument, as a COPY's --from does.
                    mounted = convert_mounts(ins, run_flags, known={**self.global_args, **known}, context=context,
                                             workdir=workdir, image=spec.name, path=path, resolve_from=resolve_from,
                                             ignore=self.ignore, given=self.mounts)
                    take(mounted)
                    ins = dataclasses.replace(ins, args=run_args)
            if ins.word in UNSUPPORTED:
                not_converted.append(f"line {ins.line}: {ins.word} {ins.args} - {UNSUPPORTED[ins.word]}")
                if ins.word == "USER":
                    value = expand(ins.args.strip(), known)
                    user = None if is_root(value) else value
                    step(home_of(value))
            elif ins.word in ("COPY", "ADD"):
                copy = convert_copy(ins, context, workdir, ins.index, spec.name, path, resolve_from, self.ignore,
                                    deferred=bool(steps))
                take(copy)
                for post in copy.post:
                    (as_user if copy.chown else step)(post)
            elif ins.word in ("CMD", "ENTRYPOINT"):
                exec_form = ins.args.startswith("[")
                run_argv[ins.word] = _json_argv(ins, spec.name, path) if exec_form else [*shell, ins.args]
                if ins.word == "ENTRYPOINT":
                    shell_entrypoint = not exec_form
            elif ins.word in ("LABEL", "MAINTAINER"):
                # spython wrote `LABEL a=b c=d` as one label named "a=b" with the value "c=d"
                pairs_set = {"maintainer": ins.args} if ins.word == "MAINTAINER" else assignments("LABEL", ins.args)
                docker_labels += [[k, v] for k, v in pairs_set.items()]
            elif ins.word == "SHELL":
                shell = _json_argv(ins, spec.name, path)
            elif ins.word == "RUN":
                if ins.args.startswith("[") and not ins.heredocs:
                    command = shlex.join(_json_argv(ins, spec.name, path))  # the exec form runs no shell
                else:
                    # As Docker does, each RUN is its own `sh -c SCRIPT` whose exit status decides: written as lines
                    # of %post (run with `sh -e`), a failure inside `a && b` or before `;` would not stop the build.
                    command = f"{shlex.join(shell)} {shlex.quote(_run_script(ins))}"
                (as_user if user else step)(mounted.wrap(run_as(user, command) if user else command, workdir))
            elif ins.word == "ENV" and env and not any('"' in v for v in env.values()):
                # One NAME="VALUE" word each, the form spython reads (it failed on `ENV NAME VALUE WITH SPACES`).
                feed.append("ENV " + " ".join(f"{k}={v}" if re.fullmatch(r"[\w./:@%+,=${}~-]+", v) else f'{k}="{v}"'
                                              for k, v in env.items()))
            elif ins.word == "WORKDIR":
                workdir, workdir_set = posixpath.normpath(posixpath.join(workdir, ins.args)), True
                if user:  # BuildKit makes the folders a WORKDIR after USER creates that user's
                    as_user(make_dirs_as(user, workdir))
                feed.append(f"WORKDIR {workdir}")
            else:
                feed.append(f"{ins.word} {ins.args}")
        staged = [dst for _, dst in pairs] + [dst for copies in from_pairs.values() for _, dst in copies]
        for staging in (ADD_STAGING, COPY_STAGING):
            if any(dst.startswith(staging + "/") for dst in staged):
                step(f"rm -rf {staging}")

        with spython_messages() as spython_notes:
            recipe = _ExportingParser.parse(feed, str(path))
        not_converted += spython_notes
        (stage, parsed), *_ = recipe.items()
        if final:
            pairs += [[str(f.src), f.dst] for f in spec.files]
        parsed.files = pairs
        parsed.test = None
        if final:
            parsed.environ += [f"PRORL_IMAGE={spec.name}"]  # no tool server inside: the sandbox runtimes bind it
        # spython writes each label as its list of words joined by spaces.
        parsed.labels = [*docker_labels, *labels] if final else []
        body = SingularityWriter(recipe).convert()
        body = body.split(f"Stage: {stage}", 1)[1].strip("\n")
        # The steps go in after spython's writer, which drops empty lines (a here-document's among them).
        body = re.sub(r"^prorl-step-(\d+)$", lambda m: steps[int(m.group(1))], body, flags=re.MULTILINE)
        # spython's runscript ran CMD through /bin/bash (`exec /bin/bash python app.py`) and joined words unquoted;
        # it is prorl's: Docker's ENTRYPOINT and CMD, or none (Apptainer keeps the base image's).
        body = body.split("\n%runscript\n", 1)[0]
        runscript = _runscript(run_argv.get("ENTRYPOINT") or None, run_argv.get("CMD") or None, shell_entrypoint)
        if runscript and final:
            lines = [f"cd {shlex.quote(workdir)}"] * workdir_set + runscript
            body += "".join(f"\n%{section}\n" + "\n".join(lines) for section in ("runscript", "startscript"))
        # Apptainer copies what other stages hold with the host's files, before %post: staged, then moved by steps.
        body = "".join(f"%files from {source}\n" + "".join(f"    {src} {dst}\n" for src, dst in copies) + "\n"
                       for source, copies in from_pairs.items()) + body
        return body, files, not_converted


# spython's warnings that prorl checks better itself: COPY sources are looked up relative to the
# Dockerfile's folder (spython looks in the current directory, so every build warned).
# `FROM scratch` is Apptainer's `Bootstrap: scratch`, not an image to pull, so spython's warning that Docker Hub
# has none is wrong here.
_SPYTHON_CHECKED = (re.compile(r"doesn't exist, ensure exists for build"),
                    re.compile(r"scratch is no longer available on Docker Hub"))
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
