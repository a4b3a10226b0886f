"""The node's stage slots and per-job deadline, on a real Pipeline in one event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prorl_cli.config import ProrlConfig
from prorl_cli.node.handler import Services
from prorl_cli.node.pipeline import Pipeline
from prorl_cli.node.registry import HandlerRegistry
from prorl_cli.protocol import JobResult, JobSpec
from prorl_cli.testing.handlers.testing import ScriptedTestHandler


def _pipeline(tmp_path: Path, done: list[JobResult], n_run: int = 32) -> Pipeline:
    registry = HandlerRegistry()
    registry.add(ScriptedTestHandler, "prorl_cli/testing/handlers/testing.py")
    config = ProrlConfig()
    config.node.n_run = n_run
    return Pipeline(config, registry, Services(), "n1", tmp_path, on_stage=lambda spec, stage: None, on_done=done.append)


def test_a_full_stage_queues_in_order_and_a_cancelled_waiter_gives_up_its_place(tmp_path: Path) -> None:
    done: list[JobResult] = []

    async def main() -> None:
        pipeline = _pipeline(tmp_path, done, n_run=1)
        inst = {"sleep_s": {"run": 0.05}}
        for i in range(4):
            assert pipeline.start(JobSpec(job_id=f"j{i}", task="test"), inst)
        await asyncio.sleep(0.01)  # j0 holds the one RUN slot; j1..j3 wait for it
        run = pipeline.pools["run"]
        assert (run.active, run.queued) == (1, 3)
        assert pipeline.cancel("j2")
        while len(done) < 4:
            await asyncio.sleep(0.01)
        assert (run.active, run.queued) == (0, 0)

    asyncio.run(main())
    assert [(r.job_id, r.state) for r in done] == [
        ("j2", "cancelled"), ("j0", "done"), ("j1", "done"), ("j3", "done")
    ]


def test_a_waiter_cancelled_as_the_slot_is_handed_on_past_it_ends_cancelled(tmp_path: Path) -> None:
    """j0 (holding the slot) and j1 (waiting) cancelled at once: j0 leaves first and hands the slot past j1's
    cancelled place to j2, before j1's task gives its place up. j1 is cancelled, not failed."""
    done: list[JobResult] = []

    async def main() -> None:
        pipeline = _pipeline(tmp_path, done, n_run=1)
        for i in range(3):
            assert pipeline.start(JobSpec(job_id=f"j{i}", task="test"), {"sleep_s": {"run": 30.0 if i == 0 else 0.0}})
        run = pipeline.pools["run"]
        while (run.active, run.queued) != (1, 2):
            await asyncio.sleep(0.01)
        assert pipeline.cancel("j0") and pipeline.cancel("j1")  # one step of the loop: j0's task runs first
        while len(done) < 3:
            await asyncio.sleep(0.01)
        assert (run.active, run.queued) == (0, 0)

    asyncio.run(main())
    assert sorted((r.job_id, r.state, r.error and r.error.get("type")) for r in done) == [
        ("j0", "cancelled", None), ("j1", "cancelled", None), ("j2", "done", None)]


def test_a_later_stage_with_an_earlier_deadline_times_out_at_its_own_cap(tmp_path: Path) -> None:
    """INIT arms the job's deadline far away; RUN's 0.2 s cap is earlier, so RUN must re-arm it."""
    done: list[JobResult] = []

    async def main() -> None:
        pipeline = _pipeline(tmp_path, done)
        slow_init = {"sleep_s": {"init": 0.05}, "hang_in": "run"}
        spec = JobSpec(job_id="capped", task="test", timeout_s=60, stage_timeouts_s={"run": 0.2})
        result = await pipeline.run_job(spec, slow_init)
        assert result.state == "timed_out" and result.critical_error == "run"
        assert "stage cap of 0.200 s" in (result.error or {}).get("message", "")
        # Only in-stage time counts: INIT's sleep plus RUN's cap, nothing from EVAL (skipped).
        assert result.stage_s["run"] >= 0.19 and "eval" not in result.stage_s
        # The job budget still bounds a stage without a cap, after an earlier stage used part of it.
        spec = JobSpec(job_id="budget", task="test", timeout_s=0.3)
        result = await pipeline.run_job(spec, slow_init)
        assert result.state == "timed_out" and "job budget" in (result.error or {}).get("message", "")
        # A job whose stages never wait finishes without any timer firing later on.
        result = await pipeline.run_job(JobSpec(job_id="quick", task="test", timeout_s=0.5), {"echo": 1})
        assert result.state == "done"
        await asyncio.sleep(0.6)  # past its budget: a stale timer would cancel this test's task

    asyncio.run(main())


