"""The supervisor's decisions without a cluster, the clock passed in: a replacement is due restart_backoff_s after the
failure was seen (doubling with each restart of the name), max_restarts bounds it, and its state belongs to one
launch (another launch's supervision.json is not read; ``down`` moves it into history/<launch id>/). Planned exits
(a requeue, a task scaled away, a deployment being taken down) are never replaced, and a requeued task held for
Slurm's requeue delay is made eligible at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from prorl_cli.slurm import launcher, options, squeue, supervisor
from prorl_cli.slurm.deploy import ArrayRole
from prorl_cli.slurm.record import (
    HISTORY_NAME,
    LAUNCH_NAME,
    LaunchRecord,
    Member,
    archive_launch,
    new_launch_id,
)
from prorl_cli.slurm.squeue import EndedTask, SlurmTask
from prorl_cli.slurm.supervisor import (
    SUPERVISION_NAME,
    NameState,
    SeenFailure,
    Supervision,
    decide,
    ended_unseen,
    supervise_once,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_first_replacement_waits_restart_backoff_s_from_when_the_failure_was_seen() -> None:
    fresh = NameState()
    # Seen now for the first time: due a whole backoff later, not at once (no earlier restart to count from).
    assert decide(fresh, "10_0", now=1000.0, max_restarts=3, restart_backoff_s=30.0).action == "wait"
    assert decide(fresh, "10_0", now=1000.0, max_restarts=3, restart_backoff_s=30.0).due_at == 1030.0
    seen = NameState(failure=SeenFailure("10_0", "FAILED", seen_at=1000.0))
    assert decide(seen, "10_0", now=1029.9, max_restarts=3, restart_backoff_s=30.0).action == "wait"
    assert decide(seen, "10_0", now=1030.0, max_restarts=3, restart_backoff_s=30.0).action == "replace"
    # No backoff: replaced at the pass that sees it.
    assert decide(fresh, "10_0", now=1000.0, max_restarts=3, restart_backoff_s=0.0).action == "replace"


def test_the_wait_doubles_with_each_restart_of_the_name_and_counts_from_the_new_failure() -> None:
    dues = [decide(NameState(restarts=n, failure=SeenFailure("11_0", "FAILED", 5000.0)), "11_0", now=5000.0,
                   max_restarts=3, restart_backoff_s=30.0).due_at for n in range(3)]
    assert dues == [5030.0, 5060.0, 5120.0]
    # A failure seen of the name's earlier task does not start the clock for its current one.
    stale = NameState(restarts=1, failure=SeenFailure("10_0", "FAILED", seen_at=0.0))
    assert decide(stale, "11_0", now=7000.0, max_restarts=3, restart_backoff_s=30.0).due_at == 7060.0


def test_a_spent_budget_gives_up_once_per_task() -> None:
    spent = NameState(restarts=2)
    assert decide(spent, "12_0", now=0.0, max_restarts=2, restart_backoff_s=30.0).action == "give_up"
    spent.gave_up = {"job_id": "12_0", "ended": "FAILED", "log_tail": ""}
    assert decide(spent, "12_0", now=0.0, max_restarts=2, restart_backoff_s=30.0).action == "done"
    assert decide(NameState(), "12_0", now=0.0, max_restarts=0, restart_backoff_s=30.0).action == "give_up"


def test_supervision_state_of_another_launch_is_not_read(tmp_path: Path) -> None:
    old = Supervision({"node-0": NameState(restarts=2, history=[{"job_id": "1_0", "ended": "FAILED"}] * 2)}, "L1")
    old.save(tmp_path)
    assert Supervision.load(tmp_path, "L1").names["node-0"].restarts == 2
    fresh = Supervision.load(tmp_path, "L2")
    assert fresh.names == {} and fresh.launch_id == "L2"
    # A file written before launches had ids (with its old keys) is read by a record without one.
    (tmp_path / SUPERVISION_NAME).write_text(json.dumps(
        {"names": {"node-1": {"restarts": 1, "last_restart_at": 5.0, "history": [], "gave_up": None}}}))
    assert Supervision.load(tmp_path, "").names["node-1"].restarts == 1
    assert Supervision.load(tmp_path, "L2").names == {}


def test_archive_moves_a_launch_state_into_history_under_its_launch_id(tmp_path: Path) -> None:
    LaunchRecord(deployment="x", deploy_file="d.yaml", home=str(tmp_path), created_at=0.0, launch_id="L1").save(tmp_path)
    Supervision({"node-0": NameState(restarts=1)}, "L1").save(tmp_path)
    dest = archive_launch(tmp_path)
    assert dest == tmp_path / HISTORY_NAME / "L1"
    assert sorted(p.name for p in dest.iterdir()) == sorted([LAUNCH_NAME, SUPERVISION_NAME])
    assert not (tmp_path / LAUNCH_NAME).exists() and not (tmp_path / SUPERVISION_NAME).exists()
    assert archive_launch(tmp_path) is None, "nothing left to move"
    # State from before launch ids is moved too, under a name of its own.
    (tmp_path / SUPERVISION_NAME).write_text(json.dumps({"names": {}}))
    unnamed = archive_launch(tmp_path)
    assert unnamed is not None and unnamed.name.startswith("unnamed-") and not (tmp_path / SUPERVISION_NAME).exists()


def test_new_launch_ids_differ() -> None:
    assert new_launch_id(0.0) != new_launch_id(0.0)
    assert new_launch_id(0.0).startswith("19700101T000000Z-")


def test_the_example_deploy_file_states_the_default_backoff_and_budget() -> None:
    data = yaml.safe_load((EXAMPLES / "deploy.yaml").read_text())
    for role in ("nodes", "inference"):
        assert data[role]["restart_backoff_s"] == ArrayRole.restart_backoff_s
        assert data[role]["max_restarts"] == ArrayRole.max_restarts


class FakeSlurm:
    """squeue rows the test sets, and sbatch handing out the next array job id."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.states: dict[str, str] = {}
        self.reasons: dict[str, str] = {}
        self.next_job = 20
        self.submitted: list[str] = []
        self.released: list[str] = []
        monkeypatch.setattr(squeue, "query", self.query)
        monkeypatch.setattr(squeue, "release_requeued", self.release)
        monkeypatch.setattr(squeue, "ended", lambda t: EndedTask(t.job_id, t.state, "NonZeroExitCode", "137:0"))
        monkeypatch.setattr(options, "submit_role", self.submit)

    def query(self, job_ids: list[str], all_states: bool = False) -> list[SlurmTask]:
        return [SlurmTask(j, self.states[j], self.reasons.get(j, "None"), "", "0:01", "", "prorl-x-nodes")
                for j in job_ids if j in self.states]

    def release(self, ref: str) -> bool:
        self.released.append(ref)
        self.states[ref], self.reasons[ref] = "RUNNING", "None"
        return True

    def submit(self, cfg: object, role: str, indices: list[int]) -> list[Member]:
        job = f"{self.next_job}_{indices[0]}"
        self.next_job += 1
        self.states[job] = "RUNNING"
        self.submitted.append(job)
        return [Member(role, indices[0], job)]


