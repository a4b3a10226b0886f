"""A journal damaged in the middle (a crash without ``journal_fsync`` can leave a page of zeros): what a replay
keeps, and what a restarted broker tells. The file is the real journal format, written by :class:`Journal`."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest

from prorl_cli.broker.journal import Journal, end_record, job_record
from prorl_cli.protocol import JobResult, JobSpec, JobState
from prorl_cli.protocol.framing import pack_obj, unpack_obj
from prorl_cli.testing.harness import Deployment, fixed_port


def _write(path: Path, n: int) -> list[tuple[int, int]]:
    """``n`` jobs, each accepted then ended done; the byte range of each job's two records."""
    journal = Journal(path)
    spans = []
    for i in range(n):
        start = path.stat().st_size if path.exists() else 0
        spec = JobSpec(job_id=f"j{i:03d}", task="test")
        journal.append(job_record(spec, pack_obj({"i": i})))
        result = JobResult(job_id=spec.job_id, task="test", state="done", attempt=1, reward=1.0, output={"i": i})
        journal.append(end_record(spec.job_id, JobState.DONE, pack_obj(result.to_wire())))
        journal.flush()
        spans.append((start, path.stat().st_size))
    journal.close()
    return spans


def _damage(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_stretch_of_zeros_is_skipped_to_the_next_record_and_said_once(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "broker.journal"
    spans = _write(path, 40)
    # Zeros over jobs 10-12 whole and into job 13's first record.
    first, last = spans[10][0], spans[13][0] + 5
    _damage(path, first, b"\0" * (last - first))
    with caplog.at_level(logging.WARNING, logger="prorl_cli.broker.journal"):
        journal = Journal(path)
        jobs = journal.replay()
    lost = {"j010", "j011", "j012", "j013"}
    assert set(jobs) == {f"j{i:03d}" for i in range(40)} - lost, "every record after the stretch is read back"
    assert all(job.state == JobState.DONE for job in jobs.values())
    assert len(journal.damaged) == 1 and journal.damaged[0][0] == first and journal.damaged[0][1] >= last
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) <= 2, errors  # one line for the stretch (and one for j013's orphaned end), not one per byte
    assert "damaged" in errors[0] and str(first) in errors[0]


@pytest.mark.parametrize("head", [b"\xc6\x7f\xff\xff\xff", b"\xdd\x00\xff\xff\xff", b"\x95"],
                         ids=["bin32", "array32", "fixarray"])
def test_damage_that_reads_as_a_record_longer_than_the_file_is_skipped_not_taken_for_a_torn_tail(
        tmp_path: Path, head: bytes) -> None:
    """Garbage whose first bytes are a msgpack length or count past the file's end reads like a record cut by a
    crash; the whole records after it say it was damage, and they are read back."""
    path = tmp_path / "broker.journal"
    spans = _write(path, 20)
    _damage(path, spans[5][0], head + b"\x01" * (spans[6][1] - spans[5][0] - len(head)))
    journal = Journal(path)
    jobs = journal.replay()
    assert set(jobs) == {f"j{i:03d}" for i in range(20)} - {"j005", "j006"}
    assert len(journal.damaged) == 1 and journal.damaged[0][0] == spans[5][0]


def test_a_torn_last_record_is_dropped_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "broker.journal"
    spans = _write(path, 5)
    with open(path, "r+b") as f:
        f.truncate(spans[4][1] - 7)
    with caplog.at_level(logging.WARNING, logger="prorl_cli.broker.journal"):
        journal = Journal(path)
        jobs = journal.replay()
    assert set(jobs) == {f"j{i:03d}" for i in range(5)} and not journal.damaged
    assert any("torn record" in r.getMessage() for r in caplog.records)


def test_a_result_damaged_on_disk_ends_its_job_failed_saying_so(tmp_path: Path) -> None:
    path = tmp_path / "broker.journal"
    spans = _write(path, 5)
    # Garble bytes well inside job 2's end record (its result bytes), keeping the record's framing.
    start, stop = spans[2]
    raw = path.read_bytes()
    at = raw.index(b"\xa6output", start, stop)
    _damage(path, at, b"\xc1\xc1\xc1")  # 0xc1: never used in msgpack
    jobs = Journal(path).replay()
    assert set(jobs) == {f"j{i:03d}" for i in range(5)}
    job = jobs["j002"]
    assert job.state == JobState.FAILED
    result = JobResult.from_wire(unpack_obj(job.result))
    assert result.state == "failed" and result.error is not None and result.error["type"] == "JournalDamaged"
    assert jobs["j003"].state == JobState.DONE


def test_a_broker_restarted_on_a_damaged_journal_serves_what_reads_back_and_keeps_the_file(tmp_path: Path) -> None:
    with Deployment(tmp_path / "home", "dmg", config={"broker": {"port": fixed_port(), "journal": True}}) as d:
        d.start_broker()
        d.start_node("n1")
        ids = d.client.submit("test", [{"echo": i} for i in range(30)])
        assert all(r.ok for r in d.client.wait(ids, timeout_s=60))
        d.kill("broker", signal.SIGKILL)
        journal = d.deployment_dir / "broker.journal"
        size = journal.stat().st_size
        _damage(journal, size // 3, b"\0" * 600)
        d.start_broker()
        fresh = d.new_client()
        read_back = {}
        for job_id in ids:
            states = fresh.list_jobs(prefix=job_id)
            if states:
                read_back[job_id] = fresh.result(job_id, timeout_s=30)
        fresh.close()
        # Jobs whose end record was in the stretch run again; only one whose acceptance was there would be unknown.
        assert len(read_back) >= 20, "the jobs before and after the stretch are there"
        assert all(r.state in ("done", "failed") for r in read_back.values())
        assert ids[-1] in read_back and read_back[ids[-1]].output["echo"] == 29, "records after the stretch replay"
        log = d.log("broker")
        assert "damaged" in log and log.count("is malformed") <= 10
        kept = list(journal.parent.glob("broker.journal.damaged-*"))
        assert len(kept) == 1 and kept[0].stat().st_size == size, "the file as it was is kept beside the new one"
