"""The files and the bash script of one EVAL test run inside the sandbox, and what its steps recorded.

Everything lives under :data:`WORK` in the sandbox: the node-id plugin and
its start-up hook (on ``PYTHONPATH`` and in a user site, see
``prorl_cli/swe/customize.py``), the test patch, the run script, and what
comes back (the log, the node-id records, the step records).

The run script is prorl's own bash; no instance text is part of its code.
Each step (the instance's ``eval_commands``, the ``install`` commands, then
the test command or eval script) is written to its own file by a quoted
here-document, checked with ``bash -n`` and run by a bash of its own, so a
step that is not shell (prose in an ``install`` field) fails alone, with its
own exit status, and cannot take the script down before the guard. Steps run
in the repository folder; the variables a step exports reach the steps after
it (``source .../activate`` in an install step holds for the tests). Each
step appends ``N start T``, then ``N end STATUS T`` (or ``N syntax 2 T``) to
:data:`STEPS`; a failing setup step ends the run, and the grader reports it
(:func:`read_steps`, ``prorl_cli/swe/grading.py``).
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from pathlib import Path

from prorl_cli.swe.testplan import TestPlan

#: swebench's markers around the test output (``swebench.harness.constants``).
START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
WORK = "/tmp/prorl-swe"
LOG = f"{WORK}/test.log"
NODEIDS = f"{WORK}/nodeids.jsonl"
STEPS = f"{WORK}/steps.txt"
RUN = f"{WORK}/run.sh"
TEST_PATCH = f"{WORK}/test.patch"
_HERE = Path(__file__).parent
#: Python versions whose user site gets the start-up hook (``lib/pythonX.Y/site-packages``).
PYTHON_VERSIONS = [f"3.{minor}" for minor in range(6, 16)]
SETUP, TESTS = "setup", "tests"
#: Step statuses: ran to exit 0, ran to another exit, refused by ``bash -n``, still running when the run was cut
#: at its time limit, still running when the run ended otherwise, never started.
OK, FAILED, SYNTAX, TIMEOUT, INTERRUPTED, NOT_RUN = "ok", "failed", "syntax", "timeout", "interrupted", "not_run"
#: How much of a step's own output a report keeps.
STEP_TAIL_CHARS = 2000


@dataclass(frozen=True)
class Step:
    """One step of the run: a name, where its text came from, setup or tests, and its bash text."""

    name: str  # "eval_commands[0]", "install[1]", "tests"
    source: str  # "instance install", "settings install", "instance eval_commands", the plan's test source
    kind: str  # SETUP or TESTS
    script: str


@dataclass(frozen=True)
class StepOutcome:
    """What one step did: its status, exit status, seconds and the tail of its own output."""

    name: str
    source: str
    kind: str
    status: str
    exit: int | None = None
    seconds: float | None = None
    log_tail: str = ""

    @property
    def failed_setup(self) -> bool:
        """A setup step that did not finish with exit 0, or any step ``bash -n`` refused."""
        return self.status == SYNTAX or (self.kind == SETUP and self.status in (FAILED, TIMEOUT, INTERRUPTED))


def support_files(work: str = WORK) -> dict[str, bytes]:
    """Sandbox path -> bytes: the plugin and its start-up hook, on ``PYTHONPATH`` and in every user site."""
    plugin = (_HERE / "pytest_nodeids.py").read_bytes()
    hook = (_HERE / "customize.py").read_bytes()
    files = {f"{work}/path/prorl_swe_nodeids.py": plugin, f"{work}/path/sitecustomize.py": hook}
    for version in PYTHON_VERSIONS:
        site = f"{work}/user/lib/python{version}/site-packages"
        files[f"{site}/prorl_swe_nodeids.py"] = plugin
        files[f"{site}/usercustomize.py"] = hook
    return files


def plan_steps(plan: TestPlan) -> list[Step]:
    """The steps of ``plan`` in order: the instance's eval commands, the install commands, the tests."""
    steps = [Step(f"eval_commands[{i}]", "instance eval_commands", SETUP, c) for i, c in enumerate(plan.eval_commands)]
    steps += [Step(f"install[{i}]", plan.install_source or "install", SETUP, c) for i, c in enumerate(plan.install)]
    steps.append(Step("tests", plan.source, TESTS, plan.script))
    return steps


