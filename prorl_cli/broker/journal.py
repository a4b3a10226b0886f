"""The broker's journal: accepted jobs and their results, replayed when a broker restarts.

An append-only file of msgpack records in the deployment folder:

- ``{"t": "job", "spec": JobSpec, "instance": bytes}`` when a job is accepted
  (written before the submit is answered);
- ``{"t": "placed", "job_id", "attempt", "node_id"}`` when it is placed on a
  node (written before the node hears of it);
- ``{"t": "attempt", "job_id", "attempt"}`` when its node died and it was
  queued again;
- ``{"t": "end", "job_id", "state", "result": bytes}`` when it finishes
  (written before its result is pushed);
- ``{"t": "weights", "checkpoint", "policy_version", "load_timeout_s", "verified"}``
  when every bridge has loaded a weight update: the deployment's current weights,
  which a bridge (re)joining after a broker restart must still load first
  (``verified``: a bridge has loaded them; written again when the first one
  does, for an update answered with none up; absent in older journals: false).

A restarted broker replays it: finished jobs keep their results for late
watchers; unfinished ones that were placed wait for the node they were placed
on to claim them (a node that registers again reports what it still runs)
and are queued again with their next attempt if it does not (failed,
``NodeLost``, on their last); never-placed ones are queued at once.
A torn last record (a crash mid-write) is reported and ignored; a damaged
stretch in the middle is skipped to the next record that reads back (a map
whose first key is ``"t"``), and an ended job whose result does not read back
ends failed (``JournalDamaged``). The file is
compacted (rewritten with only what a replay needs) when the broker starts,
and, off the broker's loop, whenever it has grown past ``compact_bytes`` (and
past twice its size after the last compaction): the loop hands a snapshot of
the records to a thread that writes and fsyncs a new file, keeps appending
to the old one meanwhile, and swaps files once the thread is done, after
appending to the new file what came in since the snapshot.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgpack

from prorl_cli.broker.state import Job
from prorl_cli.exceptions import JournalWriteError, ProtocolError
from prorl_cli.protocol import ErrorInfo, JobResult, JobSpec, JobState
from prorl_cli.protocol.framing import pack_obj, unpack_obj

log = logging.getLogger(__name__)

JOURNAL_NAME = "broker.journal"
# Instances and results at least this big are written by reference, never copied into a packed record
# (msgpack's bin 32 starts here, so the bytes on disk are what ``packb`` would give).
_BY_REFERENCE_BYTES = 1 << 16
_BIN32 = struct.Struct(">BI")


def packed_pieces(record: dict[str, Any], packer: msgpack.Packer) -> list[bytes]:
    """``record`` as msgpack, in pieces: big bytes values are the caller's own objects (no copy of a result)."""
    if not any(isinstance(v, bytes) and len(v) >= _BY_REFERENCE_BYTES for v in record.values()):
        return [packer.pack(record)]  # the common case, packed at once
    pieces: list[bytes] = []
    head = bytearray(packer.pack_map_header(len(record)))
    for key, value in record.items():
        head += packer.pack(key)
        if isinstance(value, bytes) and len(value) >= _BY_REFERENCE_BYTES:
            head += _BIN32.pack(0xC6, len(value))
            pieces += (bytes(head), value)
            head = bytearray()
        else:
            head += packer.pack(value)
    if head:
        pieces.append(bytes(head))
    return pieces


def job_record(spec: JobSpec, instance: bytes) -> dict[str, Any]:
    return {"t": "job", "spec": spec.to_wire(), "instance": instance}


def end_record(job_id: str, state: JobState, result: bytes) -> dict[str, Any]:
    return {"t": "end", "job_id": job_id, "state": state.value, "result": result}


def placed_record(job_id: str, attempt: int, node_id: str) -> dict[str, Any]:
    return {"t": "placed", "job_id": job_id, "attempt": attempt, "node_id": node_id}


def attempt_record(job_id: str, attempt: int) -> dict[str, Any]:
    return {"t": "attempt", "job_id": job_id, "attempt": attempt}


def weights_record(checkpoint: str, policy_version: int, load_timeout_s: float, verified: bool) -> dict[str, Any]:
    return {"t": "weights", "checkpoint": checkpoint, "policy_version": policy_version,
            "load_timeout_s": load_timeout_s, "verified": verified}


