"""Weight sync through a real broker, node and bridges: pause-aware job clocks, a pause that drains, reload.

The bridges serve scripted engines (fixed ids through the real generate
contract, run in this process) or the sim engine; the broker and the node
are real processes speaking the real protocol.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.exceptions import DrainTimeout
from prorl_cli.inference.contract import Generation
from prorl_cli.protocol import SamplingParams
from tests.fakes.bridges import ThreadBridge
from tests.fakes.engines import CountingEngine
from tests.harness import Deployment
from tests.inference.conftest import HANDLERS

#: Checkpoint folders the trainer's update_weights names (the client refuses one that is not there); the fake
#: engines here load nothing from them.
CKPT = Path(tempfile.mkdtemp(prefix="prorl-ckpt-"))
for _v in (1, 2, 3):
    (CKPT / f"v{_v}").mkdir()
atexit.register(shutil.rmtree, CKPT, True)


class VersionedEngine(CountingEngine):
    """A scripted engine whose weights are a version number: a reload swaps it, the output says which served."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(delay_s)
        self.policy_version: int | None = 0
        self.reloads: list[str] = []
        self.release = threading.Event()
        self.gate = False

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        version = self.policy_version
        if self.gate:
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 60)
        gen = await super().generate(prompt_ids, sampling)
        gen.output_ids = [100 + int(version or 0)]
        gen.logprobs = [-0.5]
        gen.policy_version = version
        return gen

    async def reload(self, checkpoint: str, policy_version: int) -> None:
        self.reloads.append(checkpoint)
        self.policy_version = policy_version


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Callable[..., Deployment]]:
    """``start(config, bridges=True)``: a broker and one node (short job clocks), closed afterwards."""
    made: list[Deployment] = []
    threads: list[ThreadBridge] = []

    def start(config: dict[str, Any] | None = None) -> Deployment:
        d = Deployment(tmp_path / f"home{len(made)}", config=config or {})
        made.append(d)
        d.start_broker()
        d.start_node("n1", "--handlers", str(HANDLERS))
        return d

    start.bridge = lambda d, bid, engine: threads.append(ThreadBridge(d, bid, engine)) or threads[-1]  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for d in made:
            d.close()
        for b in threads:
            b.close()


def test_a_paused_cluster_times_out_no_job(stack: Any) -> None:
    """A job whose RUN limit is 2 s (and generate timeout 2 s) survives a 5 s pause, and one with no backend yet."""
    d = stack({"inference": {"generate_timeout_s": 2.0}})
    # No backend registered: the call is held, the job's clocks stand still.
    (early,) = d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2}, stage_timeouts_s={"run": 2.0})
    d.wait_for(lambda st: st.held_generates == 1, 30, "the call to be held (no backend)", "n1")
    with pytest.raises(TimeoutError):
        d.client.result(early, timeout_s=4.0)  # twice its limits pass while it is held
    stack.bridge(d, "b1", CountingEngine())
    (res,) = d.client.wait([early], timeout_s=60)
    assert res.state == "done" and res.output["backends"] == ["b1"], res
    assert res.stage_s["run"] < 2.0, res.stage_s  # the held time is not in-stage time

    d.client.pause_generation()
    (job,) = d.client.submit("calls", [{"calls": 2}], sampling={"max_tokens": 2}, stage_timeouts_s={"run": 2.0})
    d.wait_for(lambda st: st.held_generates == 1, 30, "the call to be held (paused)", "n1")
    with pytest.raises(TimeoutError):
        d.client.result(job, timeout_s=5.0)
    d.client.resume_generation()
    (res,) = d.client.wait([job], timeout_s=60)
    assert res.state == "done" and "error" not in res.output, res
    assert res.output["backends"] == ["b1", "b1"]
    assert res.active_s < 2.0, res.active_s


def test_the_clock_still_runs_for_a_call_that_is_not_held(stack: Any) -> None:
    """The control: a call that a backend serves slowly still times out (only held time stands still)."""
    d = stack({"inference": {"generate_timeout_s": 60.0}})
    stack.bridge(d, "b1", CountingEngine(delay_s=30.0))
    (job,) = d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2}, stage_timeouts_s={"run": 1.0})
    (res,) = d.client.wait([job], timeout_s=60)
    assert res.state == "timed_out" and res.critical_error == "run", res


