"""SWE-format rows as their projects ship them, mapped to the one instance the ``swe`` domain reads.

Sources (``--format``; ``auto`` tells them apart by their fields, see
:func:`detect_source`): SWE-bench (full, Lite, Verified, Multimodal),
SWE-Gym, SWE-smith, SWE-rebench, nebius' SWE-bench-extra, swebench 5's task
rows, and prorl's own rows. The mapping of each source is documented in
docs/domains.md ("SWE datasets: sources"); the rules, field by field:

- every field is kept, known or not (nothing is dropped);
- fields read under another name are copied to prorl's name (``image_name``
  and ``docker_image`` -> ``image``, a top-level ``test_cmd`` ->
  ``test_command``, ``install_config.eval_commands`` -> ``eval_commands``,
  ``install_config.env_vars`` -> ``env``, a SWE-rebench ``log_parser`` ->
  ``log_parser``);
- values are normalised: test lists (JSON string or list) become lists,
  ``install_config`` (JSON string or object) an object, ``version`` a string,
  timestamps and other non-JSON values text, so the instance travels as JSON;
- a command field that is not shell (``bash -n`` rejects it, or it reads as
  prose) is never run: it moves to ``not_run[FIELD]`` and is reported;
- a field prorl knows and cannot use (a conda ``environment``, SWE-bench's
  ``environment_setup_commit``, ``install_config.python``, ...) and every
  field prorl does not know are kept and reported, once per dataset and
  field, naming the source (:meth:`SweRows.report`).
"""

from __future__ import annotations

import ast
import base64
import datetime as dt
import decimal
import functools
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from prorl_cli.exceptions import DatasetError

Row = dict[str, Any]

SWE_BENCH, SWE_GYM, SWE_SMITH, SWE_REBENCH, NEBIUS, SWEBENCH_TASK, PRORL = (
    "swe-bench", "swe-gym", "swe-smith", "swe-rebench", "nebius", "swebench-task", "prorl")
#: ``--format`` names of the sources, and how reports name them.
SOURCES: dict[str, str] = {
    SWE_BENCH: "SWE-bench (full, Lite, Verified, Multimodal)",
    SWE_GYM: "SWE-Gym",
    SWE_SMITH: "SWE-smith",
    SWE_REBENCH: "SWE-rebench",
    NEBIUS: "nebius SWE-bench-extra",
    SWEBENCH_TASK: "swebench task",
    PRORL: "prorl's own",
}
#: What an instance must hold (``test_patch`` defaults to "" for SWE-smith, whose rows have none).
REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")

#: Fields that hold text, checked for type before anything runs them; and those that may not be blank.
_TEXT_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch")
_NON_EMPTY = ("instance_id", "repo", "base_commit")
#: Test-name lists (JSON strings in SWE-bench's rows, lists elsewhere).
_TEST_LISTS = ("FAIL_TO_PASS", "PASS_TO_PASS", "FAIL_TO_FAIL", "PASS_TO_FAIL")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: Fields the swe domain reads (docs/domains.md, "Instance keys"), under prorl's names.
USED = frozenset({
    "instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS",
    "version", "test_command", "eval_script", "install", "eval_commands", "env", "log_parser", "eval_type", "image",
    "repo_path", "settings", "id", "tokenizer", "install_config", "requirements", "patch_reverse", "not_run",
    "dataset_source",
})
#: Fields read under prorl's name (the original is kept too).
RENAMED = {"image_name": "image", "docker_image": "image", "test_cmd": "test_command"}
#: Metadata: kept, and read by neither prorl nor swebench's grading.
METADATA = frozenset({"hints_text", "created_at", "difficulty", "meta", "license", "license_name", "FAIL_TO_FAIL",
                      "PASS_TO_FAIL", "split", "datasets", "updated_at", "issue_numbers", "pull_number"})
#: Fields that shape the environment or the grading and that prorl does not use: field -> why.
UNUSABLE = {
    "environment_setup_commit": "SWE-bench builds the environment from this commit's requirement files; prorl uses "
                                "the image as published, or builds it at base_commit (build-images --swe)",
    "environment": "a conda environment export; prorl builds no conda environments (build-images --swe installs "
                   "`requirements` with pip)",
    "image_assets": "binary test assets (SWE-bench Multimodal) that prorl does not fetch into the sandbox",
}
#: ``install_config`` keys prorl uses: run by build-images --swe (pre_install, pip_packages, install), by EVAL
#: (test_cmd, eval_commands, env_vars) or grading (log_parser); ``packages`` only as "requirements.txt".
INSTALL_CONFIG_USED = frozenset({"test_cmd", "install", "pre_install", "pip_packages", "log_parser", "eval_commands",
                                 "env_vars"})
