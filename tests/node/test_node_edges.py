"""Edges of the node a user hits: handlers that raise BaseException, set bad rewards, swallow cancels,
and jobs cancelled while their cleanups run — against a real broker and node."""

from __future__ import annotations

import signal
import textwrap
import time
from pathlib import Path

import pytest

from tests.harness import Deployment

EDGE_HANDLER = textwrap.dedent('''
    import asyncio
    import sys
    from pathlib import Path

    from prorl_cli.node.handler import AgentHandler


    class Boom(BaseException):
        pass


    class EdgeHandler(AgentHandler):
        name = "edge"

        async def _stage(self, ctx, stage):
            inst = ctx.instance
            if inst.get("base_in") == stage:
                kind = inst.get("base", "boom")
                if kind == "exit":
                    sys.exit(3)
                if kind == "keyboard":
                    raise KeyboardInterrupt
                raise Boom(f"boom in {stage}")
            if inst.get("stubborn_in") == stage:
                while True:  # swallows every cancel and keeps its slot
                    try:
                        await asyncio.Event().wait()
                    except asyncio.CancelledError:
                        pass
            if inst.get("cleanups") and stage == "init":
                marks = Path(inst["cleanups"])

                def cleanup(i, wait):
                    async def fn():
                        if wait:
                            (marks / "waiting").touch()
                            await asyncio.sleep(3600)
                        (marks / f"cleaned-{i}").touch()
                    return fn
                ctx.add_cleanup(cleanup(0, False))
                ctx.add_cleanup(cleanup(1, True))
            if inst.get("hang_in") == stage:
                await asyncio.Event().wait()

        async def init(self, ctx):
            await self._stage(ctx, "init")

        async def run(self, ctx):
            await self._stage(ctx, "run")

        async def eval(self, ctx):
            await self._stage(ctx, "eval")
            ctx.reward = ctx.instance.get("reward", 1.0)

        def final_result(self, ctx):
            if ctx.instance.get("final") == "boom":
                raise Boom("final boom")
            if ctx.instance.get("final") == "cycle":
                ctx.output["self"] = ctx.output  # no wire format carries this
            if ctx.instance.get("final") == "object":
                return object()
            return ctx.output


    class SyncRunHandler(AgentHandler):
        name = "sync_run"

        async def init(self, ctx):
            pass

        def run(self, ctx):  # not async: the node cannot await it
            ctx.output["ran"] = True

        async def eval(self, ctx):
            ctx.reward = 1.0
''')


@pytest.fixture
def deployment(tmp_path: Path):
    d = Deployment(tmp_path / "home", "edges", {"node": {"n_init": 1, "n_run": 1, "n_eval": 1, "credit": 4}})
    d.start_broker()
    handler = tmp_path / "edge_handler.py"
    handler.write_text(EDGE_HANDLER)
    d.start_node("n1", "--handlers", str(handler))
    yield d
    d.close()


@pytest.mark.parametrize("kind", ["boom", "exit", "keyboard"])
@pytest.mark.parametrize("stage", ["init", "run", "eval"])
def test_a_handler_raising_a_base_exception_fails_its_job_and_the_node_stays_up(
        deployment: Deployment, kind: str, stage: str) -> None:
    client = deployment.client
    (bad,) = client.submit("edge", [{"base_in": stage, "base": kind}], timeout_s=15)
    (result,) = client.wait([bad], timeout_s=15)
    assert (result.state, result.critical_error) == ("failed", stage), result
    assert result.error is not None and stage in result.error["message"]
    # The node is still up and its slots are free.
    ok = client.submit("edge", [{}] * 2, timeout_s=15)
    assert [r.state for r in client.wait(ok, timeout_s=15)] == ["done"] * 2


def test_a_final_result_raising_a_base_exception_fails_its_job(deployment: Deployment) -> None:
    client = deployment.client
    (bad,) = client.submit("edge", [{"final": "boom"}], timeout_s=15)
    (result,) = client.wait([bad], timeout_s=15)
    assert (result.state, result.critical_error) == ("failed", "final_result"), result
    assert "'edge' handler's final_result raised Boom" in result.error["message"]


@pytest.mark.parametrize("final", ["cycle", "object"])
def test_a_final_result_no_wire_format_carries_fails_its_job_alone(deployment: Deployment, final: str) -> None:
    client = deployment.client
    ids = client.submit("edge", [{"final": final}, {}, {}], timeout_s=15)
    results = client.wait(ids, timeout_s=15)
    assert [r.state for r in results[1:]] == ["done"] * 2
    if final == "object":  # sent as text
        assert results[0].state == "done" and isinstance(results[0].output, str)
    else:
        assert (results[0].state, results[0].critical_error) == ("failed", "final_result"), results[0]
        assert "output" in results[0].error["message"]


