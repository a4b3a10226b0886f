"""The ``prorl`` command line, run as real subprocesses against a real deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness import Deployment, one_node_deployment


def prorl(d: Deployment | None, *args: str, cwd: Path | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**(d.env() if d else dict(os.environ)), "COLUMNS": "200"}  # rich wraps tables at 80 otherwise
    prefix = ["-d", d.name] if d else []
    return subprocess.run(
        [sys.executable, "-m", "prorl_cli", *prefix, *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
    )


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    yield from one_node_deployment(tmp_path_factory, "cli")


def test_help_is_instant_and_lists_the_commands() -> None:
    out = subprocess.run([sys.executable, "-m", "prorl_cli", "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("serve", "submit", "status", "cancel", "stop", "backends", "quickstart", "build-images", "config"):
        assert cmd in out
    # Heavy libraries stay out of the CLI's import path.
    probe = "import sys, prorl_cli.cli; print(sorted(m for m in ('torch', 'transformers', 'spython') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_slurm_commands_without_their_argument_say_what_is_missing() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PRORL_DEPLOYMENT"}
    for args, missing in ((["launch"], "DEPLOY_FILE"), (["down"], "NAME"), (["scale", "--nodes", "1"], "NAME")):
        r = subprocess.run([sys.executable, "-m", "prorl_cli", *args], capture_output=True, text=True, env=env)
        assert r.returncode != 0
        assert missing in r.stderr


def test_submit_writes_results_and_a_summary(deployment: Deployment, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"echo": i}) for i in range(5)) + "\n\n")
    out = tmp_path / "out.jsonl"
    r = prorl(deployment, "submit", str(tasks), "--task", "test", "--n", "3", "--out", str(out), "--id-prefix", "cli")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 15
    assert {line["state"] for line in lines} == {"done"}
    assert sorted(line["job_id"] for line in lines) == sorted(f"cli-{i}-{k}" for i in range(5) for k in range(3))
    assert sorted(line["output"]["echo"] for line in lines) == sorted(list(range(5)) * 3)
    assert "summary" in r.stdout and "15 job(s)" in r.stdout
    assert "already exist" not in r.stderr
    # Resubmitting with the same prefix returns the same jobs instead of running them again, and says so: a
    # user who changed the seed under an old prefix would otherwise take the earlier rollouts for new ones.
    r2 = prorl(deployment, "submit", str(tasks), "--task", "test", "--n", "3", "--id-prefix", "cli", "--seed", "8")
    assert r2.returncode == 0
    assert deployment.client.status().jobs["done"] >= 15
    assert "note: 15 of 15 job id(s) under --id-prefix cli already exist at the broker" in r2.stderr, r2.stderr
    assert "give a new --id-prefix" in r2.stderr


def test_submit_names_jobs_by_their_row_in_the_file_with_bad_rows_left_out(deployment: Deployment, tmp_path: Path) -> None:
    # LINE counts the file's rows, the ones --skip-bad-rows left out included: once the bad row is mended, a
    # resubmission under the same prefix gives the other rows their own earlier jobs, not a neighbour's.
    tasks = tmp_path / "math.jsonl"
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "no answer"}, "not json", {"problem": "2+2?", "answer": "4"}]
    tasks.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    r = prorl(deployment, "submit", str(tasks), "--task", "math", "--skip-bad-rows", "--detach", "--id-prefix", "rows")
    assert r.returncode == 0, r.stderr
    known = deployment.client.cancel([f"rows-{line}-0" for line in range(4)])
    assert [state != "unknown" for state in known.values()] == [True, False, False, True], known


def test_submit_results_carry_each_rows_own_id(deployment: Deployment, tmp_path: Path) -> None:
    # Results join back to the dataset by the row's id.
    tasks = tmp_path / "ids.jsonl"
    rows = [{"id": "row-a", "echo": 0}, {"echo": 1}, {"instance_id": "astropy__astropy-12907", "echo": 2},
            {"id": 17, "echo": 3}, {"id": "x" * 300, "echo": 4}]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ids-out.jsonl"
    r = prorl(deployment, "submit", str(tasks), "--task", "test", "--n", "2", "--out", str(out), "--id-prefix", "ids")
    assert r.returncode == 0, r.stderr
    meta = {line["job_id"]: line.get("meta") for line in map(json.loads, out.read_text().splitlines())}
    assert meta == {f"ids-{i}-{k}": m for i, m in enumerate([{"id": "row-a"}, None, {"id": "astropy__astropy-12907"},
                                                             {"id": 17}, None]) for k in range(2)}


def test_submit_reports_bad_input_clearly(deployment: Deployment, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ok": 1}\n{not json\n')
    r = prorl(deployment, "submit", str(bad), "--task", "test")
    assert r.returncode != 0 and "bad.jsonl:2" in r.stderr
    good = tmp_path / "good.jsonl"
    good.write_text('{"echo": 1}\n')
    r = prorl(deployment, "submit", str(good), "--task", "nope")
    assert r.returncode != 0 and "unknown_task" in r.stderr and "nope" in r.stderr
    r = prorl(deployment, "submit", str(good), "--task", "test", "--out", str(tmp_path / "t.parquet"))
    assert r.returncode != 0 and "no job has a token-level 'trajectory'" in r.stderr
    assert (tmp_path / "t.jsonl").is_file(), "the results are kept (tests/cli/test_cli_jobs.py has the rest)"


def test_a_parquet_out_without_pyarrow_is_refused_before_anything_runs(deployment: Deployment, tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"echo": 1}\n')
    # This Python without pyarrow: an import system entry of None hides an installed module.
    without = ("import runpy, sys; sys.modules['pyarrow'] = None; sys.argv = ['prorl', *sys.argv[1:]]; "
               "runpy.run_module('prorl_cli', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", without, "-d", deployment.name, "submit", str(good), "--task", "test",
                        "--id-prefix", "noarrow", "--out", str(tmp_path / "t.parquet")],
                       env={**deployment.env(), "COLUMNS": "200"}, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Parquet export needs pyarrow" in r.stderr and "write .jsonl" in r.stderr, r.stderr
    assert deployment.client.list_jobs(prefix="noarrow") == {}, "nothing was submitted"


def test_submit_says_why_jobs_failed(deployment: Deployment, tmp_path: Path) -> None:
    tasks = tmp_path / "failing.jsonl"
    tasks.write_text("\n".join([json.dumps({"raise_in": "run"})] * 3 + [json.dumps({"raise_in": "init"}), "{}"]) + "\n")
    r = prorl(deployment, "submit", str(tasks), "--task", "test", "--id-prefix", "why")
    assert r.returncode == 0, r.stderr  # a failed job is a result
    lines = [line.strip() for line in r.stderr.splitlines()]
    assert "why jobs did not finish" in r.stderr, r.stderr
    run_group = next(line for line in lines if line.startswith("3 job(s) in run: RuntimeError"))
    assert "(e.g. why-" in run_group
    assert any(line.startswith("1 job(s) in init: RuntimeError") for line in lines), lines


def test_status_cancel_and_backends(deployment: Deployment) -> None:
    (job,) = deployment.client.submit("test", [{"hang_in": "run"}], timeout_s=60)
    deployment.wait_for(lambda st: st.jobs["run"] >= 1, 10, "job to run")
    r = prorl(deployment, "status", "--json")
    assert r.returncode == 0
    st = json.loads(r.stdout)
    assert st["nodes"][0]["node_id"] == "n1" and st["jobs"]["run"] >= 1
    assert "n1" in prorl(deployment, "status").stdout
    r = prorl(deployment, "cancel", job)
    assert r.returncode == 0 and f"{job}: cancelled" in r.stdout
    assert deployment.client.result(job, timeout_s=5).state == "cancelled"
    assert prorl(deployment, "cancel", "no-such-job").returncode != 0

    added = prorl(deployment, "backends", "add", "http://127.0.0.1:9/v1")
    assert added.returncode == 0 and "warning: http://127.0.0.1:9/v1 does not answer from here" in added.stderr
    # The way out names this deployment: pasted where another one is the default, it still acts on this one.
    assert "`prorl backends clear -d cli http://127.0.0.1:9/v1` takes it out" in added.stderr, added.stderr
    listed = prorl(deployment, "backends", "list").stdout
    assert "http://127.0.0.1:9/v1" in listed and "active" in listed
    assert prorl(deployment, "backends", "add", "ftp://nope").returncode != 0
    assert prorl(deployment, "backends", "pause").returncode == 0
    assert deployment.client.status().generation_paused
    assert prorl(deployment, "backends", "resume").returncode == 0
    r = prorl(deployment, "backends", "clear")
    assert r.returncode == 0 and "cleared 1" in r.stdout
    # A cleared HTTP backend no job uses is dropped.
    assert deployment.client.list_backends() == []


def test_a_printed_hint_pastes_into_another_shell_and_acts_on_the_same_deployment(deployment: Deployment) -> None:
    """`backends add`'s way out, given --home and a URL with shell characters: pasted into a shell whose
    PRORL_HOME and PRORL_DEPLOYMENT name nothing of this run, it clears that very backend."""
    import shlex

    url = "http://127.0.0.1:9/v1?a=1&b=2"
    env = {**deployment.env(), "COLUMNS": "200"}
    for name in ("PRORL_HOME", "PRORL_DEPLOYMENT"):
        env.pop(name)
    added = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", str(deployment.home), "backends", "add", url,
                            "-d", deployment.name], env=env, capture_output=True, text=True, timeout=120)
    assert added.returncode == 0, added.stderr
    hint = added.stderr.split("`")[1]
    assert hint == f"prorl --home {deployment.home} backends clear -d cli '{url}'", added.stderr
    other = {**env, "PRORL_HOME": str(deployment.home.parent / "elsewhere"), "PRORL_DEPLOYMENT": "default"}
    pasted = subprocess.run([sys.executable, "-m", "prorl_cli", *shlex.split(hint)[1:]], env=other,
                            capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0 and f"cleared 1 backend(s): {url}" in pasted.stdout, pasted.stderr
    assert deployment.client.list_backends() == []


def test_hints_name_the_deployment_and_home_quoted() -> None:
    from prorl_cli.cli.application import App
    from prorl_cli.cli.common import command_hint

    app = App(None, {"deployment": "run1", "home": "/data/my home"})
    assert command_hint(app, "results", "--prefix", "sub-1", "--out", "FILE") == \
        "prorl --home '/data/my home' results -d run1 --prefix sub-1 --out FILE"
    assert command_hint(app, "backends clear", "http://h:1/v1", address="tcp://h:5555") == \
        "prorl --home '/data/my home' backends clear -d run1 http://h:1/v1 --address tcp://h:5555"
    # A home from $PRORL_HOME is the shell's own: not repeated. A command that takes no deployment gets none.
    bare = App(None, {"deployment": "run1"})
    assert command_hint(bare, "stop") == "prorl stop -d run1"
    assert command_hint(bare, "launch", Path("a b/deploy.yaml"), "--dry-run", named=False) == \
        "prorl launch 'a b/deploy.yaml' --dry-run"


def test_submit_sends_the_sampling_options_with_every_job(deployment: Deployment, tmp_path: Path) -> None:
    from prorl_cli.protocol import derive_seed

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"echo": 1, "echo_sampling": true}\n{"echo": 2, "echo_sampling": true}\n')
    out = tmp_path / "out.jsonl"
    r = prorl(deployment, "submit", str(tasks), "--task", "test", "--n", "2", "--out", str(out), "--id-prefix", "samp",
              "--sampling", '{"max_tokens": 5, "top_k": 7}', "--max-tokens", "9", "--temperature", "0", "--seed", "3")
    assert r.returncode == 0, r.stderr
    results = {r["job_id"]: r for r in (json.loads(line) for line in out.read_text().splitlines())}
    assert sorted(results) == ["samp-0-0", "samp-0-1", "samp-1-0", "samp-1-1"]
    # What reached the handler of every job: the single options override the JSON's keys, and the seed
    # seeds the submission (rollout K of row LINE: derive_seed(seed, LINE x N + K)), so a row's rollouts differ.
    for line in (0, 1):
        for k in (0, 1):
            assert results[f"samp-{line}-{k}"]["output"]["sampling"] == \
                {"max_tokens": 9, "top_k": 7, "temperature": 0.0, "seed": derive_seed(3, 2 * line + k)}


def test_status_shows_the_sandbox_runtime_each_node_picked(deployment: Deployment) -> None:
    import logging

    from prorl_cli.config import load_config
    from prorl_cli.sandbox.manager import make_runtime

    sandbox = load_config(deployment.config_path).sandbox
    assert sandbox.runtime == "auto", "the harness leaves the default"
    picked = make_runtime(sandbox, logging.getLogger("test")).name  # the same choice, made here
    if os.environ.get("PRORL_REQUIRE_ALL") == "1":
        assert picked == "apptainer", "provisioned machines have a working Apptainer"
    st = json.loads(prorl(deployment, "status", "--json").stdout)
    assert [n["sandbox_runtime"] for n in st["nodes"] if n["node_id"] == "n1"] == [picked]
    table = prorl(deployment, "status").stdout
    row = next(line for line in table.splitlines() if " n1 " in line)
    assert "sandbox" in table and picked in row, table


def test_status_and_stop_take_the_deployment_as_an_argument(deployment: Deployment) -> None:
    env_home = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "status", deployment.name, "--json"],
        env={**deployment.env(), "COLUMNS": "200"}, capture_output=True, text=True, timeout=60,
    )
    assert env_home.returncode == 0, env_home.stderr
    assert json.loads(env_home.stdout)["deployment"] == deployment.name
    clash = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", "other", "status", deployment.name],
                           env=deployment.env(), capture_output=True, text=True, timeout=60)
    assert clash.returncode != 0 and "different deployments" in clash.stderr


def test_status_in_a_log_shows_long_node_ids_whole(tmp_path: Path) -> None:
    """Output to a file or a pipe (a Slurm job's log) without COLUMNS: rich's 80 columns cut a node id to
    "slurm-12…"; the id a user greps for or copies into `prorl logs` must come out whole."""
    node_id = "slurm-12345678-gpu-a100-rack12-host-0042-rank3"
    with Deployment(tmp_path / "home", "wide") as d:
        d.start_broker()
        d.start_node(node_id)
        d.wait_for(lambda st: any(n.node_id == node_id for n in st.nodes), 30, "the node to register")
        env = {k: v for k, v in d.env().items() if k != "COLUMNS"}
        r = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", d.name, "status"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert node_id in r.stdout, r.stdout


def test_commands_without_a_broker_say_so(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "nobroker")
    r = prorl(d, "status")
    assert r.returncode != 0 and "rendezvous" in r.stderr and "nobroker" in r.stderr


def test_a_broker_killed_outright_is_named_gone_with_the_way_back(tmp_path: Path) -> None:
    """kill -9 (the OOM killer) leaves broker.json behind: a command says the process is gone and how to go on;
    ``prorl stop``, one of the ways on, stops the deployment without its broker."""
    d = Deployment(tmp_path / "home", "killed")
    try:
        broker = d.start_broker()
        d.kill("broker")
        r = prorl(d, "status")
        assert r.returncode != 0
        assert f"its process (pid {broker.pid} on this host) is gone" in r.stderr, r.stderr
        assert "`prorl serve broker -d killed` starts it again" in r.stderr and "`prorl stop -d killed`" in r.stderr
        r = prorl(d, "stop")
        assert r.returncode == 0, r.stderr
        assert "its stop record is written" in " ".join(r.stdout.split()), r.stdout
    finally:
        d.close()


def test_config_show_and_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "prorl.yaml"
    cfg.write_text("node:\n  n_run: 3\n")
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "--config", str(cfg), "-d", "xyz", "config", "show"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "n_run: 3" in r.stdout and "deployment: xyz" in r.stdout
    cfg.write_text("node:\n  n_run: three\n")
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "--config", str(cfg), "config", "show"], capture_output=True, text=True)
    assert r.returncode != 0 and "node.n_run" in r.stderr and str(cfg) in r.stderr


def test_images_live_under_prorl_home_unless_the_config_says_where(tmp_path: Path) -> None:
    """A cluster user points PRORL_HOME at scratch space: the image cache (gigabytes) goes there too, not into a
    home folder under quota; an explicit images.cache_dir is kept."""
    home = tmp_path / "scratch home"
    env = {**os.environ, "PRORL_HOME": str(home)}
    env.pop("PRORL_CONFIG", None)
    show = [sys.executable, "-m", "prorl_cli", "config", "show"]
    r = subprocess.run(show, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["images"]["cache_dir"] == str(home / "images")
    (tmp_path / "prorl.yaml").write_text("images:\n  cache_dir: /shared/images\n")
    r = subprocess.run(show, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert yaml.safe_load(r.stdout)["images"]["cache_dir"] == "/shared/images"


def test_stop_command_stops_the_deployment(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "stopme")
    try:
        d.start_broker()
        d.start_node("n1")
        # `prorl stop NAME` is `prorl -d NAME stop`.
        r = subprocess.run([sys.executable, "-m", "prorl_cli", "stop", d.name], env=d.env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        for proc in d.procs.values():
            assert proc.wait(timeout=30) == 0
    finally:
        d.close()


def test_quickstart_without_llm_runs_end_to_end(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "quickstart", "--out", str(tmp_path / "qs"), "--engine", "none"],
        capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no LLM" in r.stdout
    summary = json.loads((tmp_path / "qs" / "summary.json").read_text())
    assert summary["states"] == {"done": 32, "failed": 2, "timed_out": 2}
    assert len((tmp_path / "qs" / "trajectories.jsonl").read_text().splitlines()) == 36
    assert not (tmp_path / "qs" / "quickstart" / "broker.json").exists()


@pytest.mark.timeout(900)  # the subprocess's own limit; a loaded machine needs more than the default 300 s
def test_quickstart_with_the_tiny_model_runs_a_real_agent(tmp_path: Path) -> None:
    """The README's main command: a real transformers model behind a real bridge."""
    pytest.importorskip("torch", reason="the cpu extra (torch) is not installed")
    r = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "quickstart", "--out", str(tmp_path / "qs"), "-n", "1"],
        capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "inference-0 registered (transformers engine" in r.stdout
    summary = json.loads((tmp_path / "qs" / "summary.json").read_text())
    assert summary["engine"] == "transformers" and summary["task"] == "math_agent"
    assert summary["states"] == {"done": 8}
    for line in (tmp_path / "qs" / "trajectories.jsonl").read_text().splitlines():
        traj = json.loads(line)["output"]["trajectory"]
        assert traj["calls"] and all(c["output_ids"] and len(c["logprobs"]) == len(c["output_ids"]) for c in traj["calls"])
        # Random weights: short loops (QUICK_SETTINGS), not the handler's 4 turns of 256 tokens.
        assert len(traj["calls"]) <= 2 and all(len(c["output_ids"]) <= 32 for c in traj["calls"])
    # The same trajectories as Parquet, in the flat shape trainers read.
    pq = pytest.importorskip("pyarrow.parquet", reason="the parquet extra (pyarrow) is not installed")
    table = pq.read_table(summary["parquet"]).to_pylist()
    assert summary["parquet_rows"] == len(table) == 8
    for row in table:
        assert len(row["sequence_ids"]) == len(row["loss_mask"]) == len(row["logprobs"]) > 0
        assert 0 < sum(row["loss_mask"]) < len(row["loss_mask"])  # model tokens and prompt tokens both present


def test_messages_are_not_broken_at_80_columns_when_output_is_a_pipe() -> None:
    """A Slurm job's log is a file: rich would wrap every line at 80 columns, breaking paths mid-name."""
    long_path = "/tmp/" + "x" * 120 + "/trajectories.jsonl"
    code = ("from prorl_cli.cli.application import App\n"
            f"app = App(None, {{}})\napp.console.print('results in {long_path}')\napp.err_console.print('see {long_path}')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": ""})
    assert out.returncode == 0, out.stderr
    assert f"results in {long_path}\n" == out.stdout and f"see {long_path}\n" == out.stderr


def test_a_quickstart_rerun_in_the_same_folder_replaces_the_earlier_results_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    out.mkdir()
    (out / "trajectories.parquet").write_bytes(b"an earlier model run's rows")  # --engine none writes no Parquet
    (out / "summary.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "quickstart", "--engine", "none", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"replacing an earlier run's results in {out}: trajectories.parquet, summary.json" in r.stdout
    assert not (out / "trajectories.parquet").exists()
    assert json.loads((out / "summary.json").read_text())["jobs"] > 0
