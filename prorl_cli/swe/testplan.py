"""How one SWE instance is tested: which command or script, which install steps, which log parser.

Precedence, first found wins (each key separately):

1. the instance: ``eval_script`` (a whole bash script, SWE-bench's ``eval.sh``
   shape: it applies the test patch and runs the tests itself), else
   ``test_command`` (SWE-rebench's ``install_config.test_cmd`` counts as one);
   ``install`` (a string or a list of commands); ``log_parser``; ``eval_type``;
   ``eval_commands`` (SWE-rebench's, run before ``install``) and ``env``
   (variables exported for every step) come from the instance only;
2. the ``domains.swe`` settings (prorl.yaml, then the instance's ``settings``):
   ``eval_script``, ``test_command``, ``install``, ``log_parser``;
3. the ``swebench`` package, for SWE-bench's own repositories: the per-repo
   log parser (``MAP_REPO_TO_PARSER_PY``) where the repository's tests are
   not plain pytest, and fail-only grading for ``FAIL_ONLY_REPOS``;
4. the default: ``python3 -m pytest -rA -p no:cacheprovider`` on the test
   files, graded by exact pytest node id; but where the log parser is one
   of a runner that is not pytest (:data:`RUNNERS`: Django's
   ``tests/runtests.py`` on module labels, sympy's ``bin/test``), that
   runner, as SWE-bench's harness runs it: its parser cannot read pytest's
   output, and a gold patch would score 0.

A test command gets the test files it does not already name appended, or
``{test_files}`` in it replaced by them all; each file is named once, so no
test file runs twice and none is left out. A pytest command gets the
``.py`` files only, and the files a listed node id names (:func:`files_for`).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.domains.swe_grading import test_targets
from prorl_cli.exceptions import DomainError

DEFAULT_TEST_COMMAND = "python3 -m pytest -rA -p no:cacheprovider"
PASS_AND_FAIL = "pass_and_fail"
FAIL_ONLY = "fail_only"
#: The swebench parser SWE-bench's pytest repositories use; exact node ids replace it here.
PYTEST_PARSER = "parse_log_pytest"


@dataclass(frozen=True)
class TestPlan:
    """What EVAL runs in the repository after the model patch is applied."""

    script: str  # bash, run in the repository folder
    source: str  # where it came from: "instance eval_script", "settings test_command", "default", ...
    applies_test_patch: bool  # an eval_script applies the test patch itself
    test_files: list[str] = field(default_factory=list)  # each named once on the command line
    install: list[str] = field(default_factory=list)
    install_source: str = ""  # "instance install" or "settings install"
    eval_commands: list[str] = field(default_factory=list)  # the instance's, run before install
    env: dict[str, str] = field(default_factory=dict)  # exported for every step
    log_parser: str | None = None  # a swebench PARSER_REGISTRY name; None: exact node ids (pytest log as fallback)
    log_parser_source: str = "default"
    eval_type: str = PASS_AND_FAIL


#: Test runners of swebench's parsers that read no pytest output: parser -> command (SWE-bench's harness runs these).
RUNNERS: dict[str, str] = {
    "parse_log_django": "PYTHONIOENCODING=utf8 LANG=C.UTF-8 LC_ALL=C.UTF-8 python3 tests/runtests.py --verbosity 2 "
                        "--settings=test_sqlite --parallel 1",
    "parse_log_sympy": "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' python3 bin/test -C --verbose",
}
#: Django releases whose runner SWE-bench starts without ``--settings``/``--parallel`` (before 1.10).
DJANGO_SERIAL_BEFORE = (1, 10)


def django_labels(files: list[str]) -> list[str]:
    """Django runner labels of the ``.py`` test files: ``tests/`` and ``.py`` dropped, ``/`` -> ``.``.

    A template or fixture the test patch touches is no module: as a label it would only fail to import.
    """
    labels = []
    for name in files:
        if not name.endswith(".py"):
            continue
        name = name[:-len(".py")]
        name = name[len("tests/"):] if name.startswith("tests/") else name
        labels.append(name.replace("/", "."))
    return labels


#: A command that runs pytest: it takes test files as paths and stops at one it cannot collect.
_PYTEST = re.compile(r"\bpy\.?test\b")


def files_for(command: str, files: list[str], test_names: list[str]) -> list[str]:
    """The test files to give ``command``: for pytest, the ``.py`` files and those a listed node id names.

    pytest stops at a path it cannot collect ("ERROR: not found": mypy's ``test-data/unit/*.test``, a
    ``.rc`` fixture) and runs no test at all; the tests of a file no listed id names do not count anyway.
    """
    if not _PYTEST.search(command):
        return files
    named = {name.split("::", 1)[0] for name in test_names if "::" in name}
    return [f for f in files if f.endswith(".py") or f in named]


def _runner(parser: str | None, version: str, files: list[str]) -> str | None:
    """``parser``'s own test runner on ``files``, or None where pytest's output suits the parser."""
    command = RUNNERS.get(parser or "")
    if command is None:
        return None
    if parser == "parse_log_django":
        try:
            release = tuple(int(part) for part in version.split(".")[:2])
        except ValueError:
            release = ()
        if release and release < DJANGO_SERIAL_BEFORE:
            command = command.replace(" --settings=test_sqlite --parallel 1", "")
        return command_with_files(command, django_labels(files))
    return command_with_files(command, files)


def _text(value: Any, where: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise DomainError(f"swe: {where} must be a string, got {type(value).__name__}")
    return value


def _commands(value: Any, where: str) -> list[str] | None:
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise DomainError(f"swe: {where} must be a command or a list of commands, got {value!r}")


def command_with_files(command: str, files: list[str]) -> str:
    """``command`` naming each test file once: ``{test_files}`` filled in, else the files it does not name appended."""
    unique = list(dict.fromkeys(files))
    if "{test_files}" in command:
        return command.replace("{test_files}", " ".join(shlex.quote(f) for f in unique))
    try:
        words = set(shlex.split(command))
    except ValueError:
        words = set(command.split())
    rest = " ".join(shlex.quote(f) for f in unique if f not in words)
    return f"{command} {rest}" if rest else command


def _swebench_parser(repo: str) -> str | None:
    try:
        from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY
    except ImportError:
        return None
    parser = MAP_REPO_TO_PARSER_PY.get(repo)
    return None if parser is None or parser.__name__ == PYTEST_PARSER else str(parser.__name__)


def _fail_only(repo: str) -> bool:
    try:
        from swebench.harness.constants import FAIL_ONLY_REPOS
    except ImportError:
        return False
    return repo in FAIL_ONLY_REPOS


def plan_tests(instance: dict[str, Any], settings: dict[str, Any], fail_to_pass: list[str],
               pass_to_pass: list[str]) -> TestPlan:
    """The :class:`TestPlan` of ``instance`` under the ``domains.swe`` ``settings`` (their ``extra`` mapping)."""
    repo = str(instance.get("repo", ""))
    raw_config = instance.get("install_config")
    install_config: dict[str, Any] = raw_config if isinstance(raw_config, dict) else {}
    files = test_targets(str(instance.get("test_patch") or ""), fail_to_pass, pass_to_pass)

    install: list[str] = []
    install_source = ""
    for where, value in (("instance install", instance.get("install")),
                         ("settings install", settings.get("install"))):
        found = _commands(value, where)
        if found is not None:
            install, install_source = found, where
            break
    eval_commands = _commands(instance.get("eval_commands"), "instance eval_commands") or []
    env = _env(instance.get("env"))

    parser, parser_source = None, "default"
    for where, value in (("instance log_parser", instance.get("log_parser")),
                         ("settings log_parser", settings.get("log_parser"))):
        name = _text(value, where)
        if name is not None:
            parser, parser_source = name, where
            break
    else:
        name = _swebench_parser(repo)
        if name is not None:
            parser, parser_source = name, f"swebench MAP_REPO_TO_PARSER_PY[{repo!r}]"
    if parser is not None:
        _check_parser(parser, parser_source)

    eval_type = _text(instance.get("eval_type"), "instance eval_type") or (FAIL_ONLY if _fail_only(repo) else PASS_AND_FAIL)
    if eval_type not in (PASS_AND_FAIL, FAIL_ONLY):
        raise DomainError(f"swe: eval_type must be {PASS_AND_FAIL!r} or {FAIL_ONLY!r}, got {eval_type!r}")

    listed = [*fail_to_pass, *pass_to_pass]
    runner = _runner(parser, str(instance.get("version", "")), files)
    plan = TestPlan(script=runner or command_with_files(DEFAULT_TEST_COMMAND,
                                                        files_for(DEFAULT_TEST_COMMAND, files, listed)),
                    source=f"default for {parser}" if runner else "default",
                    applies_test_patch=False, test_files=files, install=install, install_source=install_source,
                    eval_commands=eval_commands, env=env, log_parser=parser, log_parser_source=parser_source,
                    eval_type=eval_type)
    candidates: list[tuple[str, str, Any]] = [
        ("instance eval_script", "script", instance.get("eval_script")),
        ("instance test_command", "command", instance.get("test_command")),
        ("instance install_config.test_cmd", "command", install_config.get("test_cmd")),
        ("settings eval_script", "script", settings.get("eval_script")),
        ("settings test_command", "command", settings.get("test_command")),
    ]
    for where, kind, value in candidates:
        text = _text(value, where)
        if text is None:
            continue
        if kind == "script":
            return dataclasses.replace(plan, script=text, source=where, applies_test_patch=True)
        return dataclasses.replace(plan, script=command_with_files(text, files_for(text, files, listed)),
                                   source=where)
    return plan


def _env(value: Any) -> dict[str, str]:
    """The instance's ``env``: variable names a shell can export, values as text."""
    if value in (None, {}):
        return {}
    if not isinstance(value, dict):
        raise DomainError(f"swe: instance env must be an object of NAME: value, got {type(value).__name__}")
    bad = [k for k in value if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
    if bad:
        raise DomainError(f"swe: instance env names {bad!r} are not shell variable names")
    return {k: str(v) for k, v in value.items()}


def _check_parser(name: str, where: str) -> None:
    try:
        from swebench.harness.log_parsers import PARSER_REGISTRY
    except ImportError as e:
        raise DomainError("swe: a log_parser needs the 'swebench' package (pip install 'prorl[swe]')") from e
    if name not in PARSER_REGISTRY:
        raise DomainError(f"swe: {where} {name!r} is not one of swebench's parsers: {sorted(PARSER_REGISTRY)}")