INSTALL_CONFIG_UNUSABLE = {
    "python": "the Python version of SWE-rebench's conda environment; prorl's image keeps the base image's python",
    "reqs_path": "where SWE-rebench downloads requirements from; prorl installs the row's `requirements` text",
    "env_yml_path": "a conda environment file path; prorl builds no conda environments",
    "no_use_env": "a conda environment switch; prorl builds no conda environments",
    "docker_specs": "SWE-bench's Docker base image settings; prorl's base is build-images --base",
}
#: Command fields checked before anything runs them: (field, where it moves when it is not shell).
_COMMAND_FIELDS = ("install", "eval_commands", "install_config.install", "install_config.pre_install")


@dataclass
class _Note:
    source: str
    field: str
    reason: str
    rows: int = 0
    example: str = ""


@dataclass
class SweRows:
    """Maps the rows of one dataset (:meth:`map`); what it could not use is in :meth:`report`, once per field."""

    fmt: str = "auto"
    rows: int = 0
    _notes: dict[tuple[str, str, str], _Note] = field(default_factory=dict)

    def map(self, row: Row, where: str) -> Row:
        """The instance of ``row`` (a :class:`DatasetError` names ``where`` and the field when it cannot be one)."""
        source = detect_source(row) if self.fmt == "auto" else self.fmt
        if source not in SOURCES:
            raise DatasetError(f"--format {self.fmt!r} is not a SWE source; choose from {['auto', *SOURCES]}")
        iid = str(row.get("instance_id", "?"))
        # A null text field is an absent one: a column that other rows of a concatenated dataset or a Parquet file
        # have (SWE-smith rows beside SWE-Gym's get test_patch: null). Other nulls are kept (null test lists are
        # no tests).
        out: Row = {key: _jsonable(value) for key, value in row.items() if value is not None or key not in _TEXT_FIELDS}
        if source == SWE_SMITH:
            out.setdefault("test_patch", "")
            if isinstance(out.get("patch"), str) and "patch_reverse" not in row:
                out["patch_reverse"] = True  # SWE-smith's `patch` introduces the bug: the fix is its reverse
        for name, fields, why in UNGRADABLE_FORMATS:
            if _is_format(row, fields):
                raise DatasetError(f"{where}: a {name} row (fields {sorted(fields.intersection(row))}): {why}; give rows "
                                   f"in SWE-bench's format (they need {list(REQUIRED)})")
        for name in REQUIRED:
            if name not in out:
                null = " (null)" if name in row else ""
                raise DatasetError(f"{where}: missing field {name!r}{null} ({SOURCES[source]} rows need "
                                   f"{list(REQUIRED)})")
        for name in _TEXT_FIELDS:
            if name not in out:
                continue
            value = out[name]
            if not isinstance(value, str):
                raise DatasetError(f"{where}: field {name!r} must be a string, got {type(value).__name__} "
                                   f"{_short(value)}")
            if name in _NON_EMPTY and not value.strip():
                raise DatasetError(f"{where}: field {name!r} is empty")
        for name in _TEST_LISTS:
            if name in out:
                out[name] = _test_list(out[name], where, name)
        version = out.get("version")
        if isinstance(version, float):
            # A float has lost the version's text: 0.20 (scikit-learn) reads back as 0.2, another version, and the
            # install spec looked up by it would be the wrong one or none.
            raise DatasetError(f"{where}: field 'version' is the number {version!r}; a version is text (\"0.20\" "
                               "and \"0.2\" are different versions), so write it as a string, as the source does")
        if version is not None and not isinstance(version, str):
            out["version"] = str(version)  # an integer column (Parquet int64) keeps every digit
        for original, ours in RENAMED.items():
            if out.get(original) not in (None, "") and out.get(ours) in (None, ""):
                out[ours] = out[original]
        if "install_config" in out:
            self._install_config(out, source, iid, where)
        if out.get("install") not in (None, "", []):
            out["install"] = _commands(out["install"], where, "install")
        self._check_commands(out, source, iid)
        out.setdefault("dataset_source", source)
        for key in row:
            self._classify(key, source, iid)
        self.rows += 1  # counted once mapped: a row skipped as bad is not one of the rows the report counts
        return out

    def _install_config(self, out: Row, source: str, iid: str, where: str) -> None:
        raw = out["install_config"]
        if isinstance(raw, str):
            try:
                raw = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: field 'install_config' is a string but not JSON: {e.msg}") from e
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise DatasetError(f"{where}: install_config must be an object, got {type(raw).__name__}")
        config = dict(raw)
        test_cmd = config.get("test_cmd")
        if isinstance(test_cmd, list) and all(isinstance(c, str) for c in test_cmd) and test_cmd:
            # A list runs in order; the last command is the tests, the others set them up.
            config["test_cmd"] = test_cmd[-1]
            out["eval_commands"] = [*_commands(config.get("eval_commands") or [], where,
                                               "install_config.eval_commands"), *test_cmd[:-1]]
        elif config.get("eval_commands") not in (None, "", []):
            out.setdefault("eval_commands", _commands(config["eval_commands"], where, "install_config.eval_commands"))
        env = config.get("env_vars")
        if isinstance(env, dict) and env and "env" not in out:
            out["env"] = {str(k): str(v) for k, v in env.items()}
        parser = config.get("log_parser")
        if isinstance(parser, str) and parser and out.get("log_parser") in (None, ""):
            known = _parser_names()
            if parser == "parse_log_pytest":
                pass  # pytest: graded by exact node ids, the log parse fills in (prorl_cli/swe/grading.py)
            elif known is None or parser in known:
                out["log_parser"] = parser
            else:
                self._note(source, "install_config.log_parser", iid,
                           f"{parser!r} is not one of the installed swebench's log parsers; prorl grades by pytest "
                           "node ids and swebench's pytest parser instead", kind="unknown parser")
        for key, value in config.items():
            if key in INSTALL_CONFIG_USED or value in (None, "", [], {}, False):
                continue
            if key == "packages" and value == "requirements.txt" and out.get("requirements"):
                continue  # installed from the row's `requirements` (build-images --swe)
            why = INSTALL_CONFIG_UNUSABLE.get(key)
            if key == "packages":
                why = ("requirements.txt, but the row has no `requirements` text to install" if value == "requirements.txt"
                       else f"conda packages {value!r}; prorl builds no conda environments")
            self._note(source, f"install_config.{key}", iid, f"not used: {why}; kept in the instance" if why
                       else "not a key prorl knows: kept in the instance, not used", kind="unused")
        out["install_config"] = config

    def _check_commands(self, out: Row, source: str, iid: str) -> None:
        """Move every command that is not shell out of the fields anything runs, into ``not_run``."""
        raw = out.get("install_config")
        config: Row = raw if isinstance(raw, dict) else {}
        for name in _COMMAND_FIELDS:
            holder: Row
            holder, key = (config, name.split(".", 1)[1]) if name.startswith("install_config.") else (out, name)
            value = holder.get(key)
            if value in (None, "", []):
                continue
            commands = [value] if isinstance(value, str) else value
            if not isinstance(commands, list):
                continue
            kept, refused = [], []
            for command in commands:
                problem = shell_problem(command) if isinstance(command, str) else "not a string"
                if problem is None:
                    kept.append(command)
                    continue
                refused.append(command)
                self._note(source, name, iid, f"not shell ({problem}): moved to not_run[{name!r}], never run",
                           example=f"{iid}: {str(command)[:80]!r}", kind="not shell")
            if refused:
                out.setdefault("not_run", {})[name] = refused
                if isinstance(value, str) or not kept:
                    holder.pop(key)
                else:
                    holder[key] = kept
        for name, value in (("test_command", out.get("test_command")), ("eval_script", out.get("eval_script")),
                            ("install_config.test_cmd", config.get("test_cmd"))):
            if isinstance(value, str) and value.strip():
                problem = shell_problem(value)
                if problem is not None:
                    self._note(source, name, iid, f"not shell ({problem}): EVAL cannot run it, and such a run "
                                                  "ends as an infra_failure (no reward)",
                               example=f"{iid}: {value[:80]!r}", kind="not shell")

    def _classify(self, key: str, source: str, iid: str) -> None:
        if key in USED or key in METADATA or key in RENAMED:
            return
        why = UNUSABLE.get(key)
        self._note(source, key, iid, f"not used: {why}; kept in the instance" if why
                   else "not a field prorl knows: kept in the instance, not used")

    def _note(self, source: str, name: str, iid: str, reason: str, example: str = "", kind: str = "") -> None:
        # One note per source, field and kind of problem: the first row's reason and example stand for the rest.
        note = self._notes.setdefault((source, name, kind or reason), _Note(source, name, reason, example=example or iid))
        note.rows += 1

    def report(self) -> list[str]:
        """One line per source and field prorl could not use (or refused to run), naming both."""
        return [f"{SOURCES[n.source]} rows: field {n.field!r} ({n.rows} of {self.rows} row(s), e.g. {n.example}): "
                f"{n.reason}" for n in self._notes.values()]