def _launched(tmp_path: Path, launch_id: str, max_restarts: int = 2) -> Path:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"deployment": "x", "home": str(tmp_path),
                                      "nodes": {"count": 1, "max_restarts": max_restarts, "restart_backoff_s": 30.0}}))
    deployment_dir = tmp_path / "x"
    LaunchRecord(deployment="x", deploy_file=str(deploy), home=str(tmp_path), created_at=0.0, launch_id=launch_id,
                 members=[Member("broker", 0, "9"), Member("nodes", 0, "10_0")]).save(deployment_dir)
    return deployment_dir


def _node0(deployment_dir: Path) -> str:
    record = LaunchRecord.load(deployment_dir)
    assert record is not None
    return record.of("nodes")[0].job_id


def test_a_pass_replaces_only_once_the_backoff_from_the_failure_has_passed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = FakeSlurm(monkeypatch)
    deployment_dir = _launched(tmp_path, "L1")
    slurm.states["10_0"] = "RUNNING"
    assert supervise_once(deployment_dir, now=900.0).replaced == []
    slurm.states["10_0"] = "FAILED"
    first = supervise_once(deployment_dir, now=1000.0)
    assert first.replaced == [] and first.next_due_at == 1030.0, "seen now: due restart_backoff_s later"
    assert supervise_once(deployment_dir, now=1029.0).replaced == []
    assert supervise_once(deployment_dir, now=1030.0).replaced == ["node-0"]
    assert _node0(deployment_dir) == "20_0"
    # The replacement fails too: the second wait is doubled, from when that failure was seen.
    slurm.states["20_0"] = "FAILED"
    assert supervise_once(deployment_dir, now=2000.0).next_due_at == 2060.0
    del slurm.states["20_0"]  # aged out of squeue (MinJobAge) while waiting: still replaced when due
    assert supervise_once(deployment_dir, now=2059.0).replaced == []
    assert supervise_once(deployment_dir, now=2060.0).replaced == ["node-0"]
    sup = Supervision.load(deployment_dir, "L1").names["node-0"]
    assert sup.restarts == 2 and [h["job_id"] for h in sup.history] == ["10_0", "20_0"] and sup.failure is None
    # Budget spent: given up on, never submitted again.
    slurm.states["21_0"] = "FAILED"
    supervise_once(deployment_dir, now=9000.0)
    assert Supervision.load(deployment_dir, "L1").names["node-0"].gave_up is not None
    assert slurm.submitted == ["20_0", "21_0"]


