"""The trainer's client against a real deployment: what a DAPO-style trainer relies on, and broker restarts."""

from __future__ import annotations

import asyncio
import inspect
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from prorl_cli.client import AsyncRolloutClient, RolloutClient, Submitted
from prorl_cli.exceptions import BrokerUnavailable, UnknownJob
from prorl_cli.protocol import JobResult
from tests.harness import Deployment, fixed_port, one_node_deployment


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.05)



@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from one_node_deployment(tmp_path_factory, "api")


def test_the_blocking_client_has_every_method_of_the_async_one() -> None:
    public = {n for n, _ in inspect.getmembers(AsyncRolloutClient) if not n.startswith("_")}
    missing = sorted(n for n in public if not hasattr(RolloutClient, n))
    assert missing == []
    for name in ("results", "forget", "make_specs", "as_completed", "submit", "cancel"):
        assert name in public


def test_submit_says_which_ids_were_new_and_which_existed(deployment: Deployment) -> None:
    client = deployment.client
    first = client.submit("test", [{"echo": 1}, {"echo": 2}], job_ids=["sub-a", "sub-b"])
    assert isinstance(first, Submitted) and first == ["sub-a", "sub-b"]
    assert (first.accepted, first.existing) == (["sub-a", "sub-b"], [])
    again = client.submit("test", [{"echo": 2}, {"echo": 3}], job_ids=["sub-b", "sub-c"])
    assert (again.accepted, again.existing) == (["sub-c"], ["sub-b"])
    results = client.wait(["sub-a", "sub-b", "sub-c"], timeout_s=60)
    assert [r.output["echo"] for r in results] == [1, 2, 3], "sub-b kept its first instance"


def test_an_id_resubmitted_for_other_work_returns_its_job_and_the_broker_says_so(deployment: Deployment) -> None:
    """An id names one job: resubmitting it returns that job (a retry, a resumed run, ids submitted to watch
    them). Another instance or task under it gets that job's result, an earlier run's perhaps: the broker's log
    says so, once per submit."""
    client = deployment.client
    assert client.submit("test", [{"echo": "run A"}], job_ids=["reused-0"]).accepted == ["reused-0"]
    said = "job id(s) of a submit already name jobs of other work"
    assert client.submit("test", [{"echo": "run A"}], job_ids=["reused-0"]).existing == ["reused-0"]
    assert said not in deployment.log("broker"), "a retry is no other work"
    again = client.submit("test", [{"echo": "new"}, {"echo": "run B"}], job_ids=["reused-new", "reused-0"])
    assert (again.accepted, again.existing) == (["reused-new"], ["reused-0"])
    assert [r.output["echo"] for r in client.wait(["reused-0", "reused-new"], timeout_s=60)] == ["run A", "new"]
    assert "1 " + said + " (e.g. 'reused-0', now for another instance)" in deployment.log("broker")
    client.submit("noop", [{"echo": "run A"}], job_ids=["reused-0"])
    assert "now for task 'noop' (it ran 'test')" in deployment.log("broker")
    client.submit("test", [{"echo": "run A"}], job_ids=["reused-0"], sampling={"seed": 9})  # a new seed: other work
    assert "(e.g. 'reused-0', now for other sampling)" in deployment.log("broker")


def test_submits_the_broker_could_not_take_are_refused_in_the_client_at_once(deployment: Deployment) -> None:
    """One instance not in a list would be submitted key by key (or character by character); n < 1 submits
    nothing; an instance over broker.max_message_bytes gets no answer at all (libzmq drops the connection)."""
    from prorl_cli.exceptions import ProtocolError

    client = deployment.client
    with pytest.raises(TypeError, match="got one dict; put a single instance in a list"):
        client.submit("test", {"echo": 1})
    with pytest.raises(TypeError, match="got one str"):
        client.submit("test", "abc")
    for n in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="n: the number of jobs per instance"):
            client.submit("test", [{"echo": 1}], n=n)  # type: ignore[arg-type]
    limit = deployment.load_config().broker.max_message_bytes
    with pytest.raises(ProtocolError, match=r"instance 1 \('big'\) packs to .* over broker.max_message_bytes"):
        client.submit("test", [{"echo": "small"}, {"echo": "x" * (limit + 1)}], job_ids=["small", "big"])
    assert client.submit("test", [{"echo": "small"}], job_ids=["small"]).accepted == ["small"], "nothing was sent"


