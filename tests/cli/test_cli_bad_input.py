"""Bad input to the real ``prorl`` CLI: a non-zero exit and one ``error:`` line naming the problem, never a traceback.

Each row runs ``python -m prorl_cli`` in a subprocess. No row needs a
running broker, except the two-broker test at the end (two real brokers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from prorl_cli.rendezvous import read_rendezvous
from tests.harness import REPO, Deployment, fixed_port, kill_if_running


def run_prorl(home: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PRORL_HOME": str(home), "COLUMNS": "80"}  # 80: long errors must still be one line
    env.pop("PRORL_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "prorl_cli", *args], env=env, cwd=home.parent,
        capture_output=True, text=True, timeout=timeout_s,
    )


@dataclass
class Case:
    name: str
    #: ``prepare(home) -> CLI args`` (it may write files under ``home``).
    prepare: Callable[[Path], list[str]]
    #: Fragments the one error line must contain (``{home}`` is replaced).
    expect: tuple[str, ...]


def _silent_broker(home: Path) -> list[str]:
    """A rendezvous file naming a port where nothing answers (a broker that died without cleaning up)."""
    d = home / "ghost"
    d.mkdir(parents=True, exist_ok=True)
    port = fixed_port()
    (d / "broker.json").write_text(json.dumps({
        "address": f"tcp://127.0.0.1:{port}", "deployment": "ghost", "host": "h", "pid": 1, "started_at": 0.0,
    }))
    return ["-d", "ghost", "status"]


def _binary_tasks(home: Path) -> list[str]:
    path = home.parent / "tasks.bin"
    path.write_bytes(b'{"a": 1}\n\xff\xfe\x00\x01garbage\n')
    return ["submit", str(path), "--task", "test"]


def _out_in_missing_folder(home: Path) -> list[str]:
    path = home.parent / "tasks.jsonl"
    path.write_text('{"echo": 1}\n')
    return ["-d", "nobroker", "submit", str(path), "--task", "test", "--out", str(home.parent / "no" / "such" / "r.jsonl")]


def _submit_with(*options: str) -> Callable[[Path], list[str]]:
    """``submit`` of a good tasks file with these options (refused before any broker is asked)."""

    def prepare(home: Path) -> list[str]:
        path = home.parent / "tasks.jsonl"
        path.write_text('{"echo": 1}\n')
        return ["-d", "nobroker", "submit", str(path), "--task", "test", *options]

    return prepare


def _sampling_file(text: str) -> Callable[[Path], list[str]]:
    def prepare(home: Path) -> list[str]:
        f = home.parent / "sampling.yaml"
        f.write_text(text)
        return _submit_with("--sampling-file", str(f))(home)

    return prepare


def _home_is_a_file(home: Path) -> list[str]:
    f = home.parent / "home-file"
    f.write_text("not a folder")
    return ["--home", str(f), "status"]


def _port_in_use(home: Path) -> list[str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    _KEEP.append(s)
    return ["-d", "busyport", "serve", "broker", "--port", str(s.getsockname()[1])]


_KEEP: list[socket.socket] = []


def _file(name: str, content: bytes, *args: str) -> Callable[[Path], list[str]]:
    """Write ``content`` to ``name`` beside the home; the CLI args, ``{f}`` standing for its path, ``{d}`` its folder."""

    def prepare(home: Path) -> list[str]:
        path = home.parent / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        return [a.replace("{f}", str(path)).replace("{d}", str(path.parent)) for a in args]

    return prepare


_BAD_YAML = b"a: 1\nb: [2\n"  # the parser's message spans lines (with a source excerpt and a caret line)
_NOT_UTF8 = b"\xff\xfe\x00deployment: x\n"
_RESULTS = b'{"job_id": "a", "state": "done"}\n'

CASES = [
    Case("status-no-broker", lambda h: ["-d", "nodeploy", "status"], ("nodeploy", "rendezvous")),
    Case("stop-no-broker", lambda h: ["-d", "nodeploy", "stop"], ("nodeploy", "rendezvous")),
    Case("cancel-no-broker", lambda h: ["-d", "nodeploy", "cancel", "j1"], ("nodeploy", "rendezvous")),
    Case("backends-list-no-broker", lambda h: ["-d", "nodeploy", "backends", "list"], ("nodeploy", "rendezvous")),
    Case("backends-add-no-broker", lambda h: ["-d", "nodeploy", "backends", "add", "http://h:1/v1"], ("nodeploy",)),
    Case("backends-pause-no-broker", lambda h: ["-d", "nodeploy", "backends", "pause"], ("nodeploy",)),
    # `prorl serve broker & prorl serve node`: the broker may not have written its file yet; say how to wait.
    Case("node-before-its-broker", lambda h: ["-d", "nodeploy", "serve", "node"],
         ("no rendezvous file", "--wait-s 60 waits up to 60 s for it")),
    # The short ping's answer, not the 30 s request timeout's: a dead broker is reported in seconds.
    Case("unreachable-broker", _silent_broker, ("the broker at tcp://127.0.0.1:", "does not answer", "no reply within 3 s")),
    Case("binary-tasks-file", _binary_tasks, ("tasks.bin", "not a UTF-8 text file")),
    Case("out-into-missing-folder", _out_in_missing_folder, ("--out", "does not exist")),
    Case("sampling-not-json", _submit_with("--sampling", "{max_tokens: 5"), ("--sampling", "not valid JSON")),
    Case("sampling-not-an-object", _submit_with("--sampling", "[1, 2]"), ("--sampling", "must be a JSON object", "got list")),
    Case("sampling-unknown-field", _submit_with("--sampling", '{"max_token": 5}'), ("--sampling", "unknown field", "max_token")),
    Case("sampling-bad-value", _submit_with("--sampling", '{"top_p": 1.5}'), ("--sampling", "sampling.top_p", "must be in (0, 1]")),
    Case("sampling-and-file", _submit_with("--sampling", "{}", "--sampling-file", "/etc/hostname"), ("--sampling or --sampling-file",)),
    Case("sampling-file-bad-value", _sampling_file("max_tokens: many\n"), ("sampling.yaml", "sampling.max_tokens", "must be an integer")),
    Case("status-two-names", lambda h: ["-d", "one", "status", "two"], ("-d one", "DEPLOYMENT two", "different deployments")),
    Case("status-two-d-flags", lambda h: ["status", "-d", "one", "-d", "two"], ("-d one", "-d two", "different deployments")),
    Case("status-two-global-d-flags", lambda h: ["-d", "one", "-d", "two", "status"], ("-d one", "-d two", "different deployments")),
    Case("home-is-a-file", _home_is_a_file, ("home-file", "is a file")),
    Case("serve-broker-port-in-use", _port_in_use, ("cannot listen", "in use")),
    Case("serve-broker-bad-bind-host", lambda h: ["-d", "badhost", "serve", "broker", "--bind-host", "no-such-host.invalid"],
         ("cannot listen", "no-such-host.invalid")),
    # A multi-line message (YAML's) is joined onto the one error line: its position and its reason are on it.
    Case("config-not-yaml", _file("bad.yaml", _BAD_YAML, "--config", "{f}", "config", "show"),
         ("bad.yaml: not valid YAML", "line 2, column 4", "expected ',' or ']'")),
    Case("config-check-not-yaml", _file("bad.yaml", _BAD_YAML, "config", "check", "{f}"),
         ("bad.yaml: not valid YAML", "line 2, column 4", "expected ',' or ']'")),
    Case("deploy-file-not-yaml", _file("deploy.yaml", _BAD_YAML, "render-sbatch", "{f}", "--out", "sbatch"),
         ("deploy.yaml", "line 2, column 4", "expected ',' or ']'")),
    Case("config-not-utf8", _file("bin.yaml", _NOT_UTF8, "--config", "{f}", "config", "show"),
         ("bin.yaml", "not a UTF-8 text file")),
    Case("config-check-not-utf8", _file("bin.yaml", _NOT_UTF8, "config", "check", "{f}"), ("bin.yaml", "not a UTF-8 text file")),
    Case("tasks-parquet-that-is-not", _file("tasks.parquet", b"not parquet\n", "submit", "{f}", "--task", "test"),
         ("tasks.parquet", "Parquet")),
    Case("math-tasks-parquet-that-is-not", _file("tasks.parquet", b"not parquet\n", "submit", "{f}", "--task", "math"),
         ("tasks.parquet", "Parquet")),
    Case("eval-parquet-that-is-not", _file("swe.parquet", b"not parquet\n", "-d", "x", "eval", "{f}", "--task", "swe"),
         ("swe.parquet", "Parquet")),
    # eval runs the swe family only: another task is named as such before a row is read (not a missing instance_id).
    Case("eval-a-task-that-is-not-swe", _file("math.jsonl", b'{"problem": "1+1", "answer": "2"}\n', "-d", "x", "eval",
                                              "{f}", "--task", "math"),
         ("--task math: eval runs swe, swe_oracle or a subclass of swe", "'math' is", "not one", "`prorl submit -d x ")),
    Case("eval-a-task-that-is-not-swe-on-rows-that-are-not", _file("junk.parquet", b"not parquet\n", "-d", "x", "eval",
                                                                   "{f}", "--task", "code"),
         ("--task code: eval runs swe",)),
    # --engine none with a domain: the engine is the problem, whether torch is installed or not.
    Case("quickstart-engine-none-with-a-domain", lambda h: ["quickstart", "--task", "math", "--engine", "none", "--out",
                                                            "qs-none-math"],
         ("--engine none runs the scripted 'test' handler", "cannot run --task math", "drop --task math")),
    Case("quickstart-engine-sim-with-a-domain", lambda h: ["quickstart", "--task", "swe", "--engine", "sim", "--out",
                                                           "qs-sim-swe"],
         ("--engine sim runs", "cannot run --task swe")),
    Case("swe-validate-parquet-that-is-not", _file("swe.parquet", b"not parquet\n", "swe", "validate", "{f}"),
         ("swe.parquet", "Parquet")),
    Case("build-images-swe-parquet-that-is-not", _file("swe.parquet", b"not parquet\n", "build-images", "--swe", "{f}"),
         ("swe.parquet", "Parquet")),
    # A bridge that dies at start (no model there: a config.json without model_type; or no torch): its last log line.
    Case("quickstart-bridge-dies", _file("model/config.json", b"{}", "quickstart", "--engine", "transformers", "--model",
                                         "{d}", "--out", "qs"),
         ("gave up waiting for the transformers inference bridge", "its log ends")),
    # A model folder without a model is refused before a broker and a node are started for it.
    Case("quickstart-model-not-a-model", _file("nomodel/README", b"x", "quickstart", "--engine", "transformers", "--model",
                                               "{d}", "--out", "qs-nomodel"), ("--model", "no config.json")),
    Case("address-not-an-endpoint", lambda h: ["-d", "x", "status", "--address", "garbage"],
         ("--address garbage", "tcp://HOST:PORT")),
    Case("submit-address-without-port", _file("tasks.jsonl", b'{"echo": 1}\n', "submit", "{f}", "--task", "test",
                                              "--address", "tcp://127.0.0.1"), ("--address tcp://127.0.0.1",)),
    # The output file is checked before the (slow) work: a folder that does not exist is named, not a traceback.
    Case("report-html-into-missing-folder", _file("r.jsonl", _RESULTS, "report", "{f}", "--html", "no/such/r.html"),
         ("--html no/such/r.html", "does not exist")),
    # A folder to create under a file: the OS error names the path (for a non-root user, an unwritable folder too).
    Case("init-out-under-a-file", _file("a-file", b"x", "init", "--out", "{f}/sub"), ("a-file/sub", "Not a directory")),
    Case("render-sbatch-out-under-a-file",
         _file("a-file", b"x", "render-sbatch", str(REPO / "examples" / "deploy.yaml"), "--out", "{f}/sub"),
         ("a-file/sub", "Not a directory")),
    Case("trace-out-into-missing-folder", _file("r.jsonl", _RESULTS, "trace", "{f}", "-o", "no/such/t.json"),
         ("--out no/such/t.json", "does not exist")),
]


# Options click itself checks: its usage error (exit 2) names the option and the value.
USAGE_CASES = [
    Case("max-tokens-zero", _submit_with("--max-tokens", "0"), ("'--max-tokens'", "0 is not in the range")),
    Case("temperature-negative", _submit_with("--temperature", "-1"), ("'--temperature'", "-1.0 is not in the range")),
    Case("top-p-above-one", _submit_with("--top-p", "1.5"), ("'--top-p'", "1.5 is not in the range")),
    Case("seed-not-an-int", _submit_with("--seed", "abc"), ("'--seed'", "'abc' is not a valid integer")),
    # A wait of nan seconds never ended; a negative one was silently no wait.
    Case("node-wait-nan", lambda h: ["-d", "x", "serve", "node", "--wait-s", "nan"], ("'--wait-s'", "'nan' is not a finite")),
    Case("node-wait-negative", lambda h: ["-d", "x", "serve", "node", "--wait-s", "-1"], ("'--wait-s'", "'-1' is not a finite")),
]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    h = tmp_path_factory.mktemp("badcli") / "home"
    h.mkdir()
    yield h
    for s in _KEEP:
        s.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_line_error(case: Case, home: Path) -> None:
    args = case.prepare(home)
    r = run_prorl(home, *args)
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for fragment in case.expect:
        assert fragment in errors[0], (fragment, r.stderr)


def test_a_second_broker_for_a_live_deployment_refuses_and_leaves_the_first_alone(tmp_path: Path) -> None:
    d = Deployment(tmp_path / "home", "twice")
    try:
        first = d.start_broker()
        before = read_rendezvous(d.deployment_dir)
        journal = d.deployment_dir / "broker.journal"
        r = subprocess.run(
            [sys.executable, "-m", "prorl_cli", "-d", "twice", "serve", "broker"],
            env=d.env(), cwd=d.home, capture_output=True, text=True, timeout=60,
        )
        assert r.returncode != 0
        assert "Traceback" not in r.stderr
        assert f"already has a live broker (pid {first.pid}" in r.stderr and before.address in r.stderr
        # The first broker's rendezvous file and journal are untouched, and it still answers.
        assert read_rendezvous(d.deployment_dir) == before
        assert journal.exists()
        assert d.client.ping()["boot_id"]
        # Once the first is gone (even by kill -9), a new broker starts.
        d.kill("broker")
        d.start_broker()
        assert read_rendezvous(d.deployment_dir).pid != first.pid
    finally:
        d.close()


def test_a_second_quickstart_in_a_busy_folder_is_refused_naming_it(tmp_path: Path) -> None:
    """The first quickstart holds its folder's lock for its whole life (here: this process, as it would)."""
    import fcntl

    from prorl_cli.cli.quickstart import QUICKSTART_LOCK

    out = tmp_path / "qs"
    out.mkdir()
    with open(out / QUICKSTART_LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")
        held.flush()
        r = subprocess.run([sys.executable, "-m", "prorl_cli", "quickstart", "--engine", "none", "--out", str(out)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"another quickstart is running in {out} (pid {os.getpid()})" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == [QUICKSTART_LOCK]  # nothing started, nothing written


@pytest.mark.parametrize("case", USAGE_CASES, ids=[c.name for c in USAGE_CASES])
def test_bad_option_values_get_clicks_usage_error(case: Case, home: Path) -> None:
    r = run_prorl(home, *case.prepare(home))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error: Invalid value")]
    assert len(errors) == 1, r.stderr
    for fragment in case.expect:
        assert fragment in errors[0], (fragment, r.stderr)


@pytest.mark.parametrize(("args", "expect"), [
    (["-d", "a/b"], "deployment: 'a/b' is not a valid deployment name"),
    (["--home", "{file}"], "is a file; PRORL_HOME (or --home) must name a folder"),
], ids=["bad-name", "home-is-a-file"])
def test_init_refuses_a_users_mistake_before_writing_anything(tmp_path: Path, args: list[str], expect: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    out = tmp_path / "out"
    r = run_prorl(home, *[str(a_file) if a == "{file}" else a for a in args], "init", "--slurm", "--out", str(out))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "prorl bug" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0], r.stderr
    assert not out.exists() or not any(out.iterdir()), "init wrote files it then called broken"


@pytest.mark.parametrize("torch", ["installed", "missing"])
def test_quickstart_says_why_a_domain_has_no_model(tmp_path: Path, torch: str) -> None:
    """--engine none asked for is named as the problem (not torch, which may be installed); torch missing under
    --engine auto is named as such. Both before anything starts."""
    if torch == "installed" and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here (the cpu extra)")
    # This Python without torch: an import system entry of None hides an installed module from find_spec.
    hide = "sys.modules['torch'] = None; " if torch == "missing" else ""
    script = f"import runpy, sys; {hide}sys.argv = ['prorl', *sys.argv[1:]]; runpy.run_module('prorl_cli', run_name='__main__')"
    env = {**os.environ, "PRORL_HOME": str(tmp_path / "home")}
    env.pop("PRORL_CONFIG", None)

    def error(*args: str) -> str:
        r = subprocess.run([sys.executable, "-c", script, "quickstart", "--out", str(tmp_path / "qs"), *args],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        (line,) = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        return line

    none = error("--task", "math", "--engine", "none")
    assert "--engine none runs the scripted 'test' handler, without a model, and cannot run --task math" in none
    if torch == "installed":
        assert "cpu extra" not in none and "drop --engine (auto picks transformers: torch is installed)" in none, none
    else:
        assert "with the cpu extra (torch) installed" in none, none
        auto = error("--task", "math")
        assert "torch is not installed here" in auto and "pip install 'prorl[cpu]'" in auto, auto
        assert "--engine none" not in auto, auto
    assert not (tmp_path / "qs").exists(), "refused before anything started"


def test_ctrl_c_in_quickstart_ends_in_one_line_and_leaves_no_process(tmp_path: Path) -> None:
    import psutil

    env = {**os.environ, "PRORL_HOME": str(tmp_path / "home")}
    env.pop("PRORL_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prorl_cli", "quickstart", "--engine", "none", "--out", str(tmp_path / "qs")],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    children: list[psutil.Process] = []
    try:
        assert proc.stdout is not None
        seen = ""
        while "broker up" not in seen:  # the broker runs: quickstart has a child to stop
            line = proc.stdout.readline()
            assert line, f"quickstart ended before its broker was up: {proc.wait(60)}, {proc.stderr.read() if proc.stderr else ''}"
            seen += line
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the broker is a child of quickstart"
        os.kill(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends (the children run in their own sessions)
        _, err = proc.communicate(timeout=90)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Aborted!" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: interrupted (Ctrl-C)"], err
    # quickstart's own cleanup waited for what it started: nothing is left running. A grandchild its child
    # stopped may still be in its last instant of exit on a loaded machine (no command line, not yet a
    # zombie): its exit is awaited, not guessed; one that does not exit fails the test.
    left = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    _, alive = psutil.wait_procs(left, timeout=30)
    assert not alive, [(c.pid, c.status()) for c in alive]


def test_a_ctrl_c_handled_inside_a_string_exec_still_ends_with_the_commands_code(tmp_path: Path) -> None:
    """A Ctrl-C can land while ``dataclasses`` builds a class's methods by a string ``exec`` (a lazy import in a
    command: launch's live view imports ``rich.table`` so). CPython then marks the process to die of SIGINT at
    exit under ``python -m``, though the command handled the interrupt: the exit must be the command's 130."""
    (tmp_path / "ctrl_c_in_exec.py").write_text(
        "import click\n"
        "from prorl_cli.cli import cli, main\n"
        "@cli.command('ctrl-c-in-exec')\n"
        "def ctrl_c_in_exec():\n"
        "    try:\n"
        "        exec('raise KeyboardInterrupt', {})  # where the interrupt lands, as in dataclasses' _create_fn\n"
        "    except KeyboardInterrupt:\n"
        "        click.echo('error: interrupted', err=True)\n"
        "        raise click.exceptions.Exit(130) from None\n"
        "main()\n"
    )
    env = {**os.environ, "PRORL_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-m", "ctrl_c_in_exec", "ctrl-c-in-exec"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 130, (out.returncode, out.stderr)
    assert out.stderr.strip() == "error: interrupted", out.stderr


def test_the_live_line_of_sample_ends_its_line_off_a_terminal() -> None:
    """Piped to a file, the error that follows ``prorl sample``'s live line starts a line of its own."""
    import io

    from rich.console import Console
    from rich.text import Text

    from prorl_cli.cli.application import App
    from prorl_cli.cli.sample import live_line

    app = App(None, {})
    buf = io.StringIO()
    app.err_console = Console(file=buf, highlight=False)  # not a terminal, as when stderr goes to a log file
    with live_line(app) as live:
        live.update(Text("step 0: informative 0/1"))
    app.err_console.print("error: dynamic sampling failed")
    assert buf.getvalue().splitlines()[-2:] == ["step 0: informative 0/1", "error: dynamic sampling failed"], buf.getvalue()


def _prorl_in(folder: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``prorl ARGS`` run in ``folder`` (its ./prorl.yaml, if any, is read), none of the suite's PRORL_* set."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    return subprocess.run([sys.executable, "-m", "prorl_cli", *args], cwd=folder, capture_output=True, text=True,
                          timeout=60, env={**clean, "PRORL_HOME": str(folder / "home"), "COLUMNS": "80", **(env or {})})


def _one_error(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_log_level_is_checked_wherever_it_is_given_and_kept_upper_case(tmp_path: Path) -> None:
    (tmp_path / "ll.yaml").write_text("log_level: verbose\n")
    error = _one_error(_prorl_in(tmp_path, "config", "check", "ll.yaml"))
    assert ("ll.yaml: log_level: expected one of ['DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL'] (any case; WARN and "
            "FATAL too), got 'verbose'") in error
    error = _one_error(_prorl_in(tmp_path, "config", "show", env={"PRORL_LOG_LEVEL": "verbose"}))
    assert "$PRORL_LOG_LEVEL: log_level: expected one of" in error and "got 'verbose'" in error
    (tmp_path / "lw.yaml").write_text("log_level: warning\n")
    for args, env, level in [(["--config", "lw.yaml"], {}, "WARNING"), ([], {"PRORL_LOG_LEVEL": "debug"}, "DEBUG"),
                             (["--log-level", "error"], {}, "ERROR"),
                             # logging's other names, which worked before the level was checked, go on working
                             ([], {"PRORL_LOG_LEVEL": "WARN"}, "WARNING"), ([], {"PRORL_LOG_LEVEL": "critical"}, "CRITICAL"),
                             ([], {"PRORL_LOG_LEVEL": "fatal"}, "CRITICAL")]:
        r = _prorl_in(tmp_path, *args, "config", "show", env=env)
        assert r.returncode == 0, r.stderr
        assert yaml_log_level(r.stdout) == level, (args, env, r.stdout)


def yaml_log_level(shown: str) -> str:
    import yaml

    return str(yaml.safe_load(shown.split("\n---\n")[0])["log_level"])


@pytest.mark.parametrize(("args", "env", "blamed"), [
    (["status", "-d", "a/b"], {}, "-d: deployment: 'a/b'"),
    (["-d", "a/b", "status"], {}, "-d: deployment: 'a/b'"),
    (["status", "a/b"], {}, "the DEPLOYMENT argument: deployment: 'a/b'"),
    (["status"], {"PRORL_DEPLOYMENT": "x y/z"}, "$PRORL_DEPLOYMENT: deployment: 'x y/z'"),
], ids=["d-after", "d-before", "positional", "env"])
@pytest.mark.parametrize("with_file", [True, False], ids=["prorl.yaml", "no-file"])
def test_a_bad_deployment_name_is_blamed_on_where_it_was_given(
        tmp_path: Path, args: list[str], env: dict[str, str], blamed: str, with_file: bool) -> None:
    if with_file:
        (tmp_path / "prorl.yaml").write_text("deployment: fine\n")
    error = _one_error(_prorl_in(tmp_path, *args, env=env))
    assert f"config error: {blamed} is not a valid deployment name" in error, error
    (tmp_path / "prorl.yaml").write_text("deployment: a/b\n")
    error = _one_error(_prorl_in(tmp_path, "status"))
    assert "config error: prorl.yaml: deployment: 'a/b' is not a valid deployment name" in error, error


def test_config_check_validates_a_deploy_file_as_one(tmp_path: Path) -> None:
    r = _prorl_in(tmp_path, "init", "--slurm", "-d", "myrun")
    assert r.returncode == 0, r.stderr
    r = _prorl_in(tmp_path, "config", "check", "deploy.yaml")
    assert r.returncode == 0, r.stderr
    assert "deploy.yaml: ok (a deploy file; `prorl launch deploy.yaml --dry-run` shows what it would submit)" in r.stdout
    assert _prorl_in(tmp_path, "config", "check", "prorl.yaml").stdout == "prorl.yaml: ok\n"
    # Checked as `prorl launch` checks it: its own keys, and the prorl.yaml it names.
    text = (tmp_path / "deploy.yaml").read_text()
    assert "\n  cpus_per_task: 2\n" in text
    (tmp_path / "bad-role.yaml").write_text(text.replace("\n  cpus_per_task: 2\n", "\n  cpus_per_task: many\n", 1))
    error = _one_error(_prorl_in(tmp_path, "config", "check", "bad-role.yaml"))
    assert "bad-role.yaml: nodes.cpus_per_task: expected int" in error, error
    with (tmp_path / "prorl.yaml").open("a") as f:
        f.write("log_level: verbose\n")
    error = _one_error(_prorl_in(tmp_path, "config", "check", "deploy.yaml"))
    assert f"{tmp_path / 'prorl.yaml'}: log_level: expected one of" in error, error
