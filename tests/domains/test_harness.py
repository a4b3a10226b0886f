"""The ``harness`` task: an agent program, unmodified, in an Apptainer sandbox with no network, talking to
the job's gateway; every model call goes node -> broker -> scripted model bridge and back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prorl_cli.agent import Trajectory
from prorl_cli.training.samples import build_samples
from tests.domains.conftest import ScriptedStack, turn
from tests.fakes.agents import AGENT

COMPUTE = ("bash", {"command": "python3 -c 'print(2+3)'"})


def _instance(tag: str, image: str, **settings: Any) -> dict[str, Any]:
    return {"problem": f"[{tag}] What is 2+3?", "answer": "5",
            "settings": {"image": image, "command": AGENT, "scorer": "math", "poll_s": 0.2, **settings}}


def test_harness_runs_an_unmodified_agent_in_the_sandbox(stack: ScriptedStack, domain_image: str) -> None:
    stack.add("[H-ok]", turn("", COMPUTE), "The answer is \\boxed{5}.")
    stack.add("[H-fail]", turn("", COMPUTE), "I give up.")
    stack.add("[H-hang]", turn("", ("bash", {"command": "sleep 600"})), "never reached")
    stack.start_model()
    ok, fail, hang = stack.run("harness", [
        _instance("H-ok", domain_image),
        _instance("H-fail", domain_image, env={"AGENT_EXIT": "3"}),
        _instance("H-hang", domain_image, timeout_s=4.0),
    ], timeout_s=300)

    assert ok.state == "done" and ok.reward == 1.0, ok
    out = ok.output
    assert out["stop_reason"] == "stop" and out["harness_exit_code"] == 0
    assert "ran: python3 -c 'print(2+3)' -> 5" in out["harness_log"]  # the harness's own command ran inside
    assert out["continuity"] == 1.0 and out["segments"] == 1
    traj = Trajectory.from_dict(out["trajectory"])
    assert len(traj.calls) == 2 and traj.token_exact and traj.stop_reason == "stop"
    assert traj.calls[0].backend_id == "scripted"
    samples, report = build_samples(out["trajectory"], rollout_id=ok.job_id, group_id="g", reward=1.0)
    assert len(samples) == 1 and report.merge_ratio == 1.0

    assert fail.reward == 0.0 and fail.output["stop_reason"] == "error" and fail.output["harness_exit_code"] == 3
    assert len(fail.output["trajectory"]["calls"]) == 2  # the partial trajectory is kept
    assert fail.state == "done" and fail.output["trajectory"]["error"]["type"] == "HarnessExited", fail

    assert hang.reward == 0.0 and hang.output["stop_reason"] == "timeout"
    assert hang.output["harness_exit_code"] is None
    assert len(hang.output["trajectory"]["calls"]) == 1 and "ran:" not in hang.output["harness_log"]


def test_a_cancelled_harness_is_killed(stack: ScriptedStack, domain_image: str) -> None:
    import os
    import time

    def sleepers() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"613"]:
                    found.append(pid)
            except OSError:
                continue  # it ended while we looked
        return found

    stack.add("[H-cancel]", turn("", ("bash", {"command": "sleep 613"})), "never reached")
    stack.start_model()
    client = stack.d.client
    (job_id,) = client.submit("harness", [_instance("H-cancel", domain_image)], timeout_s=120)
    node_log = stack.d.logs / "n1.log"
    deadline = time.monotonic() + 120
    # The harness streams its output to the job log: its first turn is printed before the tool runs.
    while f"job {job_id} harness| assistant:" not in node_log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the harness never reported its first model turn"
        time.sleep(0.1)
    while not sleepers():  # the harness's tool command, running inside the sandbox
        assert time.monotonic() < deadline, "the harness's tool command never started"
        time.sleep(0.1)
    client.cancel([job_id])
    (result,) = client.wait([job_id], timeout_s=120)
    assert result.state == "cancelled", result
    assert result.reward is None, result  # no EVAL after a cancel: nothing is scored (docs/harness.md)
    # The broker answers the cancel at once; the node then kills the harness's process group and the sandbox.
    deadline = time.monotonic() + 60
    while sleepers():
        assert time.monotonic() < deadline, f"the harness's processes {sleepers()} outlived the cancelled job"
        time.sleep(0.1)


def _command(tag: str, image: str, command: str, **settings: Any) -> dict[str, Any]:
    """An instance whose harness is ``command`` itself (it never calls the model)."""
    return {"task": f"[{tag}] no model call", "settings": {"image": image, "command": command, "scorer": "none",
                                                           "poll_s": 0.2, **settings}}


def test_a_command_that_ends_its_own_shell_reports_its_exit_code(stack: ScriptedStack, domain_image: str) -> None:
    # `exit`, `exec` and `set -e` end the shell running the command; the exit code is recorded all the same.
    # A regression would wait out timeout_s and report "timeout", so it is short enough to fail, not hang.
    exited, execd, errexit, cd_failed = stack.run("harness", [
        _command("H-exit", domain_image, "echo about to fail; exit 3", timeout_s=60.0),
        _command("H-exec", domain_image, "exec python3 -c 'print(\"exec ok\")'", timeout_s=60.0),
        _command("H-set-e", domain_image, "set -e; echo before; false; echo never", timeout_s=60.0),
        _command("H-cd", domain_image, "cd /no/such/dir || exit 97; echo never", timeout_s=60.0),
    ], timeout_s=300)

    assert exited.output["stop_reason"] == "error" and exited.output["harness_exit_code"] == 3, exited
    assert "about to fail" in exited.output["harness_log"]
    assert execd.output["stop_reason"] == "stop" and execd.output["harness_exit_code"] == 0, execd
    assert "exec ok" in execd.output["harness_log"]
    assert errexit.output["stop_reason"] == "error" and errexit.output["harness_exit_code"] == 1, errexit
    assert "before" in errexit.output["harness_log"] and "never" not in errexit.output["harness_log"]
    assert cd_failed.output["stop_reason"] == "error" and cd_failed.output["harness_exit_code"] == 97, cd_failed
    for result in (exited, execd, errexit, cd_failed):
        assert result.state == "done" and result.reward == 0.0, result  # scored all the same (scorer: none)
    assert execd.output["harness_error"] is None and execd.output["trajectory"]["error"] is None, execd
    # A non-zero exit is the agent's error, named in the result as ctx.agent() names the error that ended it.
    for result, said in ((exited, "the harness exited with code 3; its last line of output: 'about to fail'"),
                         (errexit, "the harness exited with code 1; its last line of output: 'before'"),
                         (cd_failed, "the harness exited with code 97; its last line of output: ")):  # sh's words
        assert result.output["harness_error"].startswith(said), result.output["harness_error"]
        error = result.output["trajectory"]["error"]
        assert error == {"call": 0, "type": "HarnessExited", "message": result.output["harness_error"]}, error


def test_prorl_submit_tells_a_harness_that_exited_non_zero_from_a_clean_run(
    stack: ScriptedStack, domain_image: str, tmp_path: Path
) -> None:
    """Both jobs end done and are scored; the summary lists the one whose agent exited non-zero, and why."""
    import json
    import subprocess
    import sys

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(i) + "\n" for i in (
        _command("H-sum-ok", domain_image, "echo fine", timeout_s=60.0),
        _command("H-sum-crash", domain_image, "echo Traceback: boom; exit 3", timeout_s=60.0),
    )))
    out = tmp_path / "results.jsonl"
    r = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", stack.d.name, "submit", str(tasks), "--task",
                        "harness", "--id-prefix", "sum", "--out", str(out)],
                       env={**stack.d.env(), "COLUMNS": "200"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    by_tag = {row["output"]["harness_log"].split()[0]: row for row in map(json.loads, out.read_text().splitlines())}
    assert {row["state"] for row in by_tag.values()} == {"done"}, by_tag
    assert by_tag["Traceback:"]["output"]["harness_exit_code"] == 3
    lines = [line.strip() for line in r.stderr.splitlines()]
    heading = next((i for i, line in enumerate(lines) if line.startswith("done, but the agent ended in an error")), None)
    assert heading is not None, r.stderr
    crashed = by_tag["Traceback:"]["job_id"]
    assert lines[heading + 1] == (f"1 job(s) in run: HarnessExited: the harness exited with code 3; its last line "
                                  f"of output: 'Traceback: boom' (e.g. {crashed})"), r.stderr
    assert by_tag["fine"]["job_id"] not in r.stderr, r.stderr


def test_a_harness_whose_shell_is_killed_is_an_error(stack: ScriptedStack, domain_image: str) -> None:
    # The shell that would record the exit code is killed; what it started keeps running. The job ends as an
    # error naming that, rather than waiting for timeout_s (60 s: a regression reports "timeout").
    (result,) = stack.run("harness", [
        _command("H-vanish", domain_image, "echo killing my shell; kill -KILL $PPID; sleep 600", timeout_s=60.0),
    ], timeout_s=300)
    assert result.output["stop_reason"] == "error" and result.output["harness_exit_code"] is None, result
    assert "ended without recording an exit code" in result.output["harness_error"]
    assert result.output["trajectory"]["error"]["message"] == result.output["harness_error"]
    assert "killing my shell" in result.output["harness_log"]


def test_harness_output_past_node_log_lines_goes_to_the_job_log_only(
    stack: ScriptedStack, domain_image: str
) -> None:
    (result,) = stack.run("harness", [
        _command("H-chatty", domain_image, 'for i in $(seq 1 50); do echo "spam-$i-end"; done', node_log_lines=5),
    ], timeout_s=300)
    assert result.output["stop_reason"] == "stop", result
    job = f"job {result.job_id} harness"
    node_log = (stack.d.logs / "n1.log").read_text(errors="replace")
    assert f"{job}| spam-5-end" in node_log and f"{job}| spam-6-end" not in node_log
    assert f"{job}: 45 more line(s) of output after the first 5 went to the job log" in node_log
    assert result.log_path is not None
    job_log = Path(result.log_path).read_text()
    assert all(f"{job}| spam-{i}-end" in job_log for i in range(1, 51))


def test_harness_jobs_side_by_side_on_the_local_runtime_keep_their_own_files(tmp_path: Path, tiny_model: Path) -> None:
    """The local runtime has no private /tmp: each job gets a folder of its own there (task file, workdir,
    script, log, exit code), so jobs running at once neither read each other's task nor end each other, and
    the folder goes with the job."""
    from tests.harness import Deployment

    config = {"sandbox": {"runtime": "local", "local_dir": str(tmp_path / "sb")},
              "inference": {"tokenizer": str(tiny_model)}, "node": {"n_init": 4, "n_run": 4, "n_eval": 4}}
    # The first to start sleeps longest: with shared files the quickest job's exit code would end the others.
    command = "sleep $(cut -c2 {task_file}); cat {task_file}; echo; pwd"
    tags = [f"L{i}" for i in (3, 2, 1)]
    with Deployment(tmp_path / "home", "local", config=config) as d:
        d.start_broker()
        d.start_node("n1")
        ids = d.client.submit("harness", [
            {"task": f"{tag} job", "settings": {"image": "", "command": command, "scorer": "none", "poll_s": 0.1,
                                                "timeout_s": 60.0}} for tag in tags], timeout_s=120)
        results = d.client.wait(ids, timeout_s=180)
    roots = set()
    for tag, r in zip(tags, results, strict=True):
        assert r.state == "done" and r.output["harness_exit_code"] == 0, r.output.get("harness_log")
        log = r.output["harness_log"]
        assert f"{tag} job" in log and not any(f"{t} job" in log for t in tags if t != tag), log
        workdir = next((line for line in log.splitlines() if line.startswith("/tmp/prorl-harness-")), log)
        assert workdir.endswith("/work"), log
        roots.add(workdir.rpartition("/")[0])
    assert len(roots) == 3 and not any(Path(root).exists() for root in roots), roots


#: A user's own agent program (standard library only), copied in with the setting ``files``: it reads its task
#: from $PRORL_TASK_FILE, asks a planner and a summariser under the model names it was written with, imports a
#: helper module of its folder, and leaves its own verdict in its workdir for the scorer. With $HANG it hangs
#: instead, printing its stack on SIGTERM (where it hung, read by the node after the kill).
MAIN = r'''
import faulthandler, json, os, signal, sys, time, urllib.request
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
import helper

faulthandler.register(signal.SIGTERM, chain=True)
if os.environ.get("HANG"):
    def stuck_in_my_tool():
        print("waiting on my tool", flush=True)
        time.sleep(600)
    stuck_in_my_tool()
task = open(os.environ["PRORL_TASK_FILE"]).read()

def ask(model, system):
    body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": task}]}
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"]

answer = ask("gpt-4o", "You plan. [H-own-plan]")
summary = ask("gpt-4o-mini", "You summarise. [H-own-sum]")
print("task:", task, "| answer:", answer, "| summary:", summary, "| helper:", helper.GREETING, flush=True)
print("env:", os.environ["PRORL_WORKDIR"], os.getcwd(), os.environ["PRORL_JOB_ID"], flush=True)
json.dump({"reward": helper.verdict(answer)}, open("verdict.json", "w"))
'''

VERDICT_SCORER = '''
import json


def verdict(ctx, workspace):
    return json.loads((workspace / "verdict.json").read_text())["reward"]
'''


def _agent_folder(root: Path) -> Path:
    folder = root / "my-agent"
    (folder / "lib").mkdir(parents=True)
    (folder / "empty").mkdir()
    (folder / "main.py").write_text(MAIN)
    (folder / "lib" / "helper.py").write_text(
        "GREETING = 'hello from lib'\n\ndef verdict(answer):\n    return 1.0 if '5' in answer else 0.0\n")
    run = folder / "run.sh"
    run.write_text("#!/bin/sh\nls -d /opt/agent/empty && exec python3 /opt/agent/main.py\n")
    run.chmod(0o755)
    return folder


def test_a_users_own_program_copied_in_with_files(stack: ScriptedStack, domain_image: str, tmp_path: Path) -> None:
    """No image of its own: ``files`` copies the program's folder in (modes kept), ``$PRORL_TASK_FILE`` names the
    task (a verl-style row's last user message), ``model_aliases`` serves the names it was written with, its
    verdict becomes the reward; a hung one is killed past ``timeout_s`` with what it printed on SIGTERM kept."""
    (stack.d.home / "prorl_verdict_scorer.py").write_text(VERDICT_SCORER)
    folder = _agent_folder(tmp_path)
    stack.add("[H-own-plan]", "It is 5.")
    stack.add("[H-own-sum]", "Five.")
    stack.start_model()
    settings = {"image": domain_image, "command": "/opt/agent/run.sh", "files": {"/opt/agent": str(folder)},
                "model_aliases": ["gpt-4o", "gpt-4o-mini"], "scorer": "prorl_verdict_scorer:verdict",
                "poll_s": 0.2, "timeout_s": 60.0}
    verl_row = {"prompt": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "[H-own] What is 2+3?"}], "settings": settings}
    hang_row = {"task": "[H-own-hang] wait",
                "settings": {**settings, "env": {"HANG": "1"}, "timeout_s": 6.0, "scorer": "none"}}
    ok, hung = stack.run("harness", [verl_row, hang_row], timeout_s=300)

    assert ok.state == "done" and ok.reward == 1.0, ok.error or ok.output.get("harness_log")
    log = ok.output["harness_log"]
    assert "/opt/agent/empty" in log, log  # a folder's empty folder is copied too
    assert ("task: [H-own] What is 2+3? | answer: It is 5. | summary: Five. | helper: hello from lib") in log, log
    assert f"env: /work /work {ok.job_id}" in log, log
    assert len(ok.output["trajectory"]["calls"]) == 2 and ok.output["segments"] == 2

    assert hung.state == "done" and hung.output["stop_reason"] == "timeout", hung
    assert "waiting on my tool" in hung.output["harness_log"], hung.output["harness_log"]
    assert "in stuck_in_my_tool" in hung.output["harness_log"], hung.output["harness_log"]  # printed on SIGTERM


def test_files_are_refused_naming_the_entry_before_a_sandbox_starts(tmp_path: Path) -> None:
    import pytest

    from prorl_cli.exceptions import DomainError
    from prorl_cli.handlers.harness import _files_to_copy

    folder = _agent_folder(tmp_path)
    (folder / "link-to-main.py").symlink_to(folder / "main.py")
    copies = {target: (source.name, mode) for source, target, mode in _files_to_copy({"/opt/agent": str(folder)}, 1)}
    assert copies == {"/opt/agent/empty": ("empty", None), "/opt/agent/main.py": ("main.py", 0o644),
                      "/opt/agent/link-to-main.py": ("link-to-main.py", 0o644),
                      "/opt/agent/run.sh": ("run.sh", 0o755), "/opt/agent/lib/helper.py": ("helper.py", 0o644)}
    one = _files_to_copy({"/bin/agent.py": str(folder / "main.py")}, 1)
    assert [(target, mode) for _, target, mode in one] == [("/bin/agent.py", 0o644)]
    with pytest.raises(DomainError, match="both paths must be absolute"):
        _files_to_copy({"agent": str(folder)}, 1)
    with pytest.raises(DomainError, match="both paths must be absolute"):
        _files_to_copy({"/opt/agent": "my-agent"}, 1)
    with pytest.raises(DomainError, match=r"'/no/such/agent' \(for '/opt/agent'\) is not a file or folder on node"):
        _files_to_copy({"/opt/agent": "/no/such/agent"}, 1)
    with pytest.raises(DomainError, match=r"MiB to copy into the sandbox, over files_max_mb=1e-06"):
        _files_to_copy({"/opt/agent": str(folder)}, 1e-6)


def test_the_task_of_a_verl_style_row_is_its_last_user_message() -> None:
    from prorl_cli.handlers.harness import _chat_task

    assert _chat_task([{"role": "system", "content": "s"}, {"role": "user", "content": "first"},
                       {"role": "assistant", "content": "a"}, {"role": "user", "content": "last"}]) == "last"
    assert _chat_task([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]) \
        == "a\nb"
    assert _chat_task([{"role": "system", "content": "s"}]) is None
    assert _chat_task("text") is None