def one_call_held(stack: Any) -> tuple[Any, VersionedEngine, str]:
    """A deployment whose one bridge holds a job's first call in its engine (``engine.release`` lets it go)."""
    d = stack()
    engine = VersionedEngine()
    engine.gate = True
    stack.bridge(d, "b1", engine)
    (job,) = d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2})
    d.wait_for(lambda st: st.backends[0].inflight == 1, 30, "the call in flight", "n1")
    return d, engine, job


def test_pause_with_wait_returns_once_slow_calls_in_flight_finish(stack: Any) -> None:
    d = stack()
    engine = VersionedEngine()
    engine.gate = True
    stack.bridge(d, "b1", engine)
    jobs = d.client.submit("calls", [{"calls": 1}] * 2, sampling={"max_tokens": 2})
    d.wait_for(lambda st: st.backends[0].inflight == 2, 30, "two calls in flight", "n1")
    done = threading.Event()

    def pause() -> None:
        with d.new_client() as c:
            c.pause_generation(policy_version=1, wait=True, timeout_s=60)
        done.set()

    t = threading.Thread(target=pause)
    t.start()
    assert not done.wait(1.0), "the pause returned while two calls were in flight"
    engine.release.set()
    t.join(60)
    assert done.is_set()
    assert d.client.status().backends[0].inflight == 0
    assert engine.finished == 2  # it returned after them, not before
    d.client.resume_generation()
    assert all(r.ok for r in d.client.wait(jobs, timeout_s=60))


def test_pause_with_wait_raises_at_its_timeout_naming_the_hung_call(stack: Any) -> None:
    d, engine, job = one_call_held(stack)  # never released: the call hangs
    with pytest.raises(DrainTimeout, match=job) as err:
        d.client.pause_generation(wait=True, timeout_s=1.0)
    assert [c["job_id"] for c in err.value.running] == [job] and err.value.running[0]["backend_id"] == "b1"
    assert d.client.status().generation_paused  # it stays paused: the caller decides
    engine.release.set()
    d.client.resume_generation()
    (res,) = d.client.wait([job], timeout_s=60)
    assert res.ok


def test_update_weights_waits_for_calls_in_flight_which_keep_the_old_version(stack: Any) -> None:
    d, engine, before = one_call_held(stack)
    updated: list[Any] = []

    def update() -> None:
        with d.new_client() as c:
            updated.append(c.update_weights(f"{CKPT}/v1", policy_version=1, timeout_s=60))

    t = threading.Thread(target=update)
    t.start()
    t.join(1.0)
    assert not updated and engine.reloads == [], "the weights changed under a call in flight"
    engine.release.set()
    t.join(60)
    assert updated and updated[0].updated == ["b1"] and engine.reloads == [f"{CKPT}/v1"]
    (res,) = d.client.wait([before], timeout_s=60)
    assert res.output["outputs"] == [[100]] and res.output["versions"] == [0]  # old weights, old version
    (after,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2}), timeout_s=60)
    assert after.output["outputs"] == [[101]] and after.output["versions"] == [1]
    assert d.client.status().policy_version == 1


def test_update_weights_names_a_backend_that_cannot_reload(stack: Any) -> None:
    from prorl_cli.exceptions import ReloadFailed

    d = stack()
    stack.bridge(d, "b1", CountingEngine())  # the Engine default: no in-place reload
    with pytest.raises(ReloadFailed, match="b1.*cannot load weights in place") as err:
        d.client.update_weights(f"{CKPT}/v2", policy_version=2, timeout_s=30)
    assert list(err.value.failed) == ["b1"]
    assert d.client.status().policy_version == 0



def test_a_checkpoint_that_is_not_there_is_refused_before_anything_is_sent(stack: Any) -> None:
    """With no bridge up to try it, the broker would have taken a mistyped path as the weights every bridge
    joining later must load (and shut down on failing to): the trainer's client refuses it first."""
    from prorl_cli.exceptions import CheckpointNotFound

    d = stack()
    with pytest.raises(CheckpointNotFound, match=f"update_weights: checkpoint {CKPT}/v9 does not exist here") as err:
        d.client.update_weights(f"{CKPT}/v9", policy_version=9, timeout_s=30)
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(CheckpointNotFound):
        d.client.sync_weights(f"{CKPT}/v9", policy_version=9, drain_timeout_s=30, timeout_s=30)
    report = d.client.status()
    assert report.policy_version == 0 and not report.generation_paused