def test_refusals_are_the_exceptions_the_readme_names(deployment: Deployment) -> None:
    """README: ``BadRequest`` (a ``ValueError``) for a malformed request. A bad sampling field, refused by the
    client before sending, was a ``ProtocolError`` only, and a task no node serves an ``UnknownJob`` though
    ``UnknownTask`` exists: ``except BadRequest`` / ``except UnknownTask`` missed them. The old types still hold."""
    from prorl_cli import protocol as P
    from prorl_cli.exceptions import BadRequest, ProtocolError, TaskNotServed, UnknownTask

    client = deployment.client
    with pytest.raises(BadRequest, match=r"sampling\.temperature' must be in \[0, 1e\+06\], got -1") as refused:
        client.submit("test", [{"echo": 1}], sampling={"temperature": -1}, job_ids=["refused-0"])
    assert isinstance(refused.value, ProtocolError) and isinstance(refused.value, ValueError)
    assert refused.value.code == "bad_field"
    # The broker refuses the same field (sent raw, past the client's check) with the same type.
    with pytest.raises(BadRequest, match="temperature") as broker_refused:
        client.request(P.Op.SUBMIT, [P.pack_obj({"echo": 1})],
                       jobs=[{"job_id": "refused-0", "task": "test", "sampling": {"temperature": -1}}])
    assert broker_refused.value.code == "bad_field"
    with pytest.raises(UnknownTask, match=r"^unknown_task: no node serves task\(s\) \['no-such-task'\]") as unknown:
        client.submit("no-such-task", [{}])
    assert isinstance(unknown.value, UnknownJob) and isinstance(unknown.value, TaskNotServed)
    assert client.list_jobs(prefix="refused-") == {}, "nothing was taken"


def test_a_misspelt_task_submitted_before_any_node_is_named_when_nodes_come(tmp_path: Path) -> None:
    """With no node up a submit cannot tell a misspelt task from one a node will serve: the job waits. The broker
    says so when nodes register, and a wait that times out names the job."""
    d = Deployment(tmp_path / "home", "early")
    try:
        d.start_broker()
        (job,) = d.client.submit("tset", [{"echo": 1}])
        d.start_node("n1")
        d.wait_for(lambda st: any(n.alive for n in st.nodes), 30, "the node")
        assert "1 queued job(s) are for task(s) ['tset'] that no live node serves" in d.log("broker")
        with pytest.raises(TimeoutError, match=f"no result for job '{job}' after 0.5 s"):
            d.client.result(job, timeout_s=0.5)
        d.start_node("n2")
        d.wait_for(lambda st: len([n for n in st.nodes if n.alive]) == 2, 30, "the second node")
        assert d.log("broker").count("that no live node serves") == 1, "said once for the same tasks"
    finally:
        d.close()


def test_a_closed_client_says_so(deployment: Deployment) -> None:
    from prorl_cli.exceptions import ClientClosed

    client = RolloutClient(deployment.name, address=deployment.address, config=deployment.load_config())
    client.status()
    client.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine ... was never awaited"
        with pytest.raises(ClientClosed, match="this RolloutClient is closed"):
            client.status()
    client.close()  # twice is fine


def test_a_result_stream_takes_ids_added_after_it_started(deployment: Deployment) -> None:
    client = deployment.client
    first = client.submit("test", [{"echo": "first"}])
    stream = client.results(first, timeout_s=60)
    got = [next(stream)]
    more = client.submit("test", [{"echo": "top-up"}] * 2)
    stream.add(more)
    stream.add(first)  # already yielded: not again
    got += list(stream)
    assert sorted(r.job_id for r in got) == sorted([*first, *more])
    assert stream.pending == set()


