"""``prorl submit / results / cancel``: exit codes, ``--out`` files, reattaching, cancelling by selection.

Real subprocesses against a real broker and node; the node also serves a small handler written here
that records a trajectory before it ends the way its instance says (done, raise, hang, wait for a file).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prorl_cli.broker.jobs import JobTable
from prorl_cli.exceptions import RemoteError
from prorl_cli.protocol import JobSpec, Op
from tests.harness import Deployment, kill_if_running, one_node_deployment

HANDLER = '''
import asyncio
from pathlib import Path

from prorl_cli.agent.trajectory import ModelCall, Trajectory
from prorl_cli.node.handler import AgentHandler


class PartialHandler(AgentHandler):
    """Records a one-call trajectory in RUN, then ends as the instance says."""

    name = "partial"

    async def init(self, ctx):
        return None

    async def run(self, ctx):
        calls = [ModelCall(prompt_ids=[1, 2], output_ids=[3], logprobs=[-0.5], finish_reason="stop")]
        if ctx.instance.get("sub_agent"):  # a second conversation: a sub-agent's call
            calls.append(ModelCall(prompt_ids=[7], output_ids=[8], logprobs=[-0.1], finish_reason="stop", segment=1,
                                   agent="helper"))
        ctx.output["trajectory"] = Trajectory(calls=calls, sequence_ids=[1, 2, 3], loss_mask=[0, 0, 1],
                                              logprobs=[0.0, 0.0, -0.5], stop_reason="stop").to_dict()
        end = ctx.instance.get("end")
        if end == "raise":
            raise RuntimeError("scripted")
        if end == "hang":
            await asyncio.Event().wait()
        gate = ctx.instance.get("wait_for")
        while gate and not Path(gate).exists():
            await asyncio.sleep(0.05)

    async def eval(self, ctx):
        ctx.reward = 1.0
'''


def prorl(d: Deployment, *args: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prorl_cli", *args], env={**d.env(), "COLUMNS": "200", **(env or {})},
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    handlers = tmp_path_factory.mktemp("handlers")
    (handlers / "partial.py").write_text(HANDLER)
    yield from one_node_deployment(tmp_path_factory, "jobs", node_args=("--handlers", str(handlers)))


def write_tasks(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_submit_exits_0_when_jobs_fail_or_time_out_and_1_with_strict(deployment: Deployment, tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "t.jsonl", [{"echo": 1}, {"raise_in": "run"}, {"hang_in": "run"}])
    out = tmp_path / "out.jsonl"
    r = prorl(deployment, "submit", "-d", deployment.name, str(tasks), "--task", "test", "-n", "2", "--timeout-s", "1",
              "--out", str(out))
    assert r.returncode == 0, r.stderr
    states = sorted(json.loads(line)["state"] for line in out.read_text().splitlines())
    assert states == ["done", "done", "failed", "failed", "timed_out", "timed_out"]
    assert "timed_out" in r.stdout and "6 job(s)" in r.stdout  # counted in the summary
    assert f"prorl results -d {deployment.name} --prefix sub-" in r.stderr, "says how to find the jobs again"
    # Off a terminal (stderr is a pipe here): plain progress lines with the summary's states, no bar, no escapes.
    progress = [line for line in r.stderr.splitlines() if line.startswith("test: ")]
    assert progress[0].startswith("test: 0/6 ended; running "), r.stderr
    assert progress[-1].startswith("test: 6/6 ended (done 2, failed 2, timed_out 2)"), r.stderr
    assert "\x1b[" not in r.stderr and "━" not in r.stderr, r.stderr
    strict = prorl(deployment, "submit", "-d", deployment.name, str(tasks), "--task", "test", "--timeout-s", "1", "--strict")
    assert strict.returncode == 1, strict.stderr
    # Submission errors still fail: an unknown task, and a deployment without a broker.
    assert prorl(deployment, "submit", "-d", deployment.name, str(tasks), "--task", "nope").returncode == 1
    gone = prorl(deployment, "submit", "-d", "no-such-deployment", str(tasks), "--task", "test")
    assert gone.returncode == 1 and "no-such-deployment" in gone.stderr


def test_parquet_keeps_every_trajectory_with_its_state(deployment: Deployment, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    tasks = write_tasks(tmp_path / "t.jsonl", [{"end": "done"}, {"end": "raise"}, {"end": "hang"}])
    out = tmp_path / "all.parquet"
    r = prorl(deployment, "submit", "-d", deployment.name, str(tasks), "--task", "partial", "--timeout-s", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = pq.read_table(out).to_pylist()
    assert sorted(row["state"] for row in rows) == ["done", "failed", "timed_out"]
    assert all(row["sequence_ids"] == [1, 2, 3] and row["loss_mask"] == [0, 0, 1] for row in rows)
    # Read back as report/trace/inspect read it: the broker's own figures for each job, not zeros and no group.
    from prorl_cli.observe.results import load_results

    for got in load_results(out):
        want = deployment.client.result(got.job_id, timeout_s=30)
        assert got.stage_s and got.stage_s == want.stage_s and got.active_s == want.active_s, (got, want)
        assert (got.attempt, got.group_id, got.node_id) == (want.attempt, want.group_id, want.node_id)
        assert got.group_id is not None and got.job_id.startswith(got.group_id)
        assert (got.state, got.critical_error, got.error) == (want.state, want.critical_error, want.error)
    done = tmp_path / "done.parquet"
    r = prorl(deployment, "submit", "-d", deployment.name, str(tasks), "--task", "partial", "--timeout-s", "1",
              "--out", str(done), "--only-done")
    assert r.returncode == 0, r.stderr
    assert [row["state"] for row in pq.read_table(done).to_pylist()] == ["done"]


def _error_line(stderr: str) -> str:
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    return line


def test_a_parquet_out_that_cannot_be_written_keeps_every_result_as_jsonl_beside_it(
    deployment: Deployment, tmp_path: Path
) -> None:
    """`--out X.parquet` for jobs that record no trajectory: the jobs ran, so their results are written whole to a
    JSONL beside it (never over a file of the user's), the error says where and how to collect them again, and that
    command, pasted, does."""
    import shlex

    tasks = write_tasks(tmp_path / "problems.jsonl", [{"echo": 1}, {"echo": 2}])
    (tmp_path / "r2.jsonl").write_text("mine\n")
    out = tmp_path / "r2.parquet"
    r = prorl(deployment, "submit", "-d", deployment.name, "--task", "test", str(tasks), "-n", "2",
              "--id-prefix", "noparq", "--out", str(out))
    assert r.returncode == 1, r.stderr  # the file asked for is not there: a script must not go on as if it were
    assert not out.exists() and (tmp_path / "r2.jsonl").read_text() == "mine\n"
    stand_in = tmp_path / "r2-1.jsonl"
    rows = [json.loads(line) for line in stand_in.read_text().splitlines()]
    assert sorted(row["job_id"] for row in rows) == [f"noparq-{i}-{k}" for i in range(2) for k in range(2)]
    assert all(row["state"] == "done" and row["output"]["echo"] in (1, 2) for row in rows), rows
    error = _error_line(r.stderr)
    assert f"{out}: not written: no job has a token-level 'trajectory' in its output ('test' recorded none" in error
    assert f"the 4 whole result(s) are in {stand_in} instead" in error, error
    assert f"results in {stand_in}" in r.stdout, "the summary says where they are"
    again = error.split("`")[1]
    assert again == f"prorl results -d {deployment.name} --prefix noparq --out FILE", error
    pasted = subprocess.run([sys.executable, "-m", "prorl_cli", *shlex.split(again.replace("FILE", str(tmp_path / "again.jsonl")))[1:]],
                            env={k: v for k, v in deployment.env().items() if k != "PRORL_DEPLOYMENT"},
                            capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0, pasted.stderr
    assert len((tmp_path / "again.jsonl").read_text().splitlines()) == 4
    # `prorl results --out X.parquet` follows the same rule (one ResultFile for both).
    r = prorl(deployment, "results", "-d", deployment.name, "--prefix", "noparq", "--out", str(tmp_path / "y.parquet"))
    assert r.returncode == 1 and len((tmp_path / "y.jsonl").read_text().splitlines()) == 4, r.stderr
    assert "`prorl results -d jobs --prefix noparq --out FILE` collects them again" in _error_line(r.stderr)


def test_sample_parquet_out_without_trajectories_keeps_the_results_as_jsonl_beside_it(
    deployment: Deployment, tmp_path: Path
) -> None:
    """`prorl sample --out X.parquet` for jobs that record no trajectory follows `submit --out X.parquet`: the groups'
    results are written whole (with their group_id and step, as `--out X.jsonl` writes them) to a JSONL beside it,
    and the command says where and exits 1, instead of dropping the rollouts it ran."""
    pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    tasks = write_tasks(tmp_path / "prompts.jsonl",
                        [{"p": 0.5, "scale_s": 0.01, "max_s": 0.05, "seed": i} for i in range(8)])
    (tmp_path / "s.jsonl").write_text("mine\n")
    out = tmp_path / "s.parquet"
    r = prorl(deployment, "sample", "-d", deployment.name, str(tasks), "--task", "dapo_sim", "--group-size", "2",
              "--target-groups", "1", "--id-prefix", "sampq", "--out", str(out))
    assert r.returncode == 1, r.stderr
    assert not out.exists() and (tmp_path / "s.jsonl").read_text() == "mine\n"
    stand_in = tmp_path / "s-1.jsonl"
    rows = [json.loads(line) for line in stand_in.read_text().splitlines()]
    assert len(rows) == 2 and len({row["group_id"] for row in rows}) == 1 and {row["step"] for row in rows} == {0}
    assert all(row["job_id"].startswith("sampq-") and row["state"] == "done" for row in rows), rows
    error = _error_line(r.stderr)
    assert f"{out}: not written: no job has a token-level 'trajectory' in its output ('dapo_sim' recorded none" in error
    assert f"the 2 whole result(s) are in {stand_in} instead" in error, error
    assert f"results in {stand_in}" in r.stdout, "the summary says where they are"


def test_sample_groups_to_parquet_count_the_jobs_without_a_sample_and_keep_unusable_ones_as_jsonl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prorl sample`'s Parquet: a job without a trajectory has no sample and is counted (as `submit` counts its
    rows); a trajectory no sample can be made of (a reward that is not finite) leaves the results whole beside it."""
    pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    from prorl_cli.cli.application import App
    from prorl_cli.cli.sample import write_groups
    from prorl_cli.protocol import JobResult
    from prorl_cli.training.sampler import Group, StepBatch, StepStats

    traj = {"calls": [{"prompt_ids": [1, 2], "output_ids": [3], "logprobs": [-0.5], "finish_reason": "stop"}],
            "sequence_ids": [1, 2, 3], "loss_mask": [0, 0, 1], "logprobs": [0.0, 0.0, -0.5]}

    def batch(*rewards: float, with_trajectory: tuple[bool, ...]) -> StepBatch:
        results = [JobResult(job_id=f"r-s0-p0-k{k}", task="partial", state="done", reward=reward,
                             output={"trajectory": traj} if has else {})
                   for k, (reward, has) in enumerate(zip(rewards, with_trajectory, strict=True))]
        return StepBatch(0, 0, [Group("r-s0-p0", "0", {}, 0, 0, results)], StepStats(step=0, policy_version=0))

    app = App(None, {"deployment": "d1"})
    out = tmp_path / "s.parquet"
    assert write_groups(app, [batch(1.0, 0.0, with_trajectory=(True, False))], out) == (out, None)
    assert [row["rollout_id"] for row in pq.read_table(out).to_pylist()] == ["r-s0-p0-k0"]
    assert f"note: 1 of 2 job(s) recorded no trajectory (or no reward) and have no sample in {out}" in capsys.readouterr().err
    bad = tmp_path / "bad.parquet"
    written, problem = write_groups(app, [batch(float("inf"), 0.0, with_trajectory=(True, True))], bad)
    assert written == tmp_path / "bad.jsonl" and not bad.exists()
    assert problem is not None and "SampleError" in problem and "not finite" in problem, problem
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert [(row["job_id"], row["group_id"], row["step"]) for row in rows] == [
        ("r-s0-p0-k0", "r-s0-p0", 0), ("r-s0-p0-k1", "r-s0-p0", 0)]


def test_a_parquet_out_counts_the_jobs_it_has_no_row_for(deployment: Deployment, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    with_traj = write_tasks(tmp_path / "p.jsonl", [{"end": "done"}])
    without = write_tasks(tmp_path / "t.jsonl", [{"echo": 1}])
    assert prorl(deployment, "submit", "-d", deployment.name, str(with_traj), "--task", "partial", "--id-prefix",
                 "mixp").returncode == 0
    assert prorl(deployment, "submit", "-d", deployment.name, str(without), "--task", "test", "--id-prefix",
                 "mixt").returncode == 0
    out = tmp_path / "mix.parquet"
    r = prorl(deployment, "results", "-d", deployment.name, "mixp-0-0", "mixt-0-0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert [row["job_id"] for row in pq.read_table(out).to_pylist()] == ["mixp-0-0"]
    assert (f"note: 1 of 2 job(s) recorded no trajectory and are not in {out} (a Parquet row is a trajectory); "
            f"`prorl results -d jobs mixp-0-0 mixt-0-0 --out FILE.jsonl` collects their whole results") in r.stderr


def test_a_parquet_out_says_which_jobs_held_several_conversations(deployment: Deployment, tmp_path: Path) -> None:
    """A job with sub-agents has a token buffer per conversation; a Parquet row's token columns hold one of them."""
    pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    tasks = write_tasks(tmp_path / "c.jsonl", [{"end": "done"}, {"end": "done", "sub_agent": True}])
    out = tmp_path / "conv.parquet"
    r = prorl(deployment, "submit", "-d", deployment.name, str(tasks), "--task", "partial", "--id-prefix", "conv",
              "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = {row["job_id"]: row for row in pq.read_table(out).to_pylist()}
    assert (rows["conv-0-0"]["conversations"], rows["conv-1-0"]["conversations"]) == (1, 2)
    assert rows["conv-1-0"]["n_calls"] == 2
    assert f"note: 1 job(s) in {out} held several conversations" in r.stderr, r.stderr


def test_a_stopped_collection_keeps_what_it_took_when_it_has_no_trajectory(tmp_path: Path) -> None:
    """Ctrl-C in `submit/results --out X.parquet` before any job with a trajectory ended: the results taken are
    written whole beside it all the same, and a warning says where (the command ends with the interruption)."""
    from prorl_cli.cli.application import App
    from prorl_cli.cli.jobs.collect import ResultFile
    from prorl_cli.protocol import JobResult

    out = tmp_path / "r.parquet"
    sink = ResultFile(App(None, {"deployment": "d1"}), out, selection=("--prefix", "p"))
    sink.add(JobResult(job_id="p-0-0", task="test", state="cancelled", output={"stages": ["init"]}))
    sink.close(partial=True)
    assert not out.exists() and sink.written == tmp_path / "r.jsonl"
    assert [json.loads(line)["job_id"] for line in (tmp_path / "r.jsonl").read_text().splitlines()] == ["p-0-0"]
    assert sink.problem is not None and "`prorl results -d d1 --prefix p --out FILE` collects them again" in sink.problem
    # Stopped before any result: nothing to keep, nothing said.
    empty = ResultFile(App(None, {"deployment": "d1"}), tmp_path / "e.parquet")
    empty.close(partial=True)
    assert empty.problem is None and empty.written is None and not (tmp_path / "e.jsonl").exists()


def test_a_trajectory_that_does_not_read_back_leaves_the_results_as_jsonl(tmp_path: Path) -> None:
    """A handler's trajectory the Parquet writer cannot take (here a field Trajectory does not have): the results
    are kept whole beside the file, and the problem names the error, instead of a traceback and nothing."""
    from prorl_cli.cli.application import App
    from prorl_cli.cli.jobs.collect import ResultFile
    from prorl_cli.protocol import JobResult

    out = tmp_path / "r.parquet"
    sink = ResultFile(App(None, {"deployment": "d1"}), out, selection=("--prefix", "p"))
    sink.add(JobResult(job_id="p-0-0", task="test", state="done", output={"trajectory": {"not_a_field": 1}}))
    sink.close()
    assert not out.exists() and sink.written == tmp_path / "r.jsonl"
    assert [json.loads(line)["job_id"] for line in (tmp_path / "r.jsonl").read_text().splitlines()] == ["p-0-0"]
    assert sink.problem is not None and "TypeError" in sink.problem and "not_a_field" in sink.problem, sink.problem


def test_results_follow_collects_the_rest_after_the_submitter_was_killed(deployment: Deployment, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    tasks = write_tasks(tmp_path / "t.jsonl", [{"end": "done"}, {"end": "done"}, {"wait_for": str(gate)}, {"wait_for": str(gate)}])
    first = tmp_path / "first.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prorl_cli", "submit", "-d", deployment.name, str(tasks), "--task", "partial",
         "--id-prefix", "killed", "--out", str(first)],
        env=deployment.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deployment.wait_for(lambda st: first.exists() and len(first.read_text().splitlines()) == 2, 60,
                            "the two ungated jobs to be written")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no Ctrl-C handler runs: nothing is cancelled
        proc.wait(timeout=30)
    # Without --follow: the finished ones now, the rest counted.
    now = tmp_path / "now.jsonl"
    r = prorl(deployment, "results", "-d", deployment.name, "--prefix", "killed", "--out", str(now))
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(line)["job_id"] for line in now.read_text().splitlines()) == ["killed-0-0", "killed-1-0"]
    assert "2 job(s) not finished yet" in r.stdout
    # Its progress counts the jobs it leaves too (the two gated ones run), not the finished ones only.
    assert "not collected (--follow waits): running 2" in r.stderr, r.stderr
    gate.touch()
    out = tmp_path / "rest.jsonl"
    r = prorl(deployment, "results", "-d", deployment.name, "--prefix", "killed", "--follow", "--out", str(out))
    assert r.returncode == 0, r.stderr
    got = {json.loads(line)["job_id"]: json.loads(line)["state"] for line in out.read_text().splitlines()}
    assert got == {f"killed-{i}-0": "done" for i in range(4)}
    assert any(line.startswith("results: 4/4 ended (done 4)") for line in r.stderr.splitlines()), r.stderr
    # By group (one line's rollouts) and by id; unknown ids and empty selections are errors.
    r = prorl(deployment, "results", "-d", deployment.name, "--group", "killed-2")
    assert r.returncode == 0 and "1 job(s)" in r.stdout, r.stderr
    r = prorl(deployment, "results", "-d", deployment.name, "killed-3-0", "nope-0-0")
    assert r.returncode == 1 and "nope-0-0" in r.stderr
    r = prorl(deployment, "results", "-d", deployment.name, "--prefix", "never-submitted")
    assert r.returncode == 1 and "no job matches" in r.stderr


def test_results_of_known_and_unknown_ids_writes_the_known_and_names_the_unknown(
    deployment: Deployment, tmp_path: Path
) -> None:
    """`prorl results KNOWN UNKNOWN --out F`: a partial match is not "nothing matches". The known job's result is
    written and summed up, the unknown id is named in the one error line, and the exit status is the one --help
    gives for an unknown id."""
    tasks = write_tasks(tmp_path / "t.jsonl", [{"echo": 1}])
    assert prorl(deployment, "submit", "-d", deployment.name, str(tasks), "--task", "test", "--id-prefix",
                 "partly").returncode == 0
    out = tmp_path / "f.jsonl"
    r = prorl(deployment, "results", "-d", deployment.name, "partly-0-0", "nope-0-0", "--out", str(out))
    assert r.returncode == 1, r.stderr
    assert [json.loads(line)["job_id"] for line in out.read_text().splitlines()] == ["partly-0-0"]
    assert f"1 job(s); results in {out}" in r.stdout, r.stdout
    error = _error_line(r.stderr)
    assert "1 job id(s) the broker does not hold: nope-0-0" in error and "partly-0-0" not in error, error
    assert f"the other results are in {out}" in error, error
    helped = " ".join(prorl(deployment, "results", "--help").stdout.split())
    assert "when an id given is unknown (the others' results are written all the same)" in helped, helped
    # Nothing known at all: nothing matches, and nothing is written.
    none = tmp_path / "none.jsonl"
    r = prorl(deployment, "results", "-d", deployment.name, "nope-0-0", "nope-1-0", "--out", str(none))
    assert r.returncode == 1 and "no job matches ids nope-0-0 nope-1-0" in _error_line(r.stderr), r.stderr


def test_detach_then_cancel_by_group_prefix_and_all(deployment: Deployment, tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "t.jsonl", [{"hang_in": "run"}, {"hang_in": "run"}])
    r = prorl(deployment, "submit", "-d", deployment.name, str(tasks), "--task", "test", "-n", "2", "--detach")
    assert r.returncode == 0, r.stderr
    prefix = r.stdout.strip()
    assert prefix.startswith("sub-") and f"--prefix {prefix}" in r.stderr
    held = deployment.client.list_jobs(prefix=prefix)
    assert sorted(held) == [f"{prefix}-{i}-{k}" for i in range(2) for k in range(2)]
    r = prorl(deployment, "cancel", "-d", deployment.name, "--group", f"{prefix}-1")
    assert r.returncode == 0, r.stderr
    states = deployment.client.list_jobs(prefix=prefix)
    assert [states[f"{prefix}-1-{k}"] for k in range(2)] == ["cancelled", "cancelled"]
    assert all(states[f"{prefix}-0-{k}"] not in ("cancelled", "done", "failed", "timed_out") for k in range(2))
    r = prorl(deployment, "cancel", "-d", deployment.name, "--prefix", prefix)
    assert r.returncode == 0 and "cancelled 2 job(s)" in r.stdout, r.stderr
    r = prorl(deployment, "cancel", "-d", deployment.name, "--all")
    assert r.returncode == 0 and "no unfinished job" in r.stdout, r.stdout
    assert set(deployment.client.list_jobs(prefix=prefix).values()) == {"cancelled"}
    assert prorl(deployment, "cancel", "-d", deployment.name, "--all", "--prefix", prefix).returncode != 0


def test_list_jobs_checks_its_fields_and_pages(deployment: Deployment) -> None:
    with pytest.raises(RemoteError, match="prefix"):
        deployment.client.request(Op.LIST_JOBS, prefix=5)
    table = JobTable()
    for i in range(5):
        table.add(JobSpec(job_id=f"p-{i}", task="t", group_id="g" if i % 2 else None), b"")
    page, after = table.find("p-", None, limit=2)
    assert list(page) == ["p-0", "p-1"] and after is not None
    rest, end = table.find("p-", None, after=after, limit=10)
    assert list(rest) == ["p-2", "p-3", "p-4"] and end is None
    assert list(table.find(None, "g")[0]) == ["p-1", "p-3"]


def test_submit_with_the_deployment_from_the_environment(deployment: Deployment, tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "t.jsonl", [{"echo": 1}])
    r = prorl(deployment, "submit", str(tasks), "--task", "test", env={"PRORL_DEPLOYMENT": deployment.name})
    assert r.returncode == 0 and "1 job(s)" in r.stdout, r.stderr
    r = prorl(deployment, "status", "-d", "other", "--json", env={"PRORL_DEPLOYMENT": deployment.name})
    assert r.returncode == 1 and "'other'" in r.stderr, "-d wins over the environment"


NAMED_COMMANDS = [
    ["status", "--json"],
    ["cancel", "--all"],
    ["backends", "list"],
    ["config", "show"],
    ["results", "--prefix", "named-"],
]


@pytest.mark.parametrize("args", NAMED_COMMANDS, ids=[" ".join(a) for a in NAMED_COMMANDS])
def test_a_command_acts_on_the_deployment_named_by_d_or_the_environment(deployment: Deployment, args: list[str]) -> None:
    """The deployment named after the subcommand, before it, or by PRORL_DEPLOYMENT is the one acted on;
    a name that has no broker fails naming it (so the name was taken, not ignored)."""
    deployment.client.submit("test", [{"echo": 1}], job_ids=["named-0-0"])  # idempotent: one job for `results`
    env = {"PRORL_DEPLOYMENT": ""}
    for named in ([*args, "-d", deployment.name], ["-d", deployment.name, *args]):
        r = prorl(deployment, *named, env=env)
        assert r.returncode == 0, (named, r.stderr)
    assert prorl(deployment, *args, env={"PRORL_DEPLOYMENT": deployment.name}).returncode == 0
    if args[0] != "config":
        wrong = prorl(deployment, *args, "-d", "elsewhere", env=env)
        assert wrong.returncode == 1 and "elsewhere" in wrong.stderr, wrong.stderr
    clash = prorl(deployment, "-d", "one", *args, "-d", "two", env=env)
    assert clash.returncode != 0 and "different deployments" in clash.stderr


def test_a_prefix_selects_its_submission_only(deployment: Deployment, tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "t.jsonl", [{"echo": 1}])
    for prefix in ("pre1", "pre10"):
        assert prorl(deployment, "submit", "-d", deployment.name, str(tasks), "--task", "test", "--id-prefix", prefix).returncode == 0
    out = tmp_path / "pre1.jsonl"
    r = prorl(deployment, "results", "-d", deployment.name, "--prefix", "pre1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["job_id"] for line in out.read_text().splitlines()] == ["pre1-0-0"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "sighup"])
def test_ctrl_c_on_submit_cancels_and_writes_the_cancelled_jobs_partial_trajectories(
    deployment: Deployment, tmp_path: Path, signum: int
) -> None:
    """Ctrl-C, SIGTERM as Slurm sends it to a trainer's job (scancel, preemption, time limit), and SIGHUP (a
    dropped ssh session): the unfinished jobs are cancelled, not left running, and their partial trajectories
    written."""
    tasks = write_tasks(tmp_path / "t.jsonl", [{"end": "done"}, {"end": "hang"}, {"end": "hang"}])
    out = tmp_path / "out.jsonl"
    prefix = signal.Signals(signum).name.lower()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prorl_cli", "submit", "-d", deployment.name, str(tasks), "--task", "partial",
         "--id-prefix", prefix, "--out", str(out)],
        env=deployment.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        client = deployment.client
        deployment.wait_for(
            lambda st: out.exists() and len(out.read_text().splitlines()) == 1
            and sorted(client.list_jobs(prefix=prefix).values()) == ["done", "run", "run"],
            60, "the finished job written and the hanging ones running")
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=90)
    finally:
        kill_if_running(proc)
    said = {signal.SIGTERM: "error: terminated (SIGTERM)", signal.SIGHUP: "error: hung up (SIGHUP)"}.get(
        signal.Signals(signum), "error: interrupted (Ctrl-C)")
    assert proc.returncode == 128 + signum, err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [said], err
    # The interrupted read of the result stream unwound before the client's loop closed.
    assert "Exception ignored" not in err and "Event loop is closed" not in err, err
    rows = {(r := json.loads(line))["job_id"]: r for line in out.read_text().splitlines()}
    assert {k: v["state"] for k, v in rows.items()} == {f"{prefix}-0-0": "done", f"{prefix}-1-0": "cancelled",
                                                         f"{prefix}-2-0": "cancelled"}, err
    assert sorted(client.list_jobs(prefix=prefix).values()) == ["cancelled", "cancelled", "done"]
    if signum != signal.SIGINT:
        assert f"{said.removeprefix('error: ')}: cancelled 2 unfinished job(s)" in err
    for job_id in (f"{prefix}-1-0", f"{prefix}-2-0"):
        assert rows[job_id]["output"]["trajectory"]["sequence_ids"] == [1, 2, 3], rows[job_id]  # what it did so far
    assert f"took the 2 unfinished job(s)' results (the cancelled ones' partial trajectories), written to {out}" in err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_a_signal_on_sample_cancels_the_jobs_in_flight(deployment: Deployment, tmp_path: Path, signum: int) -> None:
    """A batch job's time limit (SIGTERM) or a dropped ssh session (SIGHUP) ends `prorl sample` as Ctrl-C does:
    its jobs in flight are cancelled, not left running for nobody."""
    tasks = write_tasks(tmp_path / "t.jsonl", [{"end": "hang"}])
    prefix = f"sample-{signal.Signals(signum).name.lower()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "prorl_cli", "sample", "-d", deployment.name, str(tasks), "--task", "partial",
         "--group-size", "2", "--target-groups", "1", "--id-prefix", prefix],
        env=deployment.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    client = deployment.client
    try:
        deployment.wait_for(lambda st: (states := list(client.list_jobs(prefix=f"{prefix}-").values()))
                            and all(s == "run" for s in states), 60, "the sampled jobs running")
        running = len(client.list_jobs(prefix=f"{prefix}-"))
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=90)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 128 + signum, err
    how = "terminated (SIGTERM)" if signum == signal.SIGTERM else "hung up (SIGHUP)"
    said = re.search(rf"{re.escape(how)}: cancelled (\d+) job\(s\) in flight", err)
    assert said is not None and int(said.group(1)) >= running >= 2, err  # it may have sent more since
    assert err.rstrip().splitlines()[-1] == f"error: {how}", err
    assert set(client.list_jobs(prefix=f"{prefix}-").values()) == {"cancelled"}