def test_a_new_launch_counts_its_restarts_from_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = FakeSlurm(monkeypatch)
    deployment_dir = _launched(tmp_path, "L2", max_restarts=1)
    # What an earlier launch of the same name left, had nothing moved it away: its budget was spent.
    Supervision({"node-0": NameState(restarts=1, gave_up={"job_id": "3_0", "ended": "FAILED", "log_tail": ""})},
                "L1").save(deployment_dir)
    slurm.states["10_0"] = "FAILED"
    supervise_once(deployment_dir, now=1000.0)
    assert supervise_once(deployment_dir, now=1030.0).replaced == ["node-0"], "restart 1 of 1, not given up"
    saved = json.loads((deployment_dir / SUPERVISION_NAME).read_text())
    assert saved["launch_id"] == "L2" and saved["names"]["node-0"]["restarts"] == 1


def test_planned_exits_are_not_failures_and_a_requeued_task_is_released_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = FakeSlurm(monkeypatch)
    deployment_dir = _launched(tmp_path, "L3")
    # A drain on SIGUSR2 requeued node-0: Slurm holds it for its requeue delay; the supervisor releases it.
    slurm.states["10_0"], slurm.reasons["10_0"] = "PENDING", "BeginTime"
    passed = supervise_once(deployment_dir, now=1000.0)
    assert passed.released == ["node-0"] and passed.replaced == [] and slurm.released == ["10_0"]
    # Waiting for resources is not a requeue delay: nothing to release.
    slurm.states["10_0"], slurm.reasons["10_0"] = "PENDING", "Resources"
    assert supervise_once(deployment_dir, now=1001.0).released == []
    # A drain that exited, and a scancel: asked to end.
    for state in ("COMPLETED", "CANCELLED"):
        slurm.states["10_0"] = state
        assert supervise_once(deployment_dir, now=1100.0).replaced == []
    assert not (deployment_dir / SUPERVISION_NAME).exists(), "nothing was counted"
    # `prorl scale` moved node-0 to retired before it signalled it: however it ends, it is not replaced.
    record = LaunchRecord.load(deployment_dir)
    assert record is not None
    record.retired, record.members = record.of("nodes"), record.of("broker")
    record.save(deployment_dir)
    slurm.states["10_0"] = "FAILED"
    assert supervise_once(deployment_dir, now=1200.0).replaced == []
    assert supervise_once(deployment_dir, now=9999.0).replaced == [] and slurm.submitted == []


def test_a_deployment_being_taken_down_is_not_supervised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = FakeSlurm(monkeypatch)
    deployment_dir = _launched(tmp_path, "L4")
    record = LaunchRecord.load(deployment_dir)
    assert record is not None
    launcher.mark_stopping(deployment_dir, record)  # what `prorl down` does first
    slurm.states["10_0"] = "FAILED"  # a node that failed on its way out
    for now in (1000.0, 1030.0, 5000.0):
        passed = supervise_once(deployment_dir, now=now)
        assert passed.stopping and passed.replaced == [] and passed.next_due_at is None
    assert slurm.submitted == [] and not (deployment_dir / SUPERVISION_NAME).exists()