def test_ids_added_while_a_consumer_waits_are_watched_at_once(deployment: Deployment) -> None:
    """A trainer resuming a group another client submitted adds its ids while ``async for`` waits on the stream."""
    client = deployment.client
    done = client.submit("test", [{"echo": "other client's"}])
    client.wait(done, timeout_s=60)
    (hung,) = client.submit("test", [{"hang_in": "run"}], timeout_s=120)

    async def main() -> JobResult:
        other = AsyncRolloutClient(deployment.name, address=deployment.address, config=deployment.load_config())
        async with other:
            stream = other.results([hung], timeout_s=60)
            waiting = asyncio.create_task(stream.__anext__())
            # Once the hung job is watched, the consumer goes on to wait on the stream without yielding again.
            while hung not in other._watched and not waiting.done():
                await asyncio.sleep(0.01)
            stream.add(done)
            try:
                return await waiting
            finally:
                await stream.aclose()

    try:
        got = asyncio.run(main())
    finally:
        client.cancel([hung])
        # Taken here, so that no later test's open-ended stream of this client gets it.
        assert client.result(hung, timeout_s=60).state == "cancelled"
    assert got.job_id == done[0] and got.output["echo"] == "other client's"


def test_an_open_ended_stream_follows_every_submit(deployment: Deployment) -> None:
    client = deployment.client
    with client.results() as stream:
        ids = [*client.submit("test", [{"echo": 1}]), *client.submit("test", [{"echo": 2}])]
        got = [next(stream).job_id, next(stream).job_id]
    assert sorted(got) == sorted(ids)


def test_cancel_with_unknown_ids_reports_per_id(deployment: Deployment) -> None:
    client = deployment.client
    (hung,) = client.submit("test", [{"hang_in": "run"}], timeout_s=60)
    deployment.wait_for(lambda st: st.jobs["run"] >= 1, 30, "the job to run")
    outcome = client.cancel([hung, "no-such-job"])
    assert outcome == {hung: "cancelled", "no-such-job": "unknown"}
    assert client.result(hung, timeout_s=30).state == "cancelled"
    with pytest.raises(UnknownJob):
        client.result("no-such-job", timeout_s=5)


def test_pause_and_resume_take_a_policy_version(deployment: Deployment) -> None:
    client = deployment.client
    client.pause_generation(policy_version=3)
    assert client.status().generation_paused
    client.resume_generation(policy_version=4)
    st = client.status()
    assert not st.generation_paused
    if hasattr(st, "policy_version"):  # K3 (routing team): the broker serves the version resume named
        assert st.policy_version == 4
    with pytest.raises(ValueError, match="policy_version"):
        client.pause_generation(policy_version=-1)


def test_group_id_and_meta_travel_from_spec_to_result(deployment: Deployment) -> None:
    client = deployment.client
    ids = client.submit("test", [{"echo": 1}] * 2, group_id="step3-prompt7", meta={"step": 3, "policy_version": 2})
    for r in client.wait(ids, timeout_s=60):
        assert (r.group_id, r.meta) == ("step3-prompt7", {"step": 3, "policy_version": 2})  # type: ignore[attr-defined]


def test_the_n_jobs_of_one_instance_are_one_group(deployment: Deployment, caplog: pytest.LogCaptureFixture) -> None:
    """README's ``submit(task, instances, n=8)`` then ``samples_from_results(results)``: each rollout was its own
    group (``group_id`` None), so every GRPO advantage was 0, silently."""
    import dataclasses

    from prorl_cli.agent.trajectory import ModelCall, Trajectory
    from prorl_cli.training.samples import samples_from_results

    client = deployment.client
    ids = client.submit("test", [{"echo": "a"}, {"echo": "b"}], n=3, job_ids=[f"grp-{k}" for k in range(6)])
    results = client.wait(ids, timeout_s=60)
    assert [r.group_id for r in results] == ["grp-0"] * 3 + ["grp-3"] * 3, "named after each instance's first job"
    assert list(client.list_jobs(group_id="grp-3")) == ["grp-3", "grp-4", "grp-5"]
    again = client.submit("test", [{"echo": "a"}, {"echo": "b"}], n=3, job_ids=list(ids))
    assert again.existing == list(ids), "a retry with the same ids makes the same groups (nothing new to run)"
    # A group given is kept as given; one job per instance has nobody to be grouped with.
    given = client.submit("test", [{"echo": "a"}, {"echo": "b"}], n=2, group_id="mine")
    assert {r.group_id for r in client.wait(given, timeout_s=60)} == {"mine"}
    (alone,) = client.submit("test", [{"echo": "c"}])
    assert client.result(alone, timeout_s=60).group_id is None

    # What a trainer does with them: rewards 1, 0, 0 in each group give advantages 2/3, -1/3, -1/3.
    traj = Trajectory(calls=[ModelCall(prompt_ids=[1, 2], output_ids=[3], logprobs=[-0.5], finish_reason="stop")])
    scored = [dataclasses.replace(r, reward=1.0 if k % 3 == 0 else 0.0, output={"trajectory": traj.to_dict()})
              for k, r in enumerate(results)]
    with caplog.at_level("WARNING", logger="prorl_cli.training.samples"):
        batch = samples_from_results(scored)
    assert [s.advantage for s in batch.samples] == [pytest.approx(a) for a in [2 / 3, -1 / 3, -1 / 3] * 2]
    assert "group of its own" not in caplog.text