class Journal:
    """Appends records to ``path``; :meth:`replay` reads them back."""

    def __init__(self, path: Path, *, fsync: bool = False, compact_bytes: int = 256 * 1024 * 1024) -> None:
        self.path = path
        self.fsync = fsync
        self.compact_bytes = compact_bytes
        self._buffer: list[bytes] = []
        self._packer = msgpack.Packer(use_bin_type=True)  # the loop's; the compaction thread has its own
        self._file: Any = None
        self._size = 0
        self._compacted_size = 0  # right after the last rewrite
        # Background compaction: the thread, its error, where the old file stood at the snapshot,
        # and how far the thread copied what was appended to the old file after it.
        self._compactor: threading.Thread | None = None
        self._compact_error: OSError | None = None
        self._copied_until = 0
        #: The last ``weights`` record :meth:`replay` read (None: no update was ever loaded by every bridge).
        self.weights: dict[str, Any] | None = None
        #: The byte ranges the last :meth:`replay` skipped as damaged, ``(first, next record)``.
        self.damaged: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ reading

    def replay(self) -> dict[str, Job]:
        """The jobs the file records, in acceptance order (unfinished ones in the state they were accepted in).

        A damaged stretch (a page of zeros or garbage a crash left without ``journal_fsync``) is skipped to the
        next record that reads back: :attr:`damaged` lists the byte ranges, said once each.
        """
        jobs: dict[str, Job] = {}
        self.damaged = []
        if not self.path.exists():
            return jobs
        malformed = 0
        for n, record in enumerate(self._records()):
            try:
                if record["t"] == "weights":
                    self.weights = _checked_weights(record)
                    continue
                self._apply(jobs, record)
            except (KeyError, TypeError, ValueError) as e:
                malformed += 1
                if malformed <= 10:
                    log.error("journal %s: record %d is malformed (%s); skipped", self.path, n, e)
        if malformed > 10:
            log.error("journal %s: %d malformed records skipped in all", self.path, malformed)
        return jobs

    def _records(self) -> Iterator[dict[str, Any]]:
        """The file's records; past a damaged stretch, on from the next record that reads back."""
        with open(self.path, "rb") as f, contextlib.ExitStack() as stack:
            end = os.fstat(f.fileno()).st_size
            if end == 0:
                return
            view = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            pos = 0
            while pos < end:
                f.seek(pos)
                unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=1 << 31)
                good_until = pos
                while True:
                    try:
                        record = unpacker.unpack()
                    except msgpack.OutOfData:
                        if end == good_until:
                            return
                        # A torn last record, or damage that reads as the head of a record longer than the file
                        # (a length or count past its end): only a whole record after it tells the two apart.
                        resume = _next_record_start(view, good_until + 1, end)
                        if resume < end:
                            break
                        log.warning("journal %s: ignoring a torn record in its last %d bytes (a crash mid-write)",
                                    self.path, end - good_until)
                        return
                    except (msgpack.UnpackException, ValueError):
                        resume = _next_record_start(view, good_until + 1, end)
                        break
                    if not (isinstance(record, dict) and record.get("t") in _RECORD_TYPES):
                        resume = _next_record_start(view, good_until + 1, end)
                        break  # not a record: a damaged stretch begins here
                    good_until = pos + unpacker.tell()
                    yield record
                self.damaged.append((good_until, resume))
                log.error("journal %s: bytes %d-%d are damaged (%d bytes skipped); what they recorded is lost: jobs "
                          "accepted there are unknown to this broker, jobs placed or ended there run again", self.path,
                          good_until, resume, resume - good_until)
                pos = resume

    @staticmethod
    def _apply(jobs: dict[str, Job], record: dict[str, Any]) -> None:
        if record["t"] == "job":
            spec = JobSpec.from_wire(record["spec"])
            jobs.setdefault(spec.job_id, Job(spec=spec, instance=bytes(record["instance"])))
        elif record["t"] == "placed":
            job = jobs.get(record["job_id"])
            if job is not None:
                job.spec.attempt = int(record["attempt"])
                job.claim_node, job.claim_attempt = str(record["node_id"]), job.spec.attempt
        elif record["t"] == "attempt":
            job = jobs.get(record["job_id"])
            if job is not None:
                job.spec.attempt = int(record["attempt"])
                job.claim_node = job.claim_attempt = None
        elif record["t"] == "end":
            job = jobs.get(record["job_id"])
            if job is not None:
                state, result = JobState(record["state"]), bytes(record["result"])
                try:
                    JobResult.from_wire(unpack_obj(result))
                except ProtocolError as e:
                    # Its bytes were damaged on disk: say so as the job's failure, never hand out what cannot be read.
                    log.error("journal: the result of job %s (%s) does not read back (%s); it ends failed",
                              job.job_id, state.value, e)
                    state = JobState.FAILED
                    result = pack_obj(JobResult(
                        job_id=job.job_id, task=job.spec.task, state=state.value, attempt=job.spec.attempt,
                        critical_error="broker", group_id=job.spec.group_id, meta=job.spec.meta,
                        error=ErrorInfo(stage="broker", type="JournalDamaged",
                                        message="the job ended, but its result was damaged in the broker's journal "
                                                "(a crash without journal_fsync) and is lost").to_wire(),
                    ).to_wire())
                job.state, job.result = state, result
        else:
            raise ValueError(f"unknown record type {record['t']!r}")

    # ------------------------------------------------------------------ writing

    def append(self, record: dict[str, Any]) -> None:
        """Buffer a record; :meth:`flush` writes it."""
        self._buffer += packed_pieces(record, self._packer)

    def flush(self) -> bool:
        """Write what was appended since the last flush (and fsync when configured); whether there was any."""
        if not self._buffer:
            return False
        size = sum(map(len, self._buffer))
        try:
            if self._file is None:
                self._open()
            self._file.writelines(self._buffer)  # no joined copy: results of hundreds of KB are written in place
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        except OSError as e:
            # Nothing of this write stays on disk, and the records stay buffered for the next flush: the file
            # holds whole records only, whatever part of them reached it.
            self._rewind()
            raise JournalWriteError(f"journal {self.path}: cannot write ({e.strerror or e})") from e
        self._buffer.clear()
        self._size += size
        return True

    def _rewind(self) -> None:
        """After a failed write: drop what the file object holds and cut the file back to its last whole record."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()  # its own flush fails again; the descriptor is closed all the same
        with contextlib.suppress(OSError):
            os.truncate(self.path, self._size)

    def mark(self) -> int:
        """Where the records appended from now on start (for :meth:`discard_since`)."""
        return len(self._buffer)

    def discard_since(self, mark: int) -> None:
        """Forget the records appended since ``mark`` that no flush wrote (a submit refused after all)."""
        del self._buffer[mark:]

    def poll(self) -> None:
        """Swap in the compacted file once the background compaction is done (call from the loop)."""
        if self._compactor is not None and not self._compactor.is_alive():
            self._finish_compaction()

    def _open(self) -> None:
        # Held open for the broker's life; 0600 like the rendezvous file: instances may be private.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "ab")
        self._size = os.fstat(fd).st_size

    @property
    def size_bytes(self) -> int:
        """The journal file's size as written so far (the metrics' ``prorl_journal_bytes``)."""
        return self._size

    @property
    def compacting(self) -> bool:
        return self._compactor is not None

    @property
    def wants_compaction(self) -> bool:
        if self._compactor is not None:
            return False
        # Twice the compacted size at least: what a replay needs may itself exceed compact_bytes
        # (many retained results), and rewriting it every turn would stall the broker.
        return self._size > max(self.compact_bytes, 2 * self._compacted_size)

    def keep_aside(self, why: str) -> Path:
        """Keep the file as it is now beside itself, as ``broker.journal.<why>-<UTC time>``; return that path.

        A hard link (no copy of a journal of gigabytes, no disk space: :meth:`rewrite` replaces the file, the
        link keeps what it was); a copy (0600) where the file system has no links. :class:`OSError` if neither.
        """
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        copy = self.path.with_name(f"{self.path.name}.{why}-{stamp}")
        try:
            os.link(self.path, copy)
        except OSError:
            try:
                shutil.copyfile(self.path, copy)
                os.chmod(copy, 0o600)
            except OSError:
                copy.unlink(missing_ok=True)  # no half copy left to be taken for the whole file
                raise
        return copy

    def rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        """Replace the file with ``records`` (atomically: write beside it, fsync, rename)."""
        self.flush()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        packer = msgpack.Packer(use_bin_type=True)
        with open(tmp, "wb") as f:
            for record in records:
                f.writelines(packed_pieces(record, packer))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
        if self._file is not None:
            self._file.close()
        self._open()
        self._compacted_size = self._size
        log.info("journal %s compacted to %d bytes", self.path, self._size)

    @property
    def _tmp(self) -> Path:
        return self.path.with_name(self.path.name + ".tmp")

    def compact_in_background(self, records: Iterable[dict[str, Any]]) -> None:
        """Rewrite the file with ``records`` (a snapshot the loop took, iterated here) in a thread; :meth:`poll` swaps it in.

        Records appended meanwhile go to the old file as usual; the thread then copies them (from the
        file, not memory) after the snapshot, and the swap copies the little that came after that.
        """
        if self._compactor is not None:
            return
        self.flush()
        self._compact_error = None
        self._copied_until = self._size
        tmp, old = self._tmp, self.path

        def write() -> None:
            try:
                packer = msgpack.Packer(use_bin_type=True)
                with open(tmp, "wb") as f:
                    for record in records:
                        f.writelines(packed_pieces(record, packer))
                    self._copied_until = _copy_from(old, self._copied_until, f)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                self._compact_error = e

        self._compactor = threading.Thread(target=write, name="journal-compaction", daemon=True)
        self._compactor.start()

    def _finish_compaction(self) -> None:
        assert self._compactor is not None
        self._compactor.join()
        self._compactor = None
        if self._compact_error is not None:
            log.error("journal %s: compaction failed (%s); keeping the old file", self.path, self._compact_error)
            self._tmp.unlink(missing_ok=True)
            self._compacted_size = self._size  # do not retry at once
            return
        try:
            with open(self._tmp, "ab") as f:
                # What was appended after the thread's copy: one loop turn's worth or so.
                _copy_from(self.path, self._copied_until, f, until=self._size)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(self._tmp, 0o600)
        except OSError as e:  # a full disk: the old file is whole and stays
            log.error("journal %s: compaction failed (%s); keeping the old file", self.path, e)
            self._tmp.unlink(missing_ok=True)
            self._compacted_size = self._size
            return
        os.replace(self._tmp, self.path)
        if self._file is not None:
            self._file.close()
        self._open()
        self._compacted_size = self._size
        log.info("journal %s compacted to %d bytes (in the background)", self.path, self._size)

    def close(self) -> None:
        self.flush()
        if self._compactor is not None:
            self._finish_compaction()
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        """Close and delete the file (a clean stop: nothing in it is needed any more, nor what was not written)."""
        self._buffer.clear()
        self.close()
        self.path.unlink(missing_ok=True)
        self._tmp.unlink(missing_ok=True)


#: The record types a journal holds; each record is a map whose first key is ``"t"``.
_RECORD_TYPES = frozenset({"job", "placed", "attempt", "end", "weights"})


def _next_record_start(view: Any, start: int, end: int) -> int:
    """Where the first record at or after ``start`` begins (``end`` if none): a msgpack map (fixmap, 1 to 15
    keys) whose first key is ``"t"`` naming a record type, that reads back whole."""
    pos = start
    while True:
        hit = view.find(b"\xa1t", pos + 1, end)
        if hit < 0:
            return end
        first = hit - 1
        if first >= start and 0x81 <= view[first] <= 0x8F and _reads_back(view, first, end):
            return first
        pos = hit


def _reads_back(view: Any, first: int, end: int) -> bool:
    """Whether a whole journal record starts at ``first`` (read through a window that grows as a big record needs)."""
    window = 1 << 16
    while True:
        try:
            candidate = msgpack.unpackb(view[first:min(end, first + window)], raw=False)
        except msgpack.ExtraData as e:
            candidate = e.unpacked
        except (msgpack.UnpackException, ValueError):
            if first + window >= end:
                return False
            window *= 4  # cut short by the window (or not msgpack at all: then the file's end says so)
            continue
        return isinstance(candidate, dict) and candidate.get("t") in _RECORD_TYPES


def _checked_weights(record: dict[str, Any]) -> dict[str, Any]:
    """A ``weights`` record read back, its fields typed (ValueError/TypeError on a malformed one)."""
    checkpoint, version, timeout_s = record["checkpoint"], record["policy_version"], record["load_timeout_s"]
    if not isinstance(checkpoint, str) or not checkpoint or isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"weights record {record!r}: needs a checkpoint path and an integer policy version")
    # An older journal did not say: nothing then shows that a bridge loaded them (the first to rejoin does).
    verified = record.get("verified", False)
    if not isinstance(verified, bool):
        raise ValueError(f"weights record {record!r}: verified must be true or false")
    return weights_record(checkpoint, version, float(timeout_s), verified)


def _copy_from(path: Path, offset: int, out: Any, until: int | None = None, chunk: int = 1 << 20) -> int:
    """Append ``path``'s bytes from ``offset`` (to ``until``, or its current end) to ``out``; return where it stopped."""
    with open(path, "rb") as f:
        f.seek(offset)
        while until is None or offset < until:
            data = f.read(chunk if until is None else min(chunk, until - offset))
            if not data:
                break
            out.write(data)
            offset += len(data)
    return offset