def test_sync_weights_is_a_whole_step_boundary_and_a_failing_load_leaves_generation_running(stack: Any) -> None:
    d = stack()
    engine = VersionedEngine()
    stack.bridge(d, "b1", engine)
    synced = d.client.sync_weights(f"{CKPT}/v3", policy_version=3, drain_timeout_s=30, timeout_s=60)
    assert synced.updated == ["b1"] and engine.reloads == [f"{CKPT}/v3"]
    report = d.client.status()
    assert report.policy_version == 3 and not report.generation_paused
    (after,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2}), timeout_s=60)
    assert after.output["outputs"] == [[103]] and after.output["versions"] == [3]
    # A trainer's own load that raises: the error goes on, generation resumes under the version served before.
    with pytest.raises(RuntimeError, match="disk full"), d.client.generation_paused(4, drain_timeout_s=30):
        assert d.client.status().generation_paused
        raise RuntimeError("disk full")
    report = d.client.status()
    assert not report.generation_paused and report.policy_version == 3
    (again,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2}), timeout_s=60)
    assert again.output["versions"] == [3]


def test_sync_weights_to_a_bridge_that_cannot_reload_raises_and_resumes(stack: Any) -> None:
    from prorl_cli.exceptions import ReloadFailed

    d = stack()
    stack.bridge(d, "b1", CountingEngine())
    with pytest.raises(ReloadFailed, match="b1"):
        d.client.sync_weights(f"{CKPT}/v2", policy_version=2, drain_timeout_s=30, timeout_s=30)
    assert not d.client.status().generation_paused
    (res,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2}), timeout_s=60)
    assert res.state == "done"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reload_serves_the_new_checkpoint_like_a_fresh_bridge(stack: Any, tiny_model: Path, tmp_path: Path) -> None:
    """The transformers engine in a real bridge process: after ``prorl backends reload``, greedy output is the new model's."""
    import subprocess
    import sys

    from prorl_cli.inference.tiny_model import make_tiny_model
    from prorl_cli.inference.transformers_engine import TransformersEngine
    from tests.inference.conftest import start_bridge

    new_ckpt = make_tiny_model(tmp_path / "v1", seed=1)
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    d = stack()
    start_bridge(d, "b1", "--engine", "transformers", "--model", str(tiny_model), timeout_s=180)
    (old,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling=greedy), timeout_s=120)
    cli = [sys.executable, "-m", "prorl_cli", "-d", d.name, "backends"]
    out = subprocess.run([*cli, "pause", "--policy-version", "1", "--wait", "--timeout-s", "60"],
                         env=d.env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([*cli, "reload", "--checkpoint", str(new_ckpt), "--policy-version", "1"],
                         env=d.env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "b1" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([*cli, "resume", "--policy-version", "1"], env=d.env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (new,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling=greedy), timeout_s=120)

    async def fresh() -> list[int]:
        engine = TransformersEngine(new_ckpt)
        try:
            return (await engine.generate([1, 2, 3], SamplingParams(**greedy))).output_ids
        finally:
            await engine.close()

    expected = asyncio.run(fresh())
    assert new.output["outputs"] == [expected] and new.output["versions"] == [1]
    assert old.output["outputs"] != [expected] and old.output["versions"] == [0]


def test_a_lower_policy_version_is_said_in_the_brokers_log(stack: Any) -> None:
    """A resumed trainer that counts from 0 again: the versions stamped on tokens stop meaning staleness."""
    d = stack()
    d.client.pause_generation(policy_version=5)
    d.client.resume_generation(policy_version=5)
    assert "lower than the current" not in d.log("broker")
    d.client.pause_generation(policy_version=1)
    d.client.resume_generation(policy_version=1)
    d.wait_for(lambda st: not st.generation_paused, 30, "generation resumed")
    assert d.log("broker").count("policy version 1 is lower than the current 5") == 1, d.log("broker")


def test_a_pause_whose_drain_times_out_leaves_the_policy_version_where_it_was(stack: Any) -> None:
    """``pause_generation(1, wait=True)`` that raises DrainTimeout has loaded nothing: a trainer that gives the step
    up (resumes without a version) must not get tokens from the old weights stamped with version 1. The bridge here
    never had an update, so the broker's version is what every reply carries."""
    d, engine, slow = one_call_held(stack)  # the first call hangs until released
    with pytest.raises(DrainTimeout, match="policy version stays 0"):
        d.client.pause_generation(policy_version=1, wait=True, timeout_s=0.5)
    st = d.client.status()
    assert st.generation_paused and st.policy_version == 0, st
    (held,) = d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2})
    d.wait_for(lambda st: st.held_generates == 1, 30, "the new call to be held", "n1")
    engine.release.set()
    d.client.resume_generation()  # the trainer gives the step up: the old weights go on serving
    slow_res, held_res = d.client.wait([slow, held], timeout_s=60)
    assert slow_res.output["versions"] == [0] and held_res.output["versions"] == [0], (slow_res, held_res)
    assert d.client.status().policy_version == 0

    # The same pause that drains moves the version: calls routed after the resume carry it.
    d.client.pause_generation(policy_version=1, wait=True, timeout_s=60)
    assert d.client.status().policy_version == 1
    d.client.resume_generation()
    (after,) = d.client.wait(d.client.submit("calls", [{"calls": 1}], sampling={"max_tokens": 2}), timeout_s=60)
    assert after.output["versions"] == [1], after