#: Dataset formats whose rows prorl cannot grade: (name, fields only that format's rows carry, why).
UNGRADABLE_FORMATS: tuple[tuple[str, frozenset[str], str], ...] = (
    # R2E-Gym's own rows (its SWE-bench-format splits carry SWE-bench's fields instead).
    ("R2E-Gym", frozenset({"repo_name", "commit_hash", "expected_output_json", "execution_result_content",
                           "parsed_commit_content", "modified_entity_summaries"}),
     "R2E-Gym grades a run by its image's own test script against `expected_output_json`, with no base_commit, "
     "test_patch or FAIL_TO_PASS/PASS_TO_PASS lists, so prorl cannot grade it"),
    # Multi-SWE-bench's pull-request records.
    ("Multi-SWE-bench", frozenset({"fix_patch", "f2p_tests", "p2p_tests", "s2p_tests", "n2p_tests", "fixed_tests",
                                   "run_result", "test_patch_result", "fix_patch_result"}),
     "its tests run by the per-repository commands and log parsers of Multi-SWE-bench's own harness (Java, "
     "TypeScript, Go, Rust, C...), which its rows do not carry, so prorl cannot grade it without guessing; map it "
     "(repo 'org/name', base_commit from base.sha, patch from fix_patch, FAIL_TO_PASS/PASS_TO_PASS from the "
     "f2p_tests/p2p_tests names) and add a test_command and a log_parser that names its tests as the lists do"),
)


