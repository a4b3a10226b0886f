"""The broker's job table as plain objects: state machine, placement, claims, retention, forget."""

from __future__ import annotations

from typing import Any

from prorl_cli import protocol as P
from prorl_cli.broker.jobs import JobTable
from prorl_cli.broker.journal import Journal
from prorl_cli.broker.state import Job, Node
from prorl_cli.protocol import JobSpec, JobState
from prorl_cli.protocol.headers import JobEnd, StageUpdate


class Recorder:
    """Collects what the table tells its owner (journal records, ends, detaches)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.ended: list[str] = []
        self.detached: list[str] = []

    def table(self, **kwargs: Any) -> JobTable:
        return JobTable(record=self.records.append, on_end=lambda j: self.ended.append(j.job_id),
                        on_detach=self.detached.append, **kwargs)


def _node(table: JobTable, node_id: str = "n1", credit: int = 4, tasks: tuple[str, ...] = ("t",)) -> Node:
    node = Node(node_id=node_id, identity=node_id.encode(), host="h", pid=1, credit=credit, tasks=set(tasks))
    table.nodes[node_id] = node
    return node


def _add(table: JobTable, job_id: str, task: str = "t", instance: bytes = b"\x80", **spec: Any) -> Job:
    return table.add(JobSpec(job_id=job_id, task=task, **spec), instance)


def _result(job_id: str, state: str = "done", size: int = 0) -> bytes:
    return P.pack_obj(P.JobResult(job_id=job_id, task="t", state=state, output="x" * size).to_wire())


def test_placed_job_is_assigned_until_its_first_stage() -> None:
    rec = Recorder()
    table = rec.table()
    node = _node(table)
    job = _add(table, "a")
    assert job.state == JobState.QUEUED
    placed = table.place()
    assert [(n.node_id, j.job_id) for n, j in placed] == [("n1", "a")]
    assert job.state == JobState.ASSIGNED and job.node_id == "n1" and "a" in node.inflight
    assert {"t": "placed", "job_id": "a", "attempt": 1, "node_id": "n1"} in rec.records
    table.stage(node, [StageUpdate("a", 1, "run")])
    assert job.state == JobState.RUN
    assert table.counts()["run"] == 1


def test_cancel_reaches_the_node_of_an_assigned_job() -> None:
    rec = Recorder()
    table = rec.table()
    _node(table)
    _add(table, "placed")
    table.place()
    _add(table, "queued")  # not placed: no place() since
    out = table.cancel(["placed", "ghost"])
    assert out.by_node == {"n1": ["placed"]}
    assert out.states == {"placed": "cancelled"} and out.unknown == ["ghost"]
    assert table.jobs["placed"].state == JobState.CANCELLED and rec.ended == ["placed"]
    # The queued one is removed from the queue, nothing to tell a node.
    out = table.cancel(["queued"])
    assert out.by_node == {} and out.states == {"queued": "cancelled"} and len(table.queue) == 0


def test_results_and_stages_only_from_the_node_the_job_is_on() -> None:
    table = Recorder().table()
    n1, n2 = _node(table, "n1", credit=1), _node(table, "n2", credit=1)
    _add(table, "a")
    _add(table, "b")
    table.place()
    owner = table.jobs["a"].node_id
    other = n2 if owner == "n1" else n1
    _add(table, "queued")
    # Another node's result for "a", and anyone's for a queued job it was never given, are ignored.
    assert table.done(other, [JobEnd("a", 1, "done")], [_result("a")]) == []
    assert table.done(other, [JobEnd("queued", 1, "done")], [_result("queued")]) == []
    table.stage(other, [StageUpdate("a", 1, "eval")])
    assert table.jobs["a"].state == JobState.ASSIGNED and table.jobs["queued"].state == JobState.QUEUED
    # A claim for a never-placed queued job is refused.
    assert table.claim(other, [StageUpdate("queued", 1, "run")]) == ["queued"]
    assert table.jobs["queued"].node_id is None
    # The owner's result counts, once.
    owner_node = table.nodes[owner or ""]
    assert [j.job_id for j in table.done(owner_node, [JobEnd("a", 1, "done")], [_result("a")])] == ["a"]
    assert table.done(owner_node, [JobEnd("a", 1, "failed")], [_result("a", "failed")]) == []
    assert table.jobs["a"].state == JobState.DONE


def test_a_node_gets_its_slot_back_for_a_cancelled_job_already_dropped_by_retention() -> None:
    """Found by the 10-minute load run: 820 of 16,384 slots leaked. The client cancels a running job, results
    of others push it out of retention before its node's ``cancelled`` report arrives; the report must still
    free the node's slot."""
    table = Recorder().table(retention_count=1)
    node = _node(table, credit=2)
    _add(table, "cancelled")
    _add(table, "other")
    table.place()
    assert node.inflight == {"cancelled", "other"}
    assert table.cancel(["cancelled"]).by_node == {"n1": ["cancelled"]}
    table.done(node, [JobEnd("other", 1, "done")], [_result("other")])
    assert "cancelled" not in table.jobs  # dropped by retention (count 1)
    table.done(node, [JobEnd("cancelled", 1, "cancelled")], [_result("cancelled", "cancelled")])
    assert node.inflight == set() and node.free == 2