def test_a_pause_answered_by_a_resume_before_its_drain_leaves_the_policy_version(stack: Any) -> None:
    d, engine, job = one_call_held(stack)
    raised: list[BaseException] = []

    def pause() -> None:
        with d.new_client() as c:
            try:
                c.pause_generation(policy_version=2, wait=True, timeout_s=60)
            except DrainTimeout as e:
                raised.append(e)

    t = threading.Thread(target=pause)
    t.start()
    d.wait_for(lambda st: st.generation_paused, 30, "the pause to reach the broker")
    assert d.client.status().policy_version == 0  # not before its drain is over
    d.client.resume_generation()
    t.join(60)
    assert raised and "resumed before the calls in flight drained" in str(raised[0]), raised
    assert d.client.status().policy_version == 0
    engine.release.set()
    (res,) = d.client.wait([job], timeout_s=60)
    assert res.ok and res.output["versions"] == [0], res


def test_weights_no_bridge_loaded_are_reported_unverified_until_one_does(stack: Any) -> None:
    """An update answered with no bridge up is taken as the current weights (a bridge joining later must load
    them), but nothing has loaded the checkpoint: the reply, ``status`` and ``prorl status``'s flags say so."""
    from prorl_cli.observe.dashboard import status_flags

    d = stack()
    assert d.client.status().weights is None  # no update yet
    done = d.client.update_weights(f"{CKPT}/v1", policy_version=1, timeout_s=30)
    assert (done.updated, done.verified, done.policy_version) == ([], False, 1), done
    st = d.client.status()
    assert st.weights is not None and (st.weights.checkpoint, st.weights.policy_version, st.weights.verified) == (
        f"{CKPT}/v1", 1, False), st.weights
    assert f"weights v1 UNVERIFIED: no bridge has loaded {CKPT}/v1 yet" in status_flags(st)

    engine = VersionedEngine()
    stack.bridge(d, "b1", engine)  # joins on its start weights: it loads v1 first, which verifies them
    st = d.wait_for(lambda st: st.weights is not None and st.weights.verified, 60, "the weights to be verified", "broker")
    assert engine.reloads == [f"{CKPT}/v1"] and not any("UNVERIFIED" in f for f in status_flags(st))
    assert "verified: backend b1 loaded them" in d.log("broker")

    # With a bridge up, the reply says at once that one loaded them.
    done = d.client.update_weights(f"{CKPT}/v2", policy_version=2, timeout_s=30)
    assert (done.updated, done.verified) == (["b1"], True), done
    st = d.client.status()
    assert st.weights is not None and (st.weights.policy_version, st.weights.verified) == (2, True), st.weights