@pytest.mark.parametrize("state", ["SIGNALING", "STAGE_OUT", "STOPPED", "REQUEUE_HOLD", "SPECIAL_EXIT",
                                   "RESV_DEL_HOLD", "REQUEUE_FED", "SUSPENDED", "A_STATE_SLURM_ADDS_LATER"])
def test_a_task_showing_a_state_flag_is_still_there_and_not_replaced(
        state: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # squeue prints a flag in place of the base state while it is set: SIGNALING while the time-limit warning
    # reaches a running node. Only a final state means the task is gone.
    slurm = FakeSlurm(monkeypatch)
    deployment_dir = _launched(tmp_path, "L5")
    slurm.states["10_0"] = state
    assert [t.job_id for t in squeue.active(["10_0"])] == ["10_0"]
    for now in (1000.0, 1100.0, 9999.0):
        assert supervise_once(deployment_dir, now=now).replaced == []
    assert slurm.submitted == []


@pytest.mark.parametrize("state", sorted(squeue.ENDED_STATES))
def test_a_task_in_a_final_state_is_gone(state: str) -> None:
    assert not SlurmTask("10_0", state, "None", "", "0:01", "", "prorl-x-nodes").active


def test_a_running_task_being_signalled_holds_its_allocation() -> None:
    assert {"SIGNALING", "STAGE_OUT", "STOPPED"} <= squeue.RUNNING_STATES
    assert not squeue.RUNNING_STATES & squeue.ENDED_STATES


# Log texts as a task's Slurm log holds them (submitit's start line, slurmstepd's cancel lines, the batch script's
# report of a killed srun), each the end of a log that earlier runs of the task (requeues) appended to.
_STARTED = "submitit INFO (2026-12-05 21:10:16,311) - Starting with JobEnvironment(job_id=279_1, hostname=vm)\n"
_ROLE = "2026-12-05 21:10:16,604 node[25277] INFO prorl_cli.slurm.roles: node of deployment 'x': job 279_1\n"
_SCANCEL = ("slurmstepd-n2: error: *** STEP 282.0 ON n2 CANCELLED AT 2026-12-05T21:10:41 ***\n"
            "slurmstepd-n2: error: *** JOB 282 ON n2 CANCELLED AT 2026-12-05T21:10:41 ***\n")
_REQUEUED = "slurmstepd-n1: error: *** JOB 281 ON n1 CANCELLED AT 2026-12-05T21:11:41 DUE TO JOB REQUEUE ***\n"
_TIME_LIMIT = "slurmstepd-n1: error: *** JOB 281 ON n1 CANCELLED AT 2026-12-05T21:41:41 DUE TO TIME LIMIT ***\n"
_CLEAN = "submitit INFO (2026-12-05 21:10:41,720) - Exiting after successful completion\n"
_KILLED = ("/var/spool/slurm/d-n3/job00280/slurm_script: line 21: 25183 Killed  srun --unbuffered python -u -m "
           "submitit.core._submit /x\nslurmstepd-n3: error: *** STEP 280.0 ON n3 CANCELLED AT 2026-12-05T21:10:51 ***\n")


@pytest.mark.parametrize(("log_text", "asked"), [
    (_STARTED + _ROLE + _SCANCEL + _CLEAN, True),  # scancel by hand: the role drained and returned
    (_STARTED + _ROLE + _SCANCEL, True),
    (_STARTED + _ROLE + _CLEAN, True),  # the role returned on its own
    (_STARTED + _ROLE + _REQUEUED, True),  # requeued, then cancelled while it waited (no new start)
    ("", True),  # never started
    (_STARTED + _ROLE + _KILLED, False),  # killed: only the step's cancel line, as the job ended
    (_STARTED + _ROLE + _TIME_LIMIT, False),
    (_STARTED + _ROLE + _SCANCEL + _CLEAN + _STARTED + _ROLE, False),  # requeued and died: the cancel was earlier
    (_STARTED + _ROLE + _REQUEUED + _STARTED + _ROLE + _KILLED, False),
    ("bash: line 3: module: command not found\n", False),  # its setup line failed before submitit started
])
def test_a_task_that_left_squeue_unseen_is_judged_by_its_log_since_its_last_start(log_text: str, asked: bool) -> None:
    verdict = ended_unseen(log_text)
    assert (verdict is None) == asked, verdict
    if "TIME LIMIT" in log_text:
        assert verdict is not None and "TIME LIMIT" in verdict


def _write_log(deployment_dir: Path, role: str, job_id: str, text: str) -> None:
    folder = deployment_dir / "slurm" / role / job_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{job_id}_0_log.out").write_text(text)


def test_a_task_that_failed_while_no_supervisor_watched_is_replaced_and_one_cancelled_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = FakeSlurm(monkeypatch)
    deployment_dir = _launched(tmp_path, "L5")
    # node-0 was killed while the broker (and its supervisor) was away for longer than MinJobAge: squeue has
    # forgotten it, its log has no scancel and no clean exit.
    _write_log(deployment_dir, "nodes", "10_0", _STARTED + _ROLE + _KILLED)
    first = supervise_once(deployment_dir, now=1000.0)
    assert first.replaced == [] and first.next_due_at == 1030.0, "seen now: replaced restart_backoff_s later"
    failure = Supervision.load(deployment_dir, "L5").names["node-0"].failure
    assert failure is not None and "left squeue before it was seen ended" in failure.ended
    assert supervise_once(deployment_dir, now=1030.0).replaced == ["node-0"] and _node0(deployment_dir) == "20_0"
    # Its replacement is cancelled by hand and ages out unseen too: asked to end, left alone, its log read once.
    _write_log(deployment_dir, "nodes", "20_0", _STARTED + _ROLE + _SCANCEL + _CLEAN)
    del slurm.states["20_0"]
    reads: list[str] = []
    real_read = supervisor.log_end
    monkeypatch.setattr(supervisor, "log_end", lambda cfg, m: reads.append(m.job_id) or real_read(cfg, m))
    for now in (2000.0, 2005.0, 9000.0):
        assert supervise_once(deployment_dir, now=now).replaced == [] and slurm.submitted == ["20_0"]
    state = Supervision.load(deployment_dir, "L5").names["node-0"]
    assert state.left_alone == "20_0" and state.restarts == 1 and state.failure is None
    assert len(reads) == 1


def test_the_broker_job_is_looked_after_by_its_peers_not_by_its_own_supervisor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = FakeSlurm(monkeypatch)
    deployment_dir = _launched(tmp_path, "L6")
    slurm.states.update({"9": "FAILED", "10_0": "RUNNING"})
    # The broker job's supervisor (the default roles) never replaces its own job; it died with it anyway.
    assert supervise_once(deployment_dir, now=1000.0).replaced == []
    # Its peers do: restart_backoff_s (the broker's: 10 s by default) after they saw it ended.
    first = supervise_once(deployment_dir, now=1000.0, roles=supervisor.BROKER_ROLES)
    assert first.replaced == [] and first.next_due_at == 1010.0
    assert supervise_once(deployment_dir, now=1010.0, roles=supervisor.BROKER_ROLES).replaced == ["broker"]
    record = LaunchRecord.load(deployment_dir)
    assert record is not None
    assert record.of("broker")[0].job_id == "20_0" and [m.job_id for m in record.retired] == ["9"]
    assert record.of("nodes")[0].job_id == "10_0", "the nodes were not touched"
    # A broker cancelled by hand (or by `down`) was asked to end: left alone.
    slurm.states["20_0"] = "CANCELLED"
    for now in (2000.0, 9000.0):
        assert supervise_once(deployment_dir, now=now, roles=supervisor.BROKER_ROLES).replaced == []
    assert slurm.submitted == ["20_0"]


def test_each_peer_looks_at_the_broker_job_in_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deployment_dir = _launched(tmp_path, "L7")
    passes: list[tuple[str, ...]] = []
    monkeypatch.setattr(supervisor, "supervise_once", lambda d, roles, from_this_job: passes.append(roles))
    clock = [100.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: clock[0])
    watch = supervisor.BrokerWatch(deployment_dir)
    watch()
    assert passes == [], "not at once: the broker is starting too"
    # One node: at most every 2 * BROKER_LOOK_S * 1.5 s; a thousand peers between them keep Slurm's load the same.
    clock[0] += 2 * supervisor.BROKER_LOOK_S * 1.5
    watch()
    assert passes == [supervisor.BROKER_ROLES]
    watch()
    assert len(passes) == 1, "not again before its next turn"
    (deployment_dir / LAUNCH_NAME).unlink()  # plain sbatch scripts: no launch record, no broker to replace
    clock[0] += 1000.0
    watch()
    assert len(passes) == 1
