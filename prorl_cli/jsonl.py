"""Reading and writing JSON Lines files (one JSON value per line); read errors name the file and the line.

Every JSONL reader of prorl (results files, dataset files, search corpora,
``prorl submit`` task files) goes through :func:`jsonl_values`, so a bad line
reads the same everywhere: ``FILE:LINE: not valid JSON: ...``. Each caller
passes the exception class of its own domain (``DatasetError``,
``ResultsFileError``, ...); the JSON or decoding error is its ``__cause__``.
Writers replace a file all or nothing (:func:`atomic_text_file`, also for
the other text outputs of prorl: a trace, an HTML report).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO, TypeVar

#: The error class a caller of :func:`jsonl_values` names, and so what its ``on_bad_line`` is handed.
E = TypeVar("E", bound=Exception)


def jsonl_values(path: Path, error_cls: type[E], *, hint: str = "",
                 on_bad_line: Callable[[E], None] | None = None) -> Iterator[tuple[int, Any]]:
    """``(line_number, value)`` for each non-blank line of ``path``, line numbers from 1.

    A line that is not JSON raises ``error_cls("FILE:LINE: not valid JSON: ...")``; a last line that is not
    JSON and has no newline at its end is named as cut off (a writer killed mid-line, a full disk), with how
    to read the whole lines before it; a file that is not UTF-8 text raises
    ``error_cls("FILE: not a UTF-8 text file...")``, with ``hint`` (what the file should be) in parentheses
    when given. A byte order mark at the start (Windows tools write one) is skipped.

    ``on_bad_line``: a line that is not JSON is passed to it as that ``error_cls`` (its JSON error the
    ``__cause__``) and the reading goes on with the next line; it may raise to stop instead. A file that is not
    UTF-8 text still raises: no line of it can be trusted.
    """
    whole = 0
    try:
        with path.open(encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    if not line.endswith("\n"):  # only the last line comes without its newline
                        bad = error_cls(
                            f"{path}:{lineno}: the last line is cut off (no newline at its end: the file's writer "
                            f"was stopped mid-line, e.g. killed); the {whole} line(s) before it are whole: drop the "
                            f"last line to read them (sed -i '$ d' {shlex.quote(str(path))})")
                    else:
                        bad = error_cls(f"{path}:{lineno}: not valid JSON: {e.msg}")
                    if on_bad_line is None:
                        raise bad from e
                    bad.__cause__ = e
                    on_bad_line(bad)
                    continue
                whole += 1
                yield lineno, value
    except UnicodeDecodeError as e:
        extra = f" ({hint})" if hint else ""
        raise error_cls(f"{path}: not a UTF-8 text file{extra}: {e.reason} at byte {e.start}") from e


def jsonl_objects(path: Path, error_cls: type[Exception], *, expected: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """As :func:`jsonl_values`, each line a JSON object; any other value raises ``error_cls`` naming the line.

    ``expected`` says what an object holds (``"id, title, text"``) for the message.
    """
    for lineno, value in jsonl_values(path, error_cls):
        if not isinstance(value, dict):
            what = f" with {expected}" if expected else ""
            raise error_cls(f"{path}:{lineno}: a line must be a JSON object{what}, got {type(value).__name__}")
        yield lineno, value


@contextmanager
def atomic_text_file(path: str | os.PathLike[str]) -> Iterator[TextIO]:
    """A UTF-8 text file to write that replaces ``path`` only once the ``with`` block ends without an error.

    The text goes to a temp file beside ``path`` (same filesystem, so the rename is atomic); whatever stops the
    write (an error, a full disk, Ctrl-C) leaves ``path`` as it was and no temp file behind.
    """
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            yield f
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_jsonl_atomic(path: str | os.PathLike[str], rows: Iterable[Any], *, allow_nan: bool = False) -> Path:
    """Write one JSON value per line to ``path``, all or nothing (:func:`atomic_text_file`): whatever stops the
    write (a row that is not JSON, a full disk, Ctrl-C) leaves ``path`` as it was and no temp file behind.
    Returns ``path``."""
    with atomic_text_file(path) as f:
        for row in rows:
            f.write(json.dumps(row, allow_nan=allow_nan) + "\n")
    return Path(path)


_PARQUET_MAGIC = b"PAR1"


def is_parquet(path: Path) -> bool:
    """A Parquet file rather than JSON lines: by its name (any case: ``.parquet``, ``.pq``), or by the magic bytes
    it starts with (a file named otherwise, or nothing); ``False`` for one that cannot be read (the JSONL reader
    names the problem)."""
    if path.suffix.lower() in (".parquet", ".pq"):
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == _PARQUET_MAGIC
    except OSError:
        return False