def test_a_compaction_snapshot_lets_go_of_results_dropped_while_it_is_written() -> None:
    """The snapshot names finished jobs and reads their results when written: one dropped by retention
    meanwhile is neither held (memory) nor written (a later snapshot would not have it either)."""
    table = Recorder().table(retention_count=2)
    node = _node(table, credit=4)
    for job_id in ("a", "b", "c", "d"):
        _add(table, job_id)
    table.place()
    for job_id in ("a", "b"):
        table.done(node, [JobEnd(job_id, 1, "done")], [_result(job_id)])
    snapshot = table.journal_snapshot()  # taken on the loop; a thread writes it
    table.done(node, [JobEnd("c", 1, "done")], [_result("c")])  # drops "a"
    records = list(snapshot)
    ends = [r["job_id"] for r in records if r["t"] == "end"]
    assert ends == ["b"]  # "a" was dropped meanwhile; "c" finished after the snapshot (the journal's tail has it)
    assert [r["spec"]["job_id"] for r in records if r["t"] == "job"] == ["b", "c", "d"]


def test_node_lost_requeues_and_only_that_node_may_claim_the_old_attempt() -> None:
    rec = Recorder()
    table = rec.table()
    n1 = _node(table, "n1", credit=1)
    _add(table, "a")
    table.place()
    table.node_lost(n1, "silent")
    job = table.jobs["a"]
    assert job.state == JobState.QUEUED and job.spec.attempt == 2 and job.node_id is None
    assert rec.detached == ["a"] and not n1.alive
    n2 = _node(table, "n2", credit=1)
    # Another node cannot claim it; n1, back with the attempt it ran, can.
    assert table.claim(n2, [StageUpdate("a", 1, "run")]) == ["a"]
    n1b = _node(table, "n1", credit=1)
    assert table.claim(n1b, [StageUpdate("a", 2, "run")]) == ["a"]
    assert table.claim(n1b, [StageUpdate("a", 1, "run")]) == []
    assert job.node_id == "n1" and job.spec.attempt == 1 and job.state == JobState.RUN and len(table.queue) == 0


def test_lost_too_often_fails_with_node_error() -> None:
    table = Recorder().table()
    _add(table, "a", max_attempts=1)
    n1 = _node(table)
    table.place()
    table.node_lost(n1, "silent")
    result = P.JobResult.from_wire(P.unpack_obj(table.jobs["a"].result or b""))
    assert result.state == "failed" and result.critical_error == "node"


def test_a_job_a_leaving_node_never_started_spends_no_attempt() -> None:
    """scancel of a node array: each node leaves (planned) a few ms apart, and a job placed on one that is itself
    leaving moves on without running. That costs no attempt; a job that started there does spend one."""
    table = Recorder().table()
    started, unstarted = _add(table, "started", max_attempts=1), _add(table, "unstarted", max_attempts=1)
    n1 = _node(table, "n1", credit=2)
    table.place()
    table.stage(n1, [StageUpdate("started", 1, "run")])
    table.node_lost(n1, "left", planned=True)
    assert started.state == JobState.FAILED, "it ran there: its one attempt is spent"
    for i in range(3):  # placed on node after node, each leaving before it starts the job
        node = _node(table, f"m{i}", credit=1)
        table.place()
        assert unstarted.node_id == f"m{i}" and unstarted.state == JobState.ASSIGNED
        table.node_lost(node, "left", planned=True)
        assert unstarted.state == JobState.QUEUED and unstarted.spec.attempt == 1
    lost = _node(table, "crashed", credit=1)
    table.place()
    table.node_lost(lost, "silent")  # a loss it was not told of: the attempt counts, as a crash's would
    assert unstarted.state == JobState.FAILED