def test_a_seeded_submission_gives_each_rollout_its_own_seed_and_a_rerun_the_same(deployment: Deployment) -> None:
    """One seed for n rollouts of a prompt would make them the same on an engine that honours it."""
    from prorl_cli.protocol import derive_seed

    client = deployment.client
    instances = [{"echo": 1, "echo_sampling": True}, {"echo": 2, "echo_sampling": True}]
    ids = client.submit("test", instances, n=3, sampling={"seed": 40, "max_tokens": 4})
    seeds = [r.output["sampling"]["seed"] for r in client.wait(ids, timeout_s=60)]
    assert seeds == [derive_seed(40, j) for j in range(6)] and len(set(seeds)) == 6
    again = client.submit("test", instances, n=3, sampling={"seed": 40, "max_tokens": 4})
    assert [r.output["sampling"]["seed"] for r in client.wait(again, timeout_s=60)] == seeds
    other = client.submit("test", instances, n=3, sampling={"seed": 41, "max_tokens": 4})
    assert not {r.output["sampling"]["seed"] for r in client.wait(other, timeout_s=60)} & set(seeds)
    # Specs made by hand keep the seed as given, unless told where the run's numbering starts.
    assert {s.sampling.seed for s in client.make_specs("test", 3, sampling={"seed": 40})} == {40}
    numbered = client.make_specs("test", 2, sampling={"seed": 40}, seed_from=6)
    assert [s.sampling.seed for s in numbered] == [derive_seed(40, 6), derive_seed(40, 7)]


def test_a_derived_seed_stays_in_the_wire_range_and_a_bad_one_is_refused_as_given() -> None:
    from prorl_cli.exceptions import ProtocolError
    from prorl_cli.protocol import derive_seed
    from prorl_cli.protocol.checks import BIG

    derived = [derive_seed(seed, n) for seed in (-BIG, -1, 0, 7, BIG) for n in range(50)]
    assert all(0 <= d <= BIG for d in derived) and len(set(derived)) == len(derived)
    assert derive_seed(7, 3) == derive_seed(7, 3) != derive_seed(8, 2)
    client = AsyncRolloutClient("schema-test")  # make_specs checks with the submit schema; nothing connects
    with pytest.raises(ProtocolError, match="seed"):
        client.make_specs("t", 2, sampling={"seed": -BIG - 1}, seed_from=5)  # refused though derived seeds fit


def test_forget_drops_consumed_results_at_the_broker_and_here(deployment: Deployment) -> None:
    client = deployment.client
    done = client.submit("test", [{"echo": 1}])
    (hung,) = client.submit("test", [{"hang_in": "run"}], timeout_s=60)
    client.wait(done, timeout_s=60)
    outcome = client.forget([*done, hung, "no-such-job"])
    assert (outcome.forgotten, outcome.running, outcome.unknown) == (list(done), [hung], ["no-such-job"])
    with pytest.raises(UnknownJob):
        client.result(done[0], timeout_s=5)  # gone at the broker too
    client.cancel([hung])