#: Runs one step in a bash of its own: the variables earlier steps exported, then the step; it saves what the
#: step exported (bash's own read-only and per-process variables left out) for the next step.
_RUNNER = r"""prorl_env_file=$1
prorl_step_file=$2
shift 2
. "$prorl_env_file"
. "$prorl_step_file"
prorl_rc=$?
set +eux +o pipefail
prorl_ro='^declare -[a-zA-Z]*r[a-zA-Z]* '
prorl_own='^declare -[a-zA-Z]* (BASHOPTS|SHELLOPTS|BASH_[A-Za-z_]*|EUID|PPID|UID|SHLVL|PWD|OLDPWD|_)(=|$)'
export -p | while IFS= read -r prorl_line; do
  [[ $prorl_line =~ $prorl_ro || $prorl_line =~ $prorl_own ]] || printf '%s\n' "$prorl_line"
done > "$prorl_env_file.next"
exit $prorl_rc
"""

#: Checks, runs and records one step; returns the step's exit status (2 for a step ``bash -n`` refuses).
_STEP_FUNCTION = r"""prorl_now() { printf '%s' "${EPOCHREALTIME:-$SECONDS}"; }
prorl_record() { printf '%s\n' "$*" >> "$prorl_work/steps.txt"; }
prorl_step() {
  local n=$1 file="$prorl_work/steps/$1.sh" rc
  prorl_record "$n start $(prorl_now)"
  echo ">>>>> prorl step $n start"
  if ! bash -n "$file" > "$file.syntax" 2>&1; then
    cat "$file.syntax"
    rc=2
    prorl_record "$n syntax $rc $(prorl_now)"
  else
    bash --noprofile --norc "$prorl_work/step-runner.sh" "$prorl_work/env.sh" "$file"
    rc=$?
    if [ -f "$prorl_work/env.sh.next" ]; then mv -f "$prorl_work/env.sh.next" "$prorl_work/env.sh"; fi
    prorl_record "$n end $rc $(prorl_now)"
  fi
  echo ">>>>> prorl step $n exit $rc"
  return $rc
}
"""


def run_script(plan: TestPlan, repo_dir: str, work: str = WORK) -> str:
    """The bash of one run: write each step's file, then run the setup steps and the tests (see the module doc).

    A setup step that fails ends the run (nothing after it would be evidence); the test step's own
    exit status is echoed after swebench's end marker. The script applies no patch itself.
    """
    steps = plan_steps(plan)
    lines = [
        "#!/bin/bash",
        f"export PRORL_SWE_NODEIDS={shlex.quote(work)}/nodeids.jsonl",
        f'export PYTHONPATH={shlex.quote(work)}/path${{PYTHONPATH:+:$PYTHONPATH}}',
        f"export PYTHONUSERBASE={shlex.quote(work)}/user",
        *_plugin_functions(work),
        *(f"export {name}={shlex.quote(value)}" for name, value in plan.env.items()),
        f"prorl_work={shlex.quote(work)}",
        'mkdir -p "$prorl_work/steps"',
        ': > "$prorl_work/env.sh"',
        *_write_file('"$prorl_work/step-runner.sh"', _RUNNER),
    ]
    for n, step in enumerate(steps):
        lines += _write_file(f'"$prorl_work/steps/{n}.sh"', step.script)
    lines += [_STEP_FUNCTION.rstrip("\n"), f"cd {shlex.quote(repo_dir)} || exit 0"]
    for n, step in enumerate(steps):
        if step.kind == SETUP:
            lines.append(f"prorl_step {n} || exit 0")
        elif plan.applies_test_patch:  # an eval script prints swebench's markers itself
            lines += [f"prorl_step {n}", "prorl_test_exit=$?", 'echo "prorl: test command exit status $prorl_test_exit"']
        else:
            lines += [f"echo '{START_TEST_OUTPUT}'", f"prorl_step {n}", "prorl_test_exit=$?",
                      f"echo '{END_TEST_OUTPUT}'", 'echo "prorl: test command exit status $prorl_test_exit"']
    return "\n".join(lines) + "\n"