def test_broker_results_echo_group_and_meta() -> None:
    table = Recorder().table()
    _add(table, "a", group_id="g7", meta={"prompt": 3, "split": "train"})
    table.cancel(["a"])
    result = P.JobResult.from_wire(P.unpack_obj(table.jobs["a"].result or b""))
    assert result.group_id == "g7" and result.meta == {"prompt": 3, "split": "train"}


def test_retention_is_bounded_by_bytes_and_count() -> None:
    table = Recorder().table(retention_count=1000, retention_bytes=100_000)
    node = _node(table, credit=100)
    for i in range(20):
        _add(table, f"j{i}")
    table.place()
    for i in range(20):
        table.done(node, [JobEnd(f"j{i}", 1, "done")], [_result(f"j{i}", size=20_000)])
    assert table.retained_bytes <= 100_000
    assert 3 <= table.retained_count <= 5
    assert "j19" in table.jobs and "j0" not in table.jobs  # the oldest went first
    small = Recorder().table(retention_count=3)
    node = _node(small, credit=10)
    for i in range(5):
        _add(small, f"k{i}")
    small.place()
    for i in range(5):
        small.done(node, [JobEnd(f"k{i}", 1, "done")], [_result(f"k{i}")])
    assert small.retained_count == 3 and sorted(small.jobs) == ["k2", "k3", "k4"]


def test_forget_drops_finished_keeps_running() -> None:
    table = Recorder().table()
    node = _node(table, credit=2)
    _add(table, "done")
    _add(table, "running")
    table.place()
    table.done(node, [JobEnd("done", 1, "done")], [_result("done", size=1000)])
    before = table.retained_bytes
    out = table.forget(["done", "running", "ghost"])
    assert (out.forgotten, out.running, out.unknown) == (["done"], ["running"], ["ghost"])
    assert "done" not in table.jobs and "running" in table.jobs
    assert table.retained_bytes == before - len(_result("done", size=1000)) and table.retained_count == 0


def test_cancelling_20k_queued_jobs_newest_first() -> None:
    table = Recorder().table(retention_count=100_000)
    for i in range(20_000):
        _add(table, f"q{i}", task="a" if i % 2 else "b")
    ids = [f"q{i}" for i in reversed(range(20_000))]
    for start in range(0, len(ids), 1000):
        out = table.cancel(ids[start:start + 1000])
        assert set(out.states.values()) == {"cancelled"} and out.by_node == {}
    assert len(table.queue) == 0
    assert table.counts()["cancelled"] == 20_000
    node = _node(table, tasks=("a", "b"))
    assert table.place() == [] and not node.inflight


def test_replay_waits_only_for_placed_jobs(tmp_path) -> None:
    journal = Journal(tmp_path / "broker.journal")
    first = JobTable(record=journal.append)
    n1 = _node(first, "n1", credit=1)
    _add(first, "placed")
    first.place()
    _add(first, "never-placed")
    journal.flush()
    jobs = journal.replay()
    assert jobs["placed"].claim_node == "n1" and jobs["never-placed"].claim_node is None

    table = JobTable()
    assert table.load_replayed(jobs.values(), claim_window_s=60.0, now=0.0) == 1
    other = _node(table, "n2", credit=4)
    # The never-placed job goes at once to a node that registered; the placed one waits for n1.
    assert [j.job_id for _, j in table.place(now=1.0)] == ["never-placed"]
    assert table.claim(other, [StageUpdate("placed", 1, "run")]) == ["placed"]
    back = _node(table, "n1", credit=1)
    assert table.claim(back, [StageUpdate("placed", 1, "run")]) == []
    assert table.jobs["placed"].node_id == "n1" and table.jobs["placed"].state == JobState.RUN
    del n1

    # Unclaimed: queued once the window is over.
    late = JobTable()
    late.load_replayed(Journal(tmp_path / "broker.journal").replay().values(), claim_window_s=60.0, now=0.0)
    _node(late, "n2", credit=4)
    assert sorted(j.job_id for _, j in late.place(now=1.0)) == ["never-placed"]
    [(_, released)] = late.place(now=61.0)
    # It may have run on n1 before the broker went: it runs again as a new attempt.
    assert released.job_id == "placed" and released.spec.attempt == 2


