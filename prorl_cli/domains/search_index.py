"""A BM25 index over a JSONL corpus (``{id, title, text}`` per line, or FlashRAG's ``{id, contents}`` whose
first line is the quoted title), built once per node process.

Every job of a node that names the same corpus file gets the same
:class:`SearchIndex`: the first builds it (in a worker thread), the others
wait for that build and share it. A changed file (size or mtime) builds anew.
Retrieval uses ``bm25s``; install with ``pip install 'prorl[domains]'``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prorl_cli.exceptions import DatasetError, DomainError
from prorl_cli.jsonl import jsonl_objects


@dataclass(frozen=True)
class Document:
    """One passage of the corpus. ``heading``: a FlashRAG ``contents`` line's first line as written (the title
    in quotes), which Search-R1 shows its model; ``None`` for ``{id, title, text}`` lines."""

    doc_id: str
    title: str
    text: str
    heading: str | None = field(default=None, compare=False)  # how the corpus wrote the title, not another doc


@dataclass(frozen=True)
class Hit:
    doc_id: str
    title: str
    score: float
    snippet: str


def read_corpus(path: Path) -> list[Document]:
    """Documents of a JSONL corpus; a bad line is a :class:`DatasetError` naming file, line and field."""
    docs: list[Document] = []
    seen: set[str] = set()
    for lineno, row in jsonl_objects(path, DatasetError, expected="id, title, text"):
        heading = None
        if "text" not in row and isinstance(row.get("contents"), str):
            # FlashRAG / Search-R1 corpora: {id, contents}, the first line of contents the quoted title.
            heading, _, text = row["contents"].partition("\n")
            row = {**row, "title": row.get("title", heading.strip().strip('"')), "text": text}
        for key in ("id", "text"):
            if key not in row:
                raise DatasetError(f"{path}:{lineno}: missing field {key!r} (corpus lines are {{id, title, text}}"
                                   " or {id, contents})")
        doc_id = str(row["id"])
        if doc_id in seen:
            raise DatasetError(f"{path}:{lineno}: duplicate document id {doc_id!r}")
        seen.add(doc_id)
        docs.append(Document(doc_id, str(row.get("title", "")), str(row["text"]), heading))
    if not docs:
        raise DatasetError(f"{path}: the corpus has no documents")
    return docs


class SearchIndex:
    """BM25 over title + text of each document."""

    def __init__(self, docs: list[Document], source: str) -> None:
        import bm25s

        self.docs = docs
        self.source = source
        self._by_id = {d.doc_id: d for d in docs}
        started = time.perf_counter()
        self._retriever = bm25s.BM25()
        tokens = bm25s.tokenize([f"{d.title}\n{d.text}" for d in docs], stopwords="en", show_progress=False)
        self._retriever.index(tokens, show_progress=False)
        self.build_s = time.perf_counter() - started
        self._lock = threading.Lock()  # bm25s retrieval is not documented as thread-safe

    def search(self, query: str, k: int = 5) -> list[Hit]:
        """The ``k`` best documents for ``query`` (fewer when fewer match at all)."""
        import bm25s

        if not isinstance(query, str) or not query.strip():
            raise DomainError("search: query must be a non-empty string")
        k = max(1, min(int(k), len(self.docs)))
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not any(len(t) for t in tokens.ids):
            return []
        with self._lock:
            ids, scores = self._retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        hits = []
        for idx, score in zip(ids[0], scores[0], strict=True):
            if float(score) <= 0:
                continue
            d = self.docs[int(idx)]
            hits.append(Hit(d.doc_id, d.title, round(float(score), 4), d.text[:200]))
        return hits

    def open(self, doc_id: str) -> Document:
        """The whole document; :class:`DomainError` for an unknown id."""
        try:
            return self._by_id[str(doc_id)]
        except KeyError:
            raise DomainError(f"open: no document {doc_id!r} in the corpus") from None


_LOCK = threading.Lock()
_INDEXES: dict[tuple[str, int, int], SearchIndex] = {}
_BUILDING: dict[tuple[str, int, int], threading.Event] = {}
#: How many indexes this process has built (what the tests count).
BUILDS: dict[str, int] = {}


def get_index(path: str | os.PathLike[str]) -> tuple[SearchIndex, bool]:
    """The shared index of the corpus at ``path``, and whether this call built it. Blocking: call in a thread."""
    file = Path(path).expanduser().resolve()
    try:
        st = file.stat()
    except OSError as e:
        raise DatasetError(f"{file}: search corpus not readable: {e.strerror}") from e
    key = (str(file), st.st_size, st.st_mtime_ns)
    while True:
        with _LOCK:
            index = _INDEXES.get(key)
            if index is not None:
                return index, False
            waiting = _BUILDING.get(key)
            if waiting is None:
                _BUILDING[key] = threading.Event()
                break
        waiting.wait()
        with _LOCK:
            if key in _INDEXES:
                return _INDEXES[key], False
            # the build failed; try it ourselves (and raise its error)
    try:
        index = SearchIndex(read_corpus(file), str(file))
        with _LOCK:
            _INDEXES[key] = index
            BUILDS[str(file)] = BUILDS.get(str(file), 0) + 1
        return index, True
    finally:
        with _LOCK:
            _BUILDING.pop(key).set()


def hits_text(hits: list[Hit]) -> str:
    """What the model sees for a search: one line per hit."""
    if not hits:
        return "no results"
    return "\n".join(json.dumps({"id": h.doc_id, "title": h.title, "score": h.score, "snippet": h.snippet}) for h in hits)



def search_r1_passages(docs: list[Document]) -> str:
    """Passages as Search-R1's retriever shows them inside ``<information>``: ``Doc i(Title: T) text`` a line.

    ``T`` is a FlashRAG document's first ``contents`` line as written (:attr:`Document.heading`), else its title:
    the model reads the passages as it was trained to.
    """
    return "".join(f"Doc {i}(Title: {d.heading if d.heading is not None else d.title}) {d.text}\n"
                   for i, d in enumerate(docs, 1))