def _write_file(path: str, text: str) -> list[str]:
    """Bash writing ``text`` to ``path`` verbatim: a quoted here-document whose delimiter is no line of ``text``."""
    body = text if text.endswith("\n") else text + "\n"
    tag = "PRORL_EOF_" + hashlib.sha256(body.encode()).hexdigest()[:16]
    existing = set(body.splitlines())
    while tag in existing:
        tag += "_"
    return [f"cat > {path} <<'{tag}'", body.rstrip("\n"), tag] if body.strip("\n") else [f": > {path}"]


def read_steps(steps: list[Step], records: str, log: str, timed_out: bool) -> list[StepOutcome]:
    """Each step's outcome from the step records and the run's log (``timed_out``: the run hit its limit)."""
    started: dict[int, float | None] = {}
    ended: dict[int, tuple[str, int, float | None]] = {}
    for line in records.splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        n = int(parts[0])
        if parts[1] == "start":
            started[n] = _time(parts[2] if len(parts) > 2 else "")
        elif parts[1] in ("end", "syntax") and len(parts) >= 3 and parts[2].lstrip("-").isdigit():
            ended[n] = (parts[1], int(parts[2]), _time(parts[3] if len(parts) > 3 else ""))
    outcomes = []
    for n, step in enumerate(steps):
        tail = _step_log(log, n)[-STEP_TAIL_CHARS:]
        if n not in started:
            outcomes.append(StepOutcome(step.name, step.source, step.kind, NOT_RUN))
            continue
        if n not in ended:
            status = TIMEOUT if timed_out else INTERRUPTED
            outcomes.append(StepOutcome(step.name, step.source, step.kind, status, None, None, tail))
            continue
        event, code, end = ended[n]
        start = started[n]
        seconds = round(end - start, 3) if start is not None and end is not None else None
        status = SYNTAX if event == "syntax" else (OK if code == 0 else FAILED)
        outcomes.append(StepOutcome(step.name, step.source, step.kind, status, code, seconds, tail))
    return outcomes


def _time(text: str) -> float | None:
    try:
        return float(text.replace(",", "."))  # EPOCHREALTIME follows the locale's decimal separator
    except ValueError:
        return None


def _step_log(log: str, n: int) -> str:
    """The part of ``log`` step ``n`` wrote (between its start and exit lines, or to the end of the log)."""
    start = f">>>>> prorl step {n} start\n"
    if start not in log:
        return ""
    part = log.split(start, 1)[1]
    return part.split(f">>>>> prorl step {n} exit", 1)[0]


#: The commands a test run starts pytest through; each gets a bash function of the same name.
PLUGIN_COMMANDS = ("pytest", "python", "python3")


def _plugin_functions(work: str) -> list[str]:
    """Bash functions that put the plugin's folder after whatever ``PYTHONPATH`` a command sets.

    ``PYTHONPATH=src pytest`` replaces the exported ``PYTHONPATH`` (and with it the start-up
    hook), and a virtual environment's python never reads the user site: neither route
    reaches such a command. A function named like the command sees the command's own
    assignment and appends the plugin's folder to it; exported, it reaches the bash scripts
    the run starts (every step, an instance's eval script) too. Each runs the real command (``command``).
    """
    path = shlex.quote(f"{work}/path")
    lines = []
    for name in PLUGIN_COMMANDS:
        lines.append(
            f'{name}() {{ case ":${{PYTHONPATH:-}}:" in *:{path}:*) command {name} "$@" ;; '
            f'*) PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}"{path} command {name} "$@" ;; esac; }}'
        )
    lines.append(f"export -f {' '.join(PLUGIN_COMMANDS)}")
    return lines