def test_a_stage_that_is_not_async_fails_its_job_naming_the_handler_and_stage(deployment: Deployment) -> None:
    client = deployment.client
    (job_id,) = client.submit("sync_run", [{}], timeout_s=15)
    (result,) = client.wait([job_id], timeout_s=15)
    assert (result.state, result.critical_error) == ("failed", "run"), result
    assert "'sync_run' handler's run returned NoneType" in result.error["message"]
    assert "async def run" in result.error["message"]


@pytest.mark.parametrize("reward", [True, 1])
def test_a_whole_or_boolean_reward_goes_out_as_a_float(deployment: Deployment, reward: object) -> None:
    client = deployment.client
    (job_id,) = client.submit("edge", [{"reward": reward}], timeout_s=15)
    (result,) = client.wait([job_id], timeout_s=15)
    assert result.state == "done" and type(result.reward) is float and result.reward == 1.0, result


@pytest.mark.parametrize("reward", ["high", float("nan"), float("inf"), [1.0]])
def test_a_bad_reward_fails_its_job_naming_the_problem(deployment: Deployment, reward: object) -> None:
    client = deployment.client
    (bad,) = client.submit("edge", [{"reward": reward}], timeout_s=15)
    (result,) = client.wait([bad], timeout_s=15)
    assert (result.state, result.critical_error) == ("failed", "eval"), result
    assert result.error is not None and "reward" in result.error["message"]


