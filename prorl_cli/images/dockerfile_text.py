"""Reading a Dockerfile as Docker does: its instructions, their flags, and the variables they expand."""

from __future__ import annotations

import platform
import re
import shlex
from dataclasses import dataclass, field

from prorl_cli.exceptions import ConfigError

#: Every instruction Docker knows; another word is an error, as in ``docker build``.
KNOWN = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
         "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}
# A here-document of RUN/COPY/ADD (BuildKit's syntax): <<EOF, <<-EOF, <<"EOF", <<'EOF'.
HEREDOC = re.compile(r"<<(-?)([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2")


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
    index: int = 0  # its place among the Dockerfile's instructions, which names its staging folders


def read_instructions(text: str) -> list[Instruction]:
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
            for m in HEREDOC.finditer(ins.args):
                strip_tabs, delimiter = m.group(1) == "-", m.group(3)
                body: list[str] = []
                while i < len(lines) and (lines[i].lstrip("\t") if strip_tabs else lines[i]) != delimiter:
                    body.append(lines[i].lstrip("\t") if strip_tabs else lines[i])
                    i += 1
                if i == len(lines):
                    raise ConfigError(f"line {start}: here-document <<{delimiter} is never closed (no line {delimiter!r})")
                i += 1
                ins.heredocs.append(Heredoc(delimiter, bool(m.group(2)), "\n".join(body)))
        ins.index = len(out)
        out.append(ins)
    return out


def leading_flags(args: str) -> tuple[list[str], str]:
    """The ``--name=value`` flags an instruction's arguments start with, and the arguments after them."""
    flags: list[str] = []
    while m := re.match(r"(--\S+)\s*", args):
        flags.append(m.group(1))
        args = args[m.end():]
    return flags, args


_VARIABLE = re.compile(r"(?<!\\)\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand(text: str, known: dict[str, str]) -> str:
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


def assignments(word: str, args: str) -> dict[str, str]:
    """The variables an ENV or ARG sets (an ARG without a default sets none), or the labels a LABEL sets."""
    try:
        words = shlex.split(args)
    except ValueError:
        return {}
    if word in ("ENV", "LABEL") and words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}  # ENV NAME VALUE WITH SPACES
    return dict(w.split("=", 1) for w in words if "=" in w)


def with_build_args(args: str, build_args: dict[str, str], consumed: set[str]) -> str:
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


def inherit(args: str, global_args: dict[str, str]) -> str:
    """An ARG line whose bare names take their global (before FROM) values, as Docker's re-declaration does."""
    out = []
    for word in re.findall(r"""(?:[^\s"']+|"[^"]*"|'[^']*')+""", args):
        if "=" not in word and word in global_args:
            value = global_args[word].replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
            word = f'{word}="{value}"'
        out.append(word)
    return " ".join(out)


#: ``uname -m`` as Docker names the architecture (its variant, for 32-bit ARM).
_ARCHES = {"x86_64": ("amd64", ""), "amd64": ("amd64", ""), "aarch64": ("arm64", ""), "arm64": ("arm64", ""),
           "armv7l": ("arm", "v7"), "armv6l": ("arm", "v6"), "i686": ("386", ""), "i386": ("386", ""),
           "ppc64le": ("ppc64le", ""), "s390x": ("s390x", ""), "riscv64": ("riscv64", "")}


def platform_args(machine: str | None = None) -> dict[str, str]:
    """BuildKit's automatic platform arguments (``TARGETARCH`` ...), for this host: Apptainer builds for the
    machine it runs on, so the build and the target platform are the same. Global, as in BuildKit: a stage sees
    one after its own ``ARG TARGETARCH``."""
    arch, variant = _ARCHES.get(machine or platform.machine(), (machine or platform.machine(), ""))
    plat = f"linux/{arch}" + (f"/{variant}" if variant else "")
    out: dict[str, str] = {}
    for side in ("TARGET", "BUILD"):
        out |= {f"{side}PLATFORM": plat, f"{side}OS": "linux", f"{side}ARCH": arch, f"{side}VARIANT": variant}
    return out
