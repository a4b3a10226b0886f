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
build goes on without them. Multi-stage Dockerfiles are refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import posixpath
import re
import shlex
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


#: Every instruction Docker knows; another word is an error, as in ``docker build``.
KNOWN = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
         "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}
# A here-document of RUN/COPY/ADD (BuildKit's syntax): <<EOF, <<-EOF, <<"EOF", <<'EOF'.
_HEREDOC = re.compile(r"<<(-?)([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2")
# Where ADD puts a local archive until %post unpacks it, and where a COPY that follows a RUN waits for its
# turn: %files are all copied before %post starts, so `RUN rm -rf /etc/app/*` then `COPY app.conf /etc/app/`
# would delete the copied file.
_ADD_STAGING = "/.prorl-add"
_COPY_STAGING = "/.prorl-copy"


@dataclass
class Heredoc:
    """One here-document of an instruction: its delimiter, whether it was quoted, and its lines."""

    delimiter: str
    quoted: bool
    body: str


@dataclass
class Instruction:
    """One Dockerfile instruction: continuation lines joined, its here-documents read."""

    line: int
    word: str
    args: str
    heredocs: list[Heredoc] = field(default_factory=list)


def _instructions(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile, read as Docker does.

    A backslash at the end of a line joins the next one; comment and empty
    lines inside a continued instruction are dropped (a comment line kept
    there would comment out the rest of the joined shell command); the lines
    after a here-document marker, up to its delimiter, are its body, not
    instructions.
    """
    lines = text.splitlines()
    out: list[Instruction] = []
    i = 0
    while i < len(lines):
        raw = lines[i].rstrip()
        i += 1
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        start, buf = i, raw
        while buf.endswith("\\"):
            buf = buf[:-1]
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                i += 1
            if i == len(lines):
                break
            buf += lines[i].rstrip()
            i += 1
        word, _, args = buf.strip().partition(" ")
        ins = Instruction(start, word.upper(), args.strip())
        if ins.word in ("RUN", "COPY", "ADD"):
            for m in _HEREDOC.finditer(ins.args):
                strip_tabs, delimiter = m.group(1) == "-", m.group(3)
                body: list[str] = []
                while i < len(lines) and (lines[i].lstrip("\t") if strip_tabs else lines[i]) != delimiter:
                    body.append(lines[i].lstrip("\t") if strip_tabs else lines[i])
                    i += 1
                if i == len(lines):
                    raise ConfigError(f"line {start}: here-document <<{delimiter} is never closed (no line {delimiter!r})")
                i += 1
                ins.heredocs.append(Heredoc(delimiter, bool(m.group(2)), "\n".join(body)))
        out.append(ins)
    return out


def _leading_flags(args: str) -> tuple[list[str], str]:
    """The ``--name=value`` flags an instruction's arguments start with, and the arguments after them."""
    flags: list[str] = []
    while m := re.match(r"(--\S+)\s*", args):
        flags.append(m.group(1))
        args = args[m.end():]
    return flags, args


def _in_workdir(dest: str, workdir: str) -> str:
    """``dest`` as an absolute path (Docker resolves a relative one against WORKDIR); a folder keeps its "/"."""
    if dest.startswith("/"):
        return dest
    path = posixpath.normpath(posixpath.join(workdir, dest))
    is_dir = dest.endswith("/") or posixpath.basename(dest) in (".", "..")
    return path.rstrip("/") + "/" if is_dir else path


def _run_script(ins: Instruction) -> str:
    """The shell script of a RUN: its command line, with any here-document bodies as they were written."""
    if len(ins.heredocs) == 1 and _HEREDOC.sub("", ins.args).strip() == "":
        return ins.heredocs[0].body  # RUN <<EOF alone: the body is the script
    return ins.args + "".join(f"\n{d.body}\n{d.delimiter}" for d in ins.heredocs)


@dataclass
class _Copy:
    """What one COPY/ADD became: files for %files, and %post lines to run at its place."""

    files: list[tuple[Path, str, str]] = field(default_factory=list)  # (source, %files source, %files dest)
    post: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _convert_copy(ins: Instruction, context: Path, workdir: str, index: int, image: str, path: Path,
                  deferred: bool = False) -> _Copy:
    """COPY/ADD with Docker's meaning: dest relative to WORKDIR, a folder's contents, ADD unpacking local tars.

    ``deferred``: a RUN came before, so the copy goes to a staging folder and a %post step moves it in place.
    """
    out = _Copy()
    where = f"image {image}: {path}: line {ins.line}"
    flags, rest = _leading_flags(ins.args)  # COPY [--chown=...] ... SRC... DEST, or the JSON form after the flags
    if rest.startswith("["):
        try:
            words = json.loads(rest)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: {ins.word} {ins.args}: not a JSON list ({e})") from e
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise ConfigError(f"{where}: {ins.word} {ins.args}: expected a JSON list of strings")
    else:
        words = rest.split()
    if any(f.startswith("--from") for f in flags):
        out.notes.append(f"line {ins.line}: {ins.word} {ins.args} - copies from another image or stage are not supported")
        return out
    ignored = [f for f in flags if not f.startswith("--link")]
    if ignored:
        out.notes.append(f"line {ins.line}: {ins.word} {ins.args} - flags {' '.join(ignored)} are ignored")
    if len(words) < 2:
        raise ConfigError(f"{where}: {ins.word} {ins.args}: needs a source and a destination")
    *sources, dest = words
    dest = _in_workdir(dest, workdir)
    docs = {d.delimiter: d for d in ins.heredocs}
    many = len(sources) > 1 or any(re.search(r"[*?\[]", s) for s in sources)
    if many and not dest.endswith("/"):
        dest += "/"  # Docker requires it for several sources; it means a folder
    for src in sources:
        m = _HEREDOC.fullmatch(src)
        if m and m.group(3) in docs:
            doc = docs[m.group(3)]
            target = dest + doc.delimiter if dest.endswith("/") else dest
            quote = "'" if doc.quoted else ""
            # One simple command a line: %post runs with `sh -e`, which does not stop at a failure inside `a && b`.
            out.post.append(f"mkdir -p {shlex.quote(posixpath.dirname(target) or '/')}")
            out.post.append(f"cat > {shlex.quote(target)} <<{quote}{doc.delimiter}{quote}\n{doc.body}\n{doc.delimiter}")
            continue
        if ins.word == "ADD" and re.match(r"https?://", src):
            out.notes.append(f"line {ins.line}: ADD {ins.args} - URLs are not fetched; download in a RUN step")
            continue
        matches = sorted(context.glob(src)) if re.search(r"[*?\[]", src) else [context / src]
        matches = [p.resolve() for p in matches if p.exists()]
        if not matches:
            raise ConfigError(f"{where}: {ins.word} source {src!r} does not exist in {context}")
        for src_path in matches:
            if ins.word == "ADD" and src_path.is_file() and tarfile.is_tarfile(src_path):
                # Docker unpacks a local tar archive (plain or compressed) that ADD names into the destination.
                staged = f"{_ADD_STAGING}/{index}-{src_path.name}"
                out.files.append((src_path, str(src_path), staged))
                into = dest if dest.endswith("/") else dest + "/"
                out.post += [f"mkdir -p {shlex.quote(into)}", f"tar -xf {shlex.quote(staged)} -C {shlex.quote(into)}",
                             f"rm -f {shlex.quote(staged)}"]
            elif src_path.is_dir():
                # Docker copies a folder's contents; Apptainer's `cp -r SRC DEST` would nest SRC inside an existing DEST.
                into = dest if dest.endswith("/") else dest + "/"
                if deferred:
                    stage = f"{_COPY_STAGING}/{index}-{len(out.files)}/"
                    out.files.append((src_path, f"{src_path}/.", stage))
                    out.post += [f"mkdir -p {shlex.quote(into)}", f"cp -fR {shlex.quote(stage)}. {shlex.quote(into)}"]
                else:  # `cp -r SRC/. DEST` fills DEST, whether or not the image has it yet
                    out.files.append((src_path, f"{src_path}/.", dest))
            else:
                target = dest + src_path.name if dest.endswith("/") else dest
                if deferred:
                    # The staged file keeps its name: `cp` into a DEST that is a folder of the image names it so.
                    stage = f"{_COPY_STAGING}/{index}-{len(out.files)}/{src_path.name}"
                    out.files.append((src_path, str(src_path), stage))
                    out.post += [f"mkdir -p {shlex.quote(posixpath.dirname(target) or '/')}",
                                 f"cp -f {shlex.quote(stage)} {shlex.quote(target)}"]
                else:
                    out.files.append((src_path, str(src_path), target))
    return out


_VARIABLE = re.compile(r"(?<!\\)\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def _expand(text: str, known: dict[str, str]) -> str:
    """``$NAME``, ``${NAME}``, ``${NAME:-word}``, ``${NAME:+word}`` of ENV and ARG values, as Docker expands them in
    WORKDIR, COPY, ADD and ENV; a name the Dockerfile does not set (``$PATH`` of the base) is left to the shell,
    but for ``${NAME:-word}``, which is ``word``."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        if name not in known:
            return m.group(3) if m.group(2) == "-" else m.group(0)
        value = known[name]
        if m.group(2) == "-":
            return value or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if value else ""
        return value

    return _VARIABLE.sub(sub, text)


def _assignments(word: str, args: str) -> dict[str, str]:
    """The variables an ENV or ARG sets (an ARG without a default sets none), or the labels a LABEL sets."""
    try:
        words = shlex.split(args)
    except ValueError:
        return {}
    if word in ("ENV", "LABEL") and words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}  # ENV NAME VALUE WITH SPACES
    return dict(w.split("=", 1) for w in words if "=" in w)


def _with_build_args(args: str, build_args: dict[str, str], consumed: set[str]) -> str:
    """An ARG line with the values the image list gives (they win over the defaults, as --build-arg does)."""
    out = []
    for word in re.findall(r"""(?:[^\s"']+|"[^"]*"|'[^']*')+""", args):  # quoted defaults stay one word
        name = word.split("=", 1)[0]
        if name in build_args:
            consumed.add(name)
            value = build_args[name].replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
            word = f'{name}="{value}"'
        out.append(word)
    return " ".join(out)


def _inherit(args: str, global_args: dict[str, str]) -> str:
    """An ARG line whose bare names take their global (before FROM) values, as Docker's re-declaration does."""
    out = []
    for word in re.findall(r"""(?:[^\s"']+|"[^"]*"|'[^']*')+""", args):
        if "=" not in word and word in global_args:
            value = global_args[word].replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
            word = f'{word}="{value}"'
        out.append(word)
    return " ".join(out)


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
    path: Path, spec: ImageSpec, *, header: str, prorl_version: str
) -> Conversion:
    """Convert ``path`` for the image ``spec`` (``header``: prorl's bootstrap lines for ``spec.base``)."""
    from spython.main.parse.writers import SingularityWriter

    text = path.read_text()
    # The definition (and so the lock key) names the Dockerfile by its bytes, not its path: the same recipe
    # in another folder (another user's copy of a dataset) is the same image in a shared cache.
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    try:
        instructions = _instructions(text)
    except ConfigError as e:
        raise ConfigError(f"image {spec.name}: {path}: {e}") from e
    unknown = [ins for ins in instructions if ins.word not in KNOWN]
    if unknown:
        raise ConfigError(f"image {spec.name}: {path}: line {unknown[0].line}: unknown instruction {unknown[0].word}")
    froms = [ins.args for ins in instructions if ins.word == "FROM"]
    if len(froms) != 1:
        raise ConfigError(f"image {spec.name}: {path}: multi-stage Dockerfiles ({len(froms)} FROM lines) are not "
                          "supported; build the final stage's base as its own image")
    # FROM [--platform=...] IMAGE [AS NAME]: the image is the first word that is not a flag.
    from_image = next((word for word in froms[0].split() if not word.startswith("--")), None)
    if from_image is None:
        raise ConfigError(f"image {spec.name}: {path}: FROM names no image")
    not_converted: list[str] = []
    context = path.parent
    files: list[FileCopy] = []
    pairs: list[list[str]] = []
    # What spython parses: one line per instruction; COPY/ADD and here-documents are prorl's (placeholders
    # keep their place among the RUN steps), instructions Apptainer cannot express are left out.
    feed: list[str] = []
    steps: list[str] = []

    def step(text: str) -> None:
        feed.append(f"RUN prorl-step-{len(steps)}")
        steps.append(text)

    workdir, workdir_set = "/", False
    shell = ["/bin/sh", "-c"]
    run_argv: dict[str, list[str]] = {}  # CMD, ENTRYPOINT: the command each stands for
    shell_entrypoint = False
    known: dict[str, str] = {}  # ENV and ARG values so far
    labels: list[list[str]] = []
    # The entry's variables are the Dockerfile's build arguments (docker build --build-arg NAME=VALUE).
    build_args = {k: str(v) for k, v in spec.variables.items() if k != "include"}
    consumed: set[str] = set()
    # An ARG before FROM is Docker's global build argument: FROM sees it, the steps after FROM only when the stage
    # declares it again (`ARG NAME`, which then takes the global value). Exported in %post it leaked into every step,
    # and a bare `ARG NAME` after FROM was reported as an ARG "without a default" though Docker gives it one.
    first_from = next(n for n, ins in enumerate(instructions) if ins.word == "FROM")
    global_args: dict[str, str] = {}
    for ins in instructions[:first_from]:
        if ins.word == "ARG":
            global_args.update(_assignments("ARG", _with_build_args(ins.args, build_args, consumed)))
    from_image = _expand(from_image, global_args)
    for n, ins in enumerate(instructions):
        if n < first_from:
            continue  # only ARG (and comments) may come before FROM; their values are in global_args
        if ins.word in ("WORKDIR", "COPY", "ADD", "LABEL"):
            ins = dataclasses.replace(ins, args=_expand(ins.args, known))
        if ins.word == "ARG":
            ins = dataclasses.replace(ins, args=_with_build_args(_inherit(ins.args, global_args), build_args, consumed))
            known.update(_assignments(ins.word, ins.args))
        env: dict[str, str] = {}
        if ins.word == "ENV":
            # Docker splits ENV into words first, then expands each value: `ENV B=$A` with A="x y" is one variable.
            env = {k: _expand(v, known) for k, v in _assignments("ENV", ins.args).items()}
            known.update(env)
        if ins.word == "RUN":
            # BuildKit's RUN --mount/--network/--security are options of the step, not words of its command: left
            # in, `sh -c '--mount=type=cache,... pip install ...'` failed the build with "not found".
            run_flags, run_args = _leading_flags(ins.args)
            if run_flags:
                not_converted.append(f"line {ins.line}: RUN {' '.join(run_flags)} - flags are ignored: the step runs "
                                     "without them (no cache, bind, secret or ssh mount; the build's own network)")
                ins = dataclasses.replace(ins, args=run_args)
        if ins.word in UNSUPPORTED:
            not_converted.append(f"line {ins.line}: {ins.word} {ins.args} - {UNSUPPORTED[ins.word]}")
        elif ins.word in ("COPY", "ADD"):
            copy = _convert_copy(ins, context, workdir, n, spec.name, path, deferred=bool(steps))
            not_converted += copy.notes
            for src_path, src, dst in copy.files:
                files.append(FileCopy(src_path, dst))
                pairs.append([src, dst])
            for post in copy.post:
                step(post)
        elif ins.word in ("CMD", "ENTRYPOINT"):
            exec_form = ins.args.startswith("[")
            run_argv[ins.word] = _json_argv(ins, spec.name, path) if exec_form else [*shell, ins.args]
            if ins.word == "ENTRYPOINT":
                shell_entrypoint = not exec_form
        elif ins.word in ("LABEL", "MAINTAINER"):
            # spython wrote `LABEL a=b c=d` as one label named "a=b" with the value "c=d"
            pairs_set = {"maintainer": ins.args} if ins.word == "MAINTAINER" else _assignments("LABEL", ins.args)
            labels += [[k, v] for k, v in pairs_set.items()]
        elif ins.word == "SHELL":
            shell = _json_argv(ins, spec.name, path)
        elif ins.word == "RUN" and ins.args.startswith("[") and not ins.heredocs:
            step(shlex.join(_json_argv(ins, spec.name, path)))  # the exec form runs no shell
        elif ins.word == "RUN":
            # As Docker does, each RUN is its own `sh -c SCRIPT` whose exit status decides: written as lines of
            # %post (run with `sh -e`), a failure inside `a && b` or before `;` would not stop the build.
            step(f"{shlex.join(shell)} {shlex.quote(_run_script(ins))}")
        elif ins.word == "ENV" and env and not any('"' in v for v in env.values()):
            # One NAME="VALUE" word each, the form spython reads (it failed on `ENV NAME VALUE WITH SPACES`).
            feed.append("ENV " + " ".join(f"{k}={v}" if re.fullmatch(r"[\w./:@%+,=${}~-]+", v) else f'{k}="{v}"'
                                          for k, v in env.items()))
        elif ins.word == "WORKDIR":
            workdir, workdir_set = posixpath.normpath(posixpath.join(workdir, ins.args)), True
            feed.append(f"WORKDIR {workdir}")
        else:
            feed.append(f"{ins.word} {ins.args}")
    for staging in (_ADD_STAGING, _COPY_STAGING):
        if any(dst.startswith(staging + "/") for _, dst in pairs):
            step(f"rm -rf {staging}")
    not_converted += [f"variables.{name}: the Dockerfile has no ARG {name}" for name in sorted(set(build_args) - consumed)]
    if (context / ".dockerignore").exists() and any(f.src.is_dir() for f in files):
        not_converted.append(".dockerignore: not applied; the folders COPY names are copied whole")
    if str(spec.base) != f"docker://{from_image}":
        not_converted.append(f"FROM {from_image}: replaced by the image list's base {spec.base}")

    with spython_messages() as spython_notes:
        recipe = _ExportingParser.parse(feed, str(path))
    not_converted += spython_notes
    (stage, parsed), *_ = recipe.items()
    pairs += [[str(f.src), f.dst] for f in spec.files]
    parsed.files = pairs
    parsed.test = None
    parsed.environ += [f"PRORL_IMAGE={spec.name}"]  # no tool server inside: the sandbox runtimes bind it
    # spython writes each label as its list of words joined by spaces.
    parsed.labels = [*labels, ["org.prorl.image", spec.name], ["org.prorl.version", prorl_version],
                     ["org.prorl.base", str(spec.base)],
                     ["org.prorl.dockerfile", f"{path.name} sha256:{digest}"]]
    body = SingularityWriter(recipe).convert()
    body = body.split(f"Stage: {stage}", 1)[1].strip("\n")
    # The steps go in after spython's writer, which drops empty lines (a here-document's among them).
    body = re.sub(r"^prorl-step-(\d+)$", lambda m: steps[int(m.group(1))], body, flags=re.MULTILINE)
    # spython's runscript ran CMD through /bin/bash (`exec /bin/bash python app.py`) and joined words unquoted;
    # it is prorl's: Docker's ENTRYPOINT and CMD, or none (Apptainer keeps the base image's).
    body = body.split("\n%runscript\n", 1)[0]
    runscript = _runscript(run_argv.get("ENTRYPOINT") or None, run_argv.get("CMD") or None, shell_entrypoint)
    if runscript:
        lines = [f"cd {shlex.quote(workdir)}"] * workdir_set + runscript
        body += "".join(f"\n%{section}\n" + "\n".join(lines) for section in ("runscript", "startscript"))
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
