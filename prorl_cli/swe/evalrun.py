"""The files and the bash script of one EVAL test run inside the sandbox.

Everything lives under :data:`WORK` in the sandbox: the node-id plugin and
its start-up hook (on ``PYTHONPATH`` and in a user site, see
``prorl_cli/swe/customize.py``), the test patch, the eval script, the run
script, and what comes back (the log and the node-id records).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from prorl_cli.swe.grading import END_TEST_OUTPUT, START_TEST_OUTPUT
from prorl_cli.swe.testplan import TestPlan

WORK = "/tmp/prorl-swe"
LOG = f"{WORK}/test.log"
NODEIDS = f"{WORK}/nodeids.jsonl"
RUN = f"{WORK}/run.sh"
TEST_PATCH = f"{WORK}/test.patch"
EVAL_SCRIPT = f"{WORK}/eval.sh"
_HERE = Path(__file__).parent
#: Python versions whose user site gets the start-up hook (``lib/pythonX.Y/site-packages``).
PYTHON_VERSIONS = [f"3.{minor}" for minor in range(6, 16)]


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


def run_script(plan: TestPlan, repo_dir: str, work: str = WORK) -> str:
    """Bash that applies no patch itself: install steps, then the plan's tests between swebench's markers.

    An eval script (which applies the test patch itself) is expected at ``work/eval.sh``.
    """
    lines = [
        "#!/bin/bash",
        f"export PRORL_SWE_NODEIDS={shlex.quote(work)}/nodeids.jsonl",
        f'export PYTHONPATH={shlex.quote(work)}/path${{PYTHONPATH:+:$PYTHONPATH}}',
        f"export PYTHONUSERBASE={shlex.quote(work)}/user",
        *_plugin_functions(work),
        f"cd {shlex.quote(repo_dir)}",
    ]
    for command in plan.install:
        lines.append(f"( {command} ) || echo 'prorl: install step failed: {_squote(command)}'")
    if plan.applies_test_patch:
        lines.append(f"bash {shlex.quote(work)}/eval.sh")
    else:
        lines += [f"echo '{START_TEST_OUTPUT}'", plan.script, "prorl_test_exit=$?", f"echo '{END_TEST_OUTPUT}'",
                  'echo "prorl: test command exit status $prorl_test_exit"']
    return "\n".join(lines) + "\n"


#: The commands a test run starts pytest through; each gets a bash function of the same name.
PLUGIN_COMMANDS = ("pytest", "python", "python3")


def _plugin_functions(work: str) -> list[str]:
    """Bash functions that put the plugin's folder after whatever ``PYTHONPATH`` a command sets.

    ``PYTHONPATH=src pytest`` replaces the exported ``PYTHONPATH`` (and with it the start-up
    hook), and a virtual environment's python never reads the user site: neither route
    reaches such a command. A function named like the command sees the command's own
    assignment and appends the plugin's folder to it; exported, it reaches the bash scripts
    the run starts (an instance's eval script) too. Each runs the real command (``command``).
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


def _squote(text: str) -> str:
    return text.replace("'", "'\\''")