def test_a_broker_restarted_at_a_new_address_delivers_each_result_once_and_invents_none(tmp_path: Path) -> None:
    """A submit lost with the old broker leaves nothing behind; every result arrives once."""
    d = Deployment(tmp_path / "home", "mv", config={
        "broker": {"port": fixed_port()},
        "node": {"n_init": 2, "n_run": 2, "n_eval": 2, "credit": 2},
    })
    try:
        d.start_broker()
        d.start_node("n1")
        # No address: the client follows the rendezvous file, as a trainer does.
        client = RolloutClient("mv", config=d.load_config(), request_timeout_s=60)
        stream = client.results(timeout_s=180)  # open-ended: everything this client receives from now on
        quick = client.submit("test", [{"echo": "quick"}] * 2)
        slow = client.submit("test", [{"sleep_s": {"run": 1.5}}] * 4, timeout_s=60)
        seen: list[JobResult] = [client.result(j, timeout_s=60) for j in quick]
        d.wait_for(lambda st: st.jobs["run"] == 2, 30, "two slow jobs running, two queued")
        d.kill("broker", signal.SIGKILL)
        d.drop_client()
        d.config_path.write_text(yaml.safe_dump({**d.config, "broker": {**d.config["broker"], "port": fixed_port()}}))
        d.start_broker()
        # The client's socket still points at the dead broker: this submit goes nowhere and fails when the client
        # follows the move. Its ids must not be watched (no synthetic "BrokerRestarted" results for them).
        lost_ids = ["retry-0", "retry-1"]
        with pytest.raises(BrokerUnavailable):
            client.submit("test", [{"echo": "retried"}] * 2, job_ids=lost_ids)
        from_stream = [next(stream) for _ in range(len(quick) + len(slow))]
        # The trainer's retry is the only path by which those ids run.
        retried = client.submit("test", [{"echo": "retried"}] * 2, job_ids=lost_ids)
        assert retried.accepted == lost_ids
        from_stream += [next(stream) for _ in lost_ids]
        late = [r.job_id for r in client.wait([*slow, *lost_ids], timeout_s=60)]
        stream.close()
        client.close()
        ids = [r.job_id for r in from_stream]
        assert sorted(ids) == sorted([*quick, *slow, *lost_ids]), "each result exactly once on the stream"
        assert all(r.state == "done" for r in from_stream), [r for r in from_stream if r.state != "done"]
        assert {r.output["echo"] for r in from_stream if r.job_id in lost_ids} == {"retried"}
        assert late == [*slow, *lost_ids] and len(seen) == 2
    finally:
        d.close()


def test_one_retry_with_the_same_ids_succeeds_after_the_broker_moved(tmp_path: Path) -> None:
    """A submit in flight when the broker died fails; the trainer's single retry with the same ids goes to the new
    broker and succeeds, however the reply that brings the new boot id races it; no result comes twice or made up."""
    d = Deployment(tmp_path / "home", "mv1", config={"broker": {"port": fixed_port(), "journal": True}})
    try:
        d.start_broker()
        d.start_node("n1")
        client = RolloutClient("mv1", config=d.load_config(), request_timeout_s=60)
        stream = client.results(timeout_s=120)  # a trainer awaiting results: the client watches the broker
        first = client.submit("test", [{"echo": "before"}] * 2)
        got = [next(stream) for _ in first]
        d.kill("broker", signal.SIGKILL)
        d.drop_client()
        # The node's register to the dead broker is under way when the new broker comes up elsewhere.
        wait_until(lambda: "registering again" in d.log("n1"), 30, "the node to notice the broker is gone")
        d.config_path.write_text(yaml.safe_dump({**d.config, "broker": {**d.config["broker"], "port": fixed_port()}}))
        d.start_broker()
        ids = ["move-0", "move-1", "move-2"]
        with pytest.raises(BrokerUnavailable) as lost:
            client.submit("test", [{"echo": "retried"}] * 3, job_ids=ids)  # went to the dead broker
        assert "gone" in str(lost.value) or "does not answer" in str(lost.value), lost.value
        retried = client.submit("test", [{"echo": "retried"}] * 3, job_ids=ids)  # the one retry
        assert sorted(retried) == ids and not retried.existing
        got += [next(stream) for _ in ids]
        stream.close()
        client.close()
        assert sorted(r.job_id for r in got) == sorted([*first, *ids]), "each result exactly once"
        assert all(r.state == "done" and r.critical_error is None for r in got), [r for r in got if r.state != "done"]
        wait_until(lambda: "re-registered with the broker at" in d.log("n1"), 30, "the node to re-register")
        assert "could not register" not in d.log("n1") and " ERROR " not in d.log("n1"), d.log("n1")
    finally:
        d.close()