def test_a_stage_that_ends_past_its_limit_without_yielding_is_timed_out(tmp_path: Path) -> None:
    """A handler that blocks the loop past its cap gives the timer no turn to fire: the limit holds all the same."""
    done: list[JobResult] = []

    async def main() -> None:
        pipeline = _pipeline(tmp_path, done)
        spec = JobSpec(job_id="blocking", task="test", timeout_s=60, stage_timeouts_s={"eval": 0.01})
        result = await pipeline.run_job(spec, {"block_s": {"eval": 0.05}})
        assert result.state == "timed_out" and result.critical_error == "eval", result
        assert "stage cap of 0.010 s" in (result.error or {}).get("message", "")
        assert result.reward == 0.0 and result.output["fallback"] == "eval: StageTimeout"
        # Within its limit the same stage is done.
        spec = JobSpec(job_id="in-time", task="test", timeout_s=60, stage_timeouts_s={"eval": 5.0})
        result = await pipeline.run_job(spec, {"block_s": {"eval": 0.05}})
        assert result.state == "done" and result.reward == 1.0

    asyncio.run(main())


def test_a_node_fault_outside_the_stages_still_answers_for_the_job(tmp_path: Path) -> None:
    """Whatever breaks in the node's own code around a job, its submitter gets a FAILED result, not silence."""
    done: list[JobResult] = []

    async def broken(spec: JobSpec, instance: object, timing: object = None) -> JobResult:
        raise RuntimeError("bookkeeping bug")

    async def main() -> None:
        pipeline = _pipeline(tmp_path, done)
        pipeline.run_job = broken  # type: ignore[method-assign]
        assert pipeline.start(JobSpec(job_id="j", task="test"), {})
        while not done:
            await asyncio.sleep(0.01)
        assert "j" not in pipeline.jobs

    asyncio.run(main())
    [result] = done
    assert (result.state, result.critical_error) == ("failed", "node")
    assert result.error is not None and "bookkeeping bug" in result.error["message"]


def test_result_frames_are_the_bytes_of_to_wire_whatever_a_result_holds() -> None:
    """The node packs a result from its ``__dict__``; the frame must be what ``to_wire`` gives, or that path taken."""
    import enum

    from prorl_cli import protocol as P
    from prorl_cli.node.server import ResultPacker
    from prorl_cli.protocol import ErrorInfo, JobState

    class Plain(enum.Enum):
        A = "a"

    events = [["submitted", 0.0, 0.0, {"at": 1764612345.25}], ["stage", 0.001, 1e-5, {"stage": "run"}]]
    plain = JobResult(job_id="j", task="noop", state="done", node_id="n", reward=1.0, stage_s={"run": 1e-5},
                      active_s=1e-5, output={"x": [1, 2.5, None, b"raw"]}, events=events, meta={"k": 1})
    str_enum = JobResult(job_id="j", task="noop", state=JobState.FAILED)
    record = JobResult(job_id="j", task="noop", state="failed",
                       error=ErrorInfo(stage="run", type="E", message="m"))  # type: ignore[arg-type]
    plain_enum = JobResult(job_id="j", task="noop", state="done", output=Plain.A)
    extra = JobResult(job_id="j", task="noop", state="done")
    extra.note = "not a field"  # type: ignore[attr-defined]
    packer = ResultPacker()
    for result in (plain, str_enum, record, plain_enum, plain):
        assert packer.pack(result) == P.pack_obj(result.to_wire())
    # A record in a field is converted as to_wire converts it, and the packer still works afterwards.
    assert P.unpack_obj(packer.pack(record))["error"] == {"stage": "run", "type": "E", "message": "m"}
    assert "note" not in P.unpack_obj(packer.pack(extra))
    assert packer.pack(plain) == P.pack_obj(plain.to_wire())


def test_a_result_holding_what_msgpack_cannot_carry_still_goes_out_with_it_as_text() -> None:
    """A model's tool call with a 100-digit integer (or a handler's set) must not stop the result's delivery."""
    from prorl_cli import protocol as P
    from prorl_cli.node.server import ResultPacker

    huge = 10**100
    result = JobResult(job_id="j", task="noop", state="done",
                       output={"messages": [{"tool_calls": [{"arguments": {"n": huge, "m": -huge, "k": 7}}]}],
                               "seen": {3}, "fine": [1, 2.5, None]})
    packer = ResultPacker()
    out = P.unpack_obj(packer.pack(result))["output"]
    assert out["messages"][0]["tool_calls"][0]["arguments"] == {"n": str(huge), "m": str(-huge), "k": 7}
    assert out["seen"] == "{3}" and out["fine"] == [1, 2.5, None]
    plain = JobResult(job_id="j", task="noop", state="done", output={"x": 1})
    assert packer.pack(plain) == P.pack_obj(plain.to_wire())  # and the fast path still works


def test_a_job_clock_counts_each_stage_and_keeps_a_held_stage_limit_whole() -> None:
    from prorl_cli.node.clock import Arming, JobClock

    async def main() -> None:
        clock = JobClock(10.0, None, asyncio.get_running_loop(), Arming())
        clock.enter_stage(3.0, 100.0)
        assert clock.at == 103.0
        assert clock.leave_stage(104.5) == 4.5 and clock.at is None
        assert clock.expired  # it ended past its deadline, though the timer never fired
        assert clock.remaining_s == 5.5  # the budget counts in-stage time only
        clock.hold(True)  # held between stages: the next stage starts held
        clock.enter_stage(2.0, 200.0)
        assert clock.at is None and not clock.expired  # no deadline while held
        clock.hold(False)
        assert clock.at is not None and clock.at - clock.loop.time() <= 2.0  # the stage's whole limit, from now
        clock.close()

    asyncio.run(main())