def _is_format(row: Row, fields: frozenset[str]) -> bool:
    """Whether ``row`` carries two or more of a format's own ``fields`` and none of SWE-bench's instance fields."""
    return (len(fields.intersection(row)) >= 2
            and not any(k in row for k in ("base_commit", "FAIL_TO_PASS", "PASS_TO_PASS")))


def detect_source(row: Row) -> str:
    """The project a row comes from, by the fields only that project ships (``--format auto``)."""
    if ("image_name" in row and "test_patch" not in row) or str(row.get("repo", "")).startswith("swesmith/"):
        return SWE_SMITH
    if any(k in row for k in ("install_config", "requirements", "environment", "docker_image", "license_name",
                              "FAIL_TO_FAIL", "PASS_TO_FAIL")):
        return SWE_REBENCH
    if isinstance(row.get("meta"), dict) and "license" in row:
        return NEBIUS
    if all(k in row for k in ("eval_script", "log_parser", "eval_type")):
        return SWEBENCH_TASK
    if "environment_setup_commit" in row:
        return SWE_BENCH
    if "hints_text" in row or "created_at" in row:
        return SWE_GYM
    return PRORL


def _test_list(value: Any, where: str, name: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            python_list = _python_list(value)
            if python_list is None:
                raise DatasetError(f"{where}: field {name!r} is a string but not JSON: {e.msg}") from e
            value = python_list  # str(list) or a CSV round trip: ['a', 'b'], quoted Python's way
    if value is None:
        value = []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        found = type(value).__name__ if not isinstance(value, list) else \
            f"a list holding {sorted({type(v).__name__ for v in value if not isinstance(v, str)})}"
        raise DatasetError(f"{where}: {name} must be a list of test names (JSON, or a JSON string), got {found}")
    return value


def _python_list(text: str) -> list[str] | None:
    """A list of strings written as Python writes one (``str(list)``), else None. Literals only: nothing runs."""
    if not text.lstrip().startswith("["):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def _commands(value: Any, where: str, name: str) -> list[Any]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return list(value)
    raise DatasetError(f"{where}: {name} must be a command or a list of commands, got {type(value).__name__}")


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can carry it: timestamps as ISO text, decimals and bytes as text, containers walked."""
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


@functools.lru_cache(maxsize=1)
def _parser_names() -> frozenset[str] | None:
    try:
        from swebench.harness.log_parsers import PARSER_REGISTRY
    except ImportError:
        return None
    return frozenset(PARSER_REGISTRY)


#: A word that marks a shell command, not a sentence: an option, a path, an assignment, an operator.
_SHELLISH = re.compile(r"^-|[/=$`|&;<>*~\\(){}\[\]]")


def reads_as_prose(text: str) -> bool:
    """Whether ``text`` is a sentence, not a command: a capitalised first word, three words or more, none of them
    an option, a path, an assignment or an operator ("Install the package with pip")."""
    words = text.split()
    if len(words) < 3 or not re.fullmatch(r"[A-Z][a-z]+[,:]?", words[0]):
        return False
    return not any(_SHELLISH.search(word) for word in words)


@functools.lru_cache(maxsize=4096)
def shell_problem(text: str) -> str | None:
    """Why ``text`` cannot run as bash, or None: ``bash -n`` rejects it, or it reads as prose."""
    bash = shutil.which("bash")
    if bash is not None:
        try:
            checked = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            checked = None
        if checked is not None and checked.returncode != 0:
            lines = [line for line in checked.stderr.splitlines() if line.strip()]
            detail = re.sub(r"^\S*bash: (line \d+: )?", "", lines[0]) if lines else f"exit {checked.returncode}"
            return f"bash -n: {detail[:200]}"
    if reads_as_prose(text):
        return "reads as prose, not a command"
    return None