def test_a_blocking_client_never_closed_exits_without_pending_task_warnings(deployment: Deployment) -> None:
    """A one-line script (``RolloutClient(...).wait(ids)``) that never closes its client ends quietly."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from prorl_cli.client import RolloutClient\n"
        "c = RolloutClient(sys.argv[1], address=sys.argv[2])\n"
        "specs = c.make_specs('noop', 1)\n"
        "c.submit_specs(specs, [{}])\n"
        "(r,) = c.wait([s.job_id for s in specs], timeout_s=60)\n"
        "print(r.state)\n"  # and no close()
    )
    out = subprocess.run([sys.executable, "-c", script, deployment.name, deployment.address], env=deployment.env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    assert "Task was destroyed" not in out.stderr and "never awaited" not in out.stderr, out.stderr


def test_a_wait_that_times_out_while_the_broker_is_silent_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A stopped (or dead) broker under a waiting client: a warning says so while it waits (prorl submit prints
    it), the timeout names the broker, not only the count, and its return is said too."""
    import logging
    import os

    d = Deployment(tmp_path / "home", "silent", {"broker": {"heartbeat_interval_s": 0.2}})
    try:
        broker = d.start_broker()
        d.start_node("n1")
        with RolloutClient(d.name, address=d.address, config=d.load_config()) as c:
            specs = c.make_specs("test", 1)
            c.submit_specs(specs, [{"sleep_s": {"run": 30}}])
            os.kill(broker.pid, signal.SIGSTOP)
            try:
                with caplog.at_level(logging.WARNING, logger="prorl_cli.client.aio"), pytest.raises(
                        TimeoutError, match=r"1 result\(s\) still missing after 10 s; the broker at .* "
                                            r"has not answered for \d+ s"):
                    c.wait([s.job_id for s in specs], timeout_s=10)
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            said = [r.getMessage() for r in caplog.records if "has not answered for" in r.getMessage()]
            assert said and not any("for 0 s" in m for m in said), said  # silent since the unanswered ping went out
            assert all("results wait for it to come back" in m for m in said), said  # a wait for results, not a request
            c.cancel([s.job_id for s in specs])
    finally:
        d.close()


def test_a_ctrl_c_while_a_blocking_client_builds_its_loop_comes_once_the_loop_is_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the middle of ``asyncio.new_event_loop()`` left a half-built loop that printed "Exception
    ignored ... _ssock" at exit; it is held off until the loop is whole, and the loop is closed on the way out."""
    import os

    from prorl_cli.client import sync

    built: list[asyncio.AbstractEventLoop] = []
    real = asyncio.new_event_loop

    def interrupted_midway() -> asyncio.AbstractEventLoop:
        os.kill(os.getpid(), signal.SIGINT)  # unheld, the KeyboardInterrupt is raised at the next line
        loop = real()
        built.append(loop)
        return loop

    monkeypatch.setattr(sync.asyncio, "new_event_loop", interrupted_midway)
    with pytest.raises(KeyboardInterrupt):
        RolloutClient("nowhere", address="tcp://127.0.0.1:9")
    assert len(built) == 1, "the loop was built whole before the Ctrl-C came"
    assert built[0].is_closed(), "and closed on the way out"


def test_a_blocking_client_that_cannot_be_made_closes_its_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prorl_cli.client import sync

    built: list[asyncio.AbstractEventLoop] = []
    real = asyncio.new_event_loop
    monkeypatch.setattr(sync.asyncio, "new_event_loop", lambda: built.append(real()) or built[-1])
    monkeypatch.setenv("PRORL_HOME", str(tmp_path))
    with pytest.raises(Exception) as refused:
        RolloutClient("no-such-deployment", config=None, no_such_option=1)
    assert not isinstance(refused.value, KeyboardInterrupt)
    assert len(built) == 1 and built[0].is_closed(), "its loop (and the loop's self-pipe) went with it"
