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


@dataclass(frozen=True)
class _Pattern:
    regex: re.Pattern[str]
    exception: bool


def _compile(pattern: str) -> re.Pattern[str]:
    """A pattern as an anchored regular expression over '/'-separated paths."""
    out, i = "^", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*" and pattern[i + 1:i + 2] == "*":
            i += 2
            if pattern[i:i + 1] == "/":  # `**/`: any number of folders, none included
                out += "(?:.*/)?"
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
                out += re.escape(c)
            else:
                body = pattern[i + 1:end]
                out += "[" + ("^" + body[1:] if body.startswith("^") else body).replace("\\", "\\\\") + "]"
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + "$")


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

    def excluded_under(self, context: Path, folder: Path) -> list[str]:
        """What ``.dockerignore`` leaves out of ``folder`` (inside ``context``), relative to ``folder``: a folder
        that is left out whole is named once, not walked, unless an exception may bring something in it back."""
        if not self.patterns:
            return []
        walk_excluded = any(p.exception for p in self.patterns)
        out: list[str] = []
        base = folder.relative_to(context).as_posix()
        base = "" if base == "." else base + "/"
        for root, dirs, files in os.walk(folder):
            rel_root = Path(root).relative_to(folder).as_posix()
            rel_root = "" if rel_root == "." else rel_root + "/"
            for d in sorted(dirs):
                if self.excludes(base + rel_root + d) and not walk_excluded:
                    out.append(rel_root + d)
                    dirs.remove(d)
            out += [rel_root + f for f in sorted(files) if self.excludes(base + rel_root + f)]
        return out
