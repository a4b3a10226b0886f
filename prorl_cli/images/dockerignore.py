"""``.dockerignore``: the files of a build context that ``COPY`` and ``ADD`` do not see, by Docker's rules.

One pattern a line (``#`` starts a comment); paths are relative to the
context, leading and trailing slashes dropped; ``*`` and ``?`` stay inside
one path component, ``**`` spans any number of them, ``[...]`` is a
character class; ``!`` makes an exception. The last pattern that matches a
path decides, and a pattern that matches a folder matches everything in it.
The pattern ``.`` is ignored, as Docker ignores it.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from prorl_cli.exceptions import ConfigError


@dataclass(frozen=True)
class _Pattern:
    regex: re.Pattern[str]
    exception: bool


def _translate(pattern: str, *, posix: bool = False) -> str:
    """A pattern as a regular expression over '/'-separated paths, unanchored: Python's, or with ``posix`` a
    POSIX extended one (``grep -E`` in an image)."""
    escape = _ere_escape if posix else re.escape
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*" and pattern[i + 1:i + 2] == "*":
            i += 2
            if pattern[i:i + 1] == "/":  # `**/`: any number of folders, none included
                out += "(.*/)?" if posix else "(?:.*/)?"
                i += 1
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out += escape(c)
            else:
                body = pattern[i + 1:end]
                body = "^" + body[1:] if body.startswith("^") else body
                # A backslash is literal inside a POSIX bracket expression; Python's needs it doubled.
                out += "[" + (body if posix else body.replace("\\", "\\\\")) + "]"
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += escape(pattern[i])
        else:
            out += escape(c)
        i += 1
    return out


def _ere_escape(c: str) -> str:
    return "\\" + c if c in ".[]()*+?{}|^$\\" else c


def _compile(pattern: str) -> re.Pattern[str]:
    """A pattern as an anchored regular expression over '/'-separated paths."""
    return re.compile("^" + _translate(pattern) + "$")


def posix_regex(patterns: list[str]) -> str:
    """A POSIX extended regular expression (for ``grep -E``) matching the '/'-separated paths that any of
    ``patterns`` (``.dockerignore`` syntax, no exceptions) matches, and everything inside them."""
    cleaned = [posixpath.normpath(p.strip("/")) for p in patterns if p.strip("/") not in ("", ".")]
    return "^(" + "|".join(_translate(p, posix=True) for p in cleaned) + ")(/.*)?$" if cleaned else "^$."


class DockerIgnore:
    """The patterns of one ``.dockerignore``; an empty one excludes nothing."""

    def __init__(self, text: str = "") -> None:
        self.patterns: list[_Pattern] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exception = line.startswith("!")
            line = line[1:].strip() if exception else line
            line = posixpath.normpath(line.strip("/")) if line.strip("/") else ""
            if line in ("", "."):
                continue
            self.patterns.append(_Pattern(_compile(line), exception))

    def excluding(self, patterns: list[str]) -> DockerIgnore:
        """These rules and ``patterns`` after them (a ``COPY --exclude``'s, context-relative), which then win."""
        out = DockerIgnore("\n".join(patterns))
        out.patterns = [*self.patterns, *out.patterns]
        return out

    @classmethod
    def of_context(cls, context: Path) -> DockerIgnore:
        """The context folder's ``.dockerignore``, or one that excludes nothing."""
        path = context / ".dockerignore"
        return cls(path.read_text(errors="replace")) if path.is_file() else cls()

    def excludes(self, relpath: str) -> bool:
        """Whether the context-relative path ``relpath`` ('/'-separated) is left out of the context."""
        parents = relpath.split("/")[:-1]
        excluded = False
        for p in self.patterns:
            if p.exception != excluded:
                continue  # it could not change the verdict
            if p.regex.match(relpath) or any(p.regex.match("/".join(parents[:n])) for n in range(1, len(parents) + 1)):
                excluded = not p.exception
        return excluded

    def included(self, context: Path, folder: Path) -> tuple[list[str], list[str]]:
        """What of ``folder`` (inside ``context``) ``COPY`` sees, as few paths as cover it, relative to ``folder``.

        Returns ``(parts, empty)``: ``parts`` are files and whole folders with nothing left out below them
        (``[""]``: the folder itself, when nothing in it is left out); ``empty`` are folders that stay though all
        they hold is left out (Docker still makes them). A folder left out whole is not walked, unless an
        exception may bring something in it back.
        """
        if not self.patterns:
            return [""], []
        walk_excluded = any(p.exception for p in self.patterns)
        base = folder.relative_to(context).as_posix()
        base = "" if base == "." else base + "/"

        def walk(path: Path, rel: str) -> tuple[list[str], list[str], bool]:
            """(parts, empty folders, whether nothing under ``path`` is left out)."""
            parts: list[str] = []
            empty: list[str] = []
            whole = True
            try:
                entries = sorted(os.scandir(path), key=lambda e: e.name)
            except OSError as e:
                raise ConfigError(f"cannot read {path} of the build context: {e.strerror or e}") from e
            for entry in entries:
                name = rel + entry.name
                left_out = self.excludes(base + name)
                if entry.is_dir(follow_symlinks=False):
                    if left_out and not walk_excluded:
                        whole = False
                        continue
                    sub_parts, sub_empty, sub_whole = walk(Path(entry.path), name + "/")
                    if sub_whole and not left_out:
                        parts.append(name)
                        continue
                    whole = False
                    parts += sub_parts
                    empty += sub_empty
                    if not left_out and not sub_parts and not sub_empty:
                        empty.append(name)
                elif left_out:
                    whole = False
                else:
                    parts.append(name)
            return parts, empty, whole

        parts, empty, whole = walk(folder, "")
        return ([""], []) if whole else (parts, empty)