def test_a_job_cancelled_while_a_cleanup_runs_still_runs_its_other_cleanups(deployment: Deployment, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    client = deployment.client
    # Its cleanups run after RUN: the first to run waits until cancelled; the other must still run.
    (job_id,) = client.submit("edge", [{"cleanups": str(marks)}], timeout_s=30)
    deployment.wait_for(lambda st: (marks / "waiting").exists(), 15, "the cleanup to start")
    client.cancel([job_id])
    (result,) = client.wait([job_id], timeout_s=15)
    assert result.state == "cancelled", result
    assert (marks / "cleaned-0").exists()  # the sandbox/workspace of the other cleanup is gone too
    assert not (marks / "cleaned-1").exists()
    # Its slots are free again.
    ok = client.submit("edge", [{}] * 2, timeout_s=30)
    assert [r.state for r in client.wait(ok, timeout_s=15)] == ["done"] * 2


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_handler_that_swallows_every_cancel_cannot_hold_its_slot(deployment: Deployment, how: str) -> None:
    client = deployment.client
    (stuck,) = client.submit("edge", [{"stubborn_in": "run"}], timeout_s=0.5 if how == "timeout" else 60)
    deployment.wait_for(lambda st: any(n.stages.get("run", {}).get("active") for n in st.nodes), 15, "RUN to start")
    if how == "cancel":
        client.cancel([stuck])
    # Past the node's grace (stop_grace_s, 3 s here) the job ends without its stage, which gave up the only RUN slot.
    (result,) = client.wait([stuck], timeout_s=20)
    assert (result.state, result.critical_error) == (("timed_out", "run") if how == "timeout" else ("cancelled", None))
    if how == "timeout":
        assert result.error is not None and "did not end" in result.error["message"]
    ok = client.submit("edge", [{}] * 2, timeout_s=30)
    assert [r.state for r in client.wait(ok, timeout_s=15)] == ["done"] * 2
    assert "ignored its cancel" in deployment.log("n1")


def test_a_handler_that_swallows_a_cancel_from_outside_ends_cancelled(deployment: Deployment, tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    client = deployment.client
    (job_id,) = client.submit("test", [{"hang_in": "run", "on_cancel": "swallow", "journal": str(journal)}],
                              timeout_s=60)
    deployment.wait_for(lambda st: (journal / f"{job_id}.log").exists()
                        and "run" in (journal / f"{job_id}.log").read_text(), 15, "RUN to start")
    client.cancel([job_id])
    (result,) = client.wait([job_id], timeout_s=15)
    assert result.state == "cancelled", result
    # The stage returned as if nothing happened, yet the job went no further.
    assert "eval" not in (journal / f"{job_id}.log").read_text()


def test_a_job_cancelled_twice_while_cleaning_up_reports_once_and_runs_every_cleanup(tmp_path: Path) -> None:
    """A second cancel (a repeated cancel_job, the node stopping) lands in the cleanups the first one started."""
    import asyncio

    from prorl_cli.config import ProrlConfig
    from prorl_cli.node.handler import AgentHandler, JobContext, Services
    from prorl_cli.node.pipeline import Pipeline
    from prorl_cli.node.registry import HandlerRegistry
    from prorl_cli.protocol import JobResult, JobSpec

    cleaned: list[str] = []
    events: dict[str, asyncio.Event] = {}

    class TwoCleanups(AgentHandler):
        name = "two_cleanups"

        async def init(self, ctx: JobContext) -> None:
            async def quick() -> None:
                cleaned.append("quick")

            async def slow() -> None:
                events["slow_cleanup"].set()
                await asyncio.Event().wait()
                cleaned.append("slow")

            ctx.add_cleanup(quick)
            ctx.add_cleanup(slow)  # runs first

        async def run(self, ctx: JobContext) -> None:
            events["running"].set()
            await asyncio.Event().wait()

        async def eval(self, ctx: JobContext) -> None:
            ctx.reward = 1.0

    registry = HandlerRegistry()
    registry.add(TwoCleanups, "test")
    done: list[JobResult] = []

    async def main() -> None:
        events.update(running=asyncio.Event(), slow_cleanup=asyncio.Event())
        pipeline = Pipeline(ProrlConfig(), registry, Services(), "n1", tmp_path,
                            on_stage=lambda spec, stage: None, on_done=done.append)
        assert pipeline.start(JobSpec(job_id="j", task="two_cleanups"), {})
        task = pipeline.jobs["j"].task
        await events["running"].wait()
        assert pipeline.cancel("j")  # ends RUN; its cleanups start
        await events["slow_cleanup"].wait()
        assert pipeline.cancel("j")  # lands in the slow cleanup
        await task
        assert pipeline.jobs == {} and pipeline._clocks == {}
        assert all(pool.active == 0 and pool.queued == 0 for pool in pipeline.pools.values())

    asyncio.run(main())
    assert [(r.job_id, r.state) for r in done] == [("j", "cancelled")]
    assert cleaned == ["quick"]  # the slow one was cut short; the other still ran


def test_a_job_cleaning_up_after_a_failed_init_is_not_one_waiting_for_run(tmp_path: Path) -> None:
    """A drain hands back the jobs between a good INIT and a RUN slot; one whose INIT failed and that is still
    tearing its sandbox down is not among them (handed back, its failure would be hidden and it would run again)."""
    import asyncio

    from prorl_cli.config import ProrlConfig
    from prorl_cli.node.handler import AgentHandler, JobContext, Services
    from prorl_cli.node.pipeline import Pipeline
    from prorl_cli.node.registry import HandlerRegistry
    from prorl_cli.protocol import JobResult, JobSpec

    tearing_down = asyncio.Event()
    torn_down = asyncio.Event()

    class FailingInit(AgentHandler):
        name = "failing_init"

        async def init(self, ctx: JobContext) -> None:
            async def slow_teardown() -> None:
                tearing_down.set()
                await torn_down.wait()

            ctx.add_cleanup(slow_teardown)
            if ctx.instance.get("fail"):
                raise RuntimeError("the image would not start")

        async def run(self, ctx: JobContext) -> None:
            await asyncio.Event().wait()

        async def eval(self, ctx: JobContext) -> None:
            ctx.reward = 1.0

    registry = HandlerRegistry()
    registry.add(FailingInit, "test")
    done: list[JobResult] = []

    async def main() -> None:
        pipeline = Pipeline(ProrlConfig(), registry, Services(), "n1", tmp_path,
                            on_stage=lambda spec, stage: None, on_done=done.append)
        assert pipeline.start(JobSpec(job_id="bad", task="failing_init"), {"fail": True})
        await tearing_down.wait()
        assert pipeline.jobs["bad"].stage == "init" and pipeline.waiting_for_run() == []
        torn_down.set()
        await pipeline.jobs["bad"].task

    asyncio.run(main())
    assert [(r.job_id, r.state, r.error and r.error["type"]) for r in done] == [("bad", "failed", "RuntimeError")]


def test_results_finished_while_the_broker_is_down_reach_the_restarted_broker_once(tmp_path: Path) -> None:
    from tests.harness import fixed_port

    d = Deployment(tmp_path / "home", "down", {"broker": {"port": fixed_port(), "journal": True},
                                                "node": {"n_init": 4, "n_run": 4, "n_eval": 4, "credit": 4}})
    try:
        d.start_broker()
        d.start_node("n1")
        journal = tmp_path / "journal"
        journal.mkdir()
        client = d.client
        ids = client.submit("test", [{"sleep_s": {"run": 1.0}, "journal": str(journal)}] * 4, timeout_s=60)
        d.wait_for(lambda st: st.jobs["run"] == 4, 30, "four jobs running")
        d.kill("broker", signal.SIGKILL)
        # Every job finishes (and sends its result into the void) before the broker is back.
        logs = [journal / f"{j}.log" for j in ids]
        end = time.monotonic() + 30
        while not all(f.exists() and "eval" in f.read_text() for f in logs):  # polls a condition, as wait_for does
            assert time.monotonic() < end, "the jobs never reached EVAL"
            time.sleep(0.05)
        d.start_broker()
        results = client.wait(ids, timeout_s=60)
        assert [(r.state, r.attempt) for r in results] == [("done", 1)] * 4
        assert all(f.read_text().count(" run ") == 1 for f in logs), "no job ran twice"
    finally:
        d.close()