def test_an_unclaimed_replayed_job_on_its_last_attempt_fails_naming_why(tmp_path) -> None:
    journal = Journal(tmp_path / "broker.journal")
    first = JobTable(record=journal.append)
    _node(first, "n1", credit=1)
    _add(first, "last", max_attempts=1)
    first.place()
    journal.flush()
    table = JobTable()
    table.load_replayed(journal.replay().values(), claim_window_s=60.0, now=0.0)
    _node(table, "n2", credit=4)
    assert table.place(now=61.0) == []
    job = table.jobs["last"]
    assert job.state == JobState.FAILED
    error = P.unpack_obj(job.result)["error"]
    assert error["type"] == "NodeLost" and "did not claim" in error["message"] and "attempt 1 of 1" in error["message"]


def test_dead_nodes_are_pruned() -> None:
    table = Recorder().table()
    for i in range(10):
        table.node_lost(_node(table, f"n{i}"), "gone", now=float(i))
    _node(table, "alive")
    assert sorted(table.prune_dead_nodes(keep=3)) == [f"n{i}" for i in range(7)]
    assert sorted(table.nodes) == ["alive", "n7", "n8", "n9"]


def test_a_compacted_journal_replays_like_the_full_one(tmp_path) -> None:
    """Placed, re-queued after a node loss, finished and never-placed jobs survive compaction unchanged."""
    journal = Journal(tmp_path / "broker.journal")
    table = JobTable(record=journal.append)
    n1 = _node(table, "n1", credit=2)
    for j in ("lost", "placed"):
        _add(table, j)
    table.place()
    table.node_lost(n1, "silent")  # both re-queued at attempt 2, claimable by n1 at attempt 1
    n2 = _node(table, "n2", credit=1)
    placed_now = table.place()[0][1].job_id
    _add(table, "never")
    _add(table, "done")
    table.cancel(["done"])
    journal.flush()
    full = journal.replay()

    journal.rewrite(table.journal_snapshot())
    compacted = journal.replay()
    key = {j: (x.spec.attempt, x.claim_node, x.state, x.result) for j, x in full.items()}
    assert key == {j: (x.spec.attempt, x.claim_node, x.state, x.result) for j, x in compacted.items()}
    assert full[placed_now].claim_node == "n2" and full["never"].claim_node is None
    del n2


def test_a_running_jobs_cancel_waits_for_its_nodes_partial_result_then_keeps_it_cancelled() -> None:
    rec = Recorder()
    released: list[str] = []
    table = rec.table(on_release=lambda j: released.append(j.job_id), partial_grace_s=60.0)
    node = _node(table)
    job = _add(table, "a")
    table.place()
    table.stage(node, [StageUpdate("a", 1, "run")])
    out = table.cancel(["a"])
    assert out.states == {"a": "cancelled"} and out.by_node == {"n1": ["a"]}
    assert job.state is JobState.CANCELLED and job.partial_until is not None and released == []
    # The node's result (it may say "done": the job ended as the cancel crossed it) replaces the broker's.
    table.done(node, [JobEnd("a", 1, "done")], [_result("a", "done", size=3)])
    kept = P.unpack_obj(job.result)
    assert kept["state"] == "cancelled" and kept["output"] == "xxx", kept
    assert released == ["a"] and job.partial_until is None and "a" not in node.inflight
    assert rec.records[-1]["t"] == "end" and rec.records[-1]["result"] == job.result  # a replay sees the same


def test_a_cancelled_jobs_result_goes_out_without_its_node_once_the_grace_is_over() -> None:
    rec = Recorder()
    released: list[str] = []
    table = rec.table(on_release=lambda j: released.append(j.job_id), partial_grace_s=2.0)
    node = _node(table)
    job = _add(table, "a")
    table.place()
    table.cancel(["a"])
    assert job.partial_until is not None
    table.expire_partials(job.partial_until - 1.0)
    assert released == []
    table.expire_partials(job.partial_until)
    assert released == ["a"] and P.unpack_obj(job.result)["output"] is None
    # A late report from its node changes nothing now.
    table.done(node, [JobEnd("a", 1, "cancelled")], [_result("a", "cancelled", size=3)])
    assert released == ["a"] and P.unpack_obj(job.result)["output"] is None and "a" not in node.inflight
