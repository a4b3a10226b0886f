"""What README.md and docs/*.md point a newcomer to exists, as the docs say; complements test_doc_examples.py.

test_doc_examples.py runs the ``prorl ...`` lines of fenced ``bash`` blocks, the
config examples and the ``client.<method>`` names of the Python snippets. This
file covers what it leaves out, each found in the docs, not listed here:

- ``prorl ...`` in inline code (`` `prorl eval --task swe` ``, table cells) and
  in fenced blocks of any other language or none;
- repository paths (``examples/``, ``scripts/``, ``benchmarks/``, ``docs/img/``,
  ``tests/...::test_name``, ...) and the flags the docs give a script;
- dotted ``prorl_cli.x.y`` names, and the keyword arguments of the snippets'
  ``client.<method>(...)`` calls (the sync client forwards ``**kwargs``, so a
  name check alone lets any keyword through);
- the default a doc states for a ``prorl.yaml`` key (``broker.kv_admission``,
  default 1.0; a settings table's default column), against ``ProrlConfig()``;
- the ``handlers:`` blocks of the docs' YAML, against the shipped handlers' settings;
- the lists the docs present as complete, against the code they describe: provision steps and
  extras (README), metrics (observability.md), ops and record fields (protocol.md), deploy.yaml
  keys (slurm.md), the package map (architecture.md), ``HandlerSettings``, the domains' and the
  harness's settings, ``SamplerConfig``, and the ``PRORL_*`` variables.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import shlex
import textwrap
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from prorl_cli.cli import cli
from prorl_cli.client import AsyncRolloutClient
from prorl_cli.config import ProrlConfig

REPO = Path(__file__).resolve().parents[2]
# benchmarks-history.md is a log of past runs: its commands are as they were then.
DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "benchmarks-history.md")]
FENCE = re.compile(r"^[ ]*```(\w*)\n(.*?)^[ ]*```", re.M | re.S)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _prose(text: str) -> str:
    """``text`` with its fenced blocks blanked out (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


# --- prorl command lines -------------------------------------------------------------------------


def _command_lines() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) in ("bash", "python", "yaml"):  # bash: test_doc_examples.py
                continue
            for i, raw in enumerate(m.group(2).splitlines()):
                line = raw.split(" #", 1)[0].strip().removeprefix("$ ")
                if line.startswith("prorl "):
                    found.append((f"{doc.name}:{_line(text, m.start()) + i + 1}", line))
        prose = _prose(text)
        for m in re.finditer(r"`(prorl\s[^`]+)`", prose):
            found.append((f"{doc.name}:{_line(prose, m.start())}", " ".join(m.group(1).split())))
    return found


COMMAND_LINES = _command_lines()


def _option(cmd: click.Command, name: str) -> click.Option | None:
    ctx = click.Context(cmd, **cli.context_settings)  # -h as well as --help, as every subcommand inherits
    help_opt = cmd.get_help_option(ctx)
    for p in [*cmd.params, *([help_opt] if help_opt else [])]:
        if isinstance(p, click.Option) and name in p.opts + p.secondary_opts:
            return p
    return None


def test_the_docs_have_inline_commands_to_check() -> None:
    lines = {line for _, line in COMMAND_LINES}
    assert "prorl quickstart --engine none" in lines, "README's inline `prorl quickstart --engine none` is found"
    assert any(w.startswith("inference.md") for w, _ in COMMAND_LINES), "inference.md's table and plain block are found"


@pytest.mark.parametrize(("where", "line"), COMMAND_LINES, ids=[f"{w} {ln}" for w, ln in COMMAND_LINES])
def test_a_prorl_command_anywhere_in_the_docs_names_real_commands_and_options(where: str, line: str) -> None:
    """``a|b`` (or ``a/b``) in a command's place is each of ``a`` and ``b``; after ``--`` come another program's flags."""
    cmds: list[click.Command] = [cli]
    pending_value = False
    in_args = False
    for token in shlex.split(line.replace("\\|", "|"))[1:]:
        token = token.strip("[]")
        if token == "--":
            break
        if not token or token in ("|", "/", "..."):
            continue
        if token.startswith("-"):
            name = token.split("=", 1)[0]
            for cmd in cmds:
                opt = _option(cmd, name)
                assert opt is not None, f"{where}: `{line}`: {cmd.name} has no option {name}"
                pending_value = not opt.is_flag and not opt.count and "=" not in token
            continue
        if pending_value:
            pending_value = False
            continue
        if in_args or not all(isinstance(c, click.Group) for c in cmds):
            in_args = True  # an argument of the command: nothing further to look up
            continue
        subs: list[click.Command] = []
        for cmd in cmds:
            for alt in re.split(r"[|/]", token):
                sub = cmd.get_command(click.Context(cmd), alt)  # type: ignore[attr-defined]
                assert sub is not None, f"{where}: `{line}`: no command {alt!r} in {cmd.name}"
                subs.append(sub)
        cmds = subs


# --- repository paths and script flags ------------------------------------------------------------

PATH_RE = re.compile(
    r"(?<![\w/.$<~-])((?:examples|scripts|benchmarks|docs|tests|prorl_cli|sif_recipes|slurm_templates|handlers)"
    r"/[\w/.*-]*[\w*])(?:::(\w+))?"
)
# Illustrations, not references: a placeholder script name, pytest ids made up to show a format, and paths in
# a dataset's repository (Django's test runner and one of its test modules).
NOT_PATHS = {"benchmarks/NAME.py", "tests/test_x.py", "tests/t.py", "tests/runtests.py", "tests/admin_views/tests.py"}


def _paths() -> list[tuple[str, str, str | None]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in PATH_RE.finditer(text):
            if m.group(1) not in NOT_PATHS:
                found.append((f"{doc.name}:{_line(text, m.start())}", m.group(1), m.group(2)))
    return found


PATHS = _paths()


def test_the_docs_have_paths_to_check() -> None:
    paths = {p for _, p, _ in PATHS}
    assert {"examples/prorl.yaml", "examples/deploy.yaml", "docs/img/table3.png", "scripts/test.sh"} <= paths


@pytest.mark.parametrize(("where", "path", "test_name"), PATHS, ids=[f"{w} {p}" for w, p, _ in PATHS])
def test_a_path_in_the_docs_exists(where: str, path: str, test_name: str | None) -> None:
    hits = list(REPO.glob(path)) if "*" in path else [REPO / path] if (REPO / path).exists() else []
    assert hits, f"{where}: {path} does not exist"
    if test_name is not None:
        assert re.search(rf"^\s*(async\s+)?(def|class)\s+{test_name}\b", hits[0].read_text(), re.M), (
            f"{where}: {path} has no {test_name}"
        )


SCRIPT_RE = re.compile(r"((?:examples|scripts|benchmarks)/[\w/.-]+\.(?:py|sh))((?:[ \t]+[^\s`#;|&]+)*)")


def _script_flags() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ")
        for m in SCRIPT_RE.finditer(text):
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2)):
                found.append((f"{doc.name}:{_line(text, m.start())}", m.group(1), flag))
    return found


SCRIPT_FLAGS = _script_flags()


def test_the_docs_have_script_flags_to_check() -> None:
    assert ("benchmarks/table3.py", "--weight-sync") in {(s, f) for _, s, f in SCRIPT_FLAGS}


@pytest.mark.parametrize(("where", "script", "flag"), SCRIPT_FLAGS, ids=[f"{w} {s} {f}" for w, s, f in SCRIPT_FLAGS])
def test_a_flag_the_docs_give_a_script_is_one_it_reads(where: str, script: str, flag: str) -> None:
    source = (REPO / script).read_text()
    assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", source), (
        f"{where}: {script} reads no {flag}"
    )


# --- Python names ---------------------------------------------------------------------------------


def _dotted_names() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"\bprorl_cli(?:\.\w+)+", text):
            found.append((f"{doc.name}:{_line(text, m.start())}", m.group(0)))
    return found


DOTTED = _dotted_names()


@pytest.mark.parametrize(("where", "dotted"), DOTTED, ids=[f"{w} {d}" for w, d in DOTTED])
def test_a_dotted_prorl_cli_name_in_the_docs_resolves(where: str, dotted: str) -> None:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:k]))
            break
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("prorl_cli"):
                pytest.skip(f"{dotted} needs {e.name}")  # an extra's module (verl, trl): CI has them all
            continue
    for attr in parts[k:]:
        assert hasattr(obj, attr), f"{where}: {'.'.join(parts[:k])} has no {'.'.join(parts[k:])}"
        obj = getattr(obj, attr)


def _client_calls() -> list[tuple[str, str, list[str]]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) != "python":
                continue
            for node in ast.walk(ast.parse(textwrap.dedent(m.group(2)))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "client"
                ):
                    kws = [k.arg for k in node.keywords if k.arg is not None]
                    found.append((f"{doc.name}:{_line(text, m.start()) + node.lineno}", node.func.attr, kws))
    return found


CLIENT_CALLS = [c for c in _client_calls() if c[2]]


def _imported_calls() -> list[tuple[str, str, str, list[str]]]:
    """Calls in the Python snippets of a name they import from prorl_cli, with keywords: (where, module, name, kws)."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) != "python":
                continue
            tree = ast.parse(textwrap.dedent(m.group(2)))
            imported = {
                alias.asname or alias.name: (node.module, alias.name)
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prorl_cli")
                for alias in node.names
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
                    kws = [k.arg for k in node.keywords if k.arg is not None]
                    if kws:
                        module, name = imported[node.func.id]
                        found.append((f"{doc.name}:{_line(text, m.start()) + node.lineno}", module, name, kws))
    return found


IMPORTED_CALLS = _imported_calls()


def test_the_docs_have_imported_calls_to_check() -> None:
    assert {"HandlerSettings", "SamplerConfig", "ProrlRollout"} <= {name for _, _, name, _ in IMPORTED_CALLS}


@pytest.mark.parametrize(
    ("where", "module", "name", "keywords"), IMPORTED_CALLS, ids=[f"{w} {n}" for w, _, n, _ in IMPORTED_CALLS]
)
def test_a_call_in_the_docs_of_a_prorl_cli_name_uses_real_keywords(
    where: str, module: str, name: str, keywords: list[str]
) -> None:
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return  # takes any keyword (and names none to check against)
    for kw in keywords:
        assert kw in params, f"{where}: {name}() takes no {kw}= (it takes {list(params)})"


def test_the_docs_have_client_keywords_to_check() -> None:
    assert {"job_ids", "group_id", "meta"} <= {k for _, method, kws in CLIENT_CALLS if method == "submit" for k in kws}


@pytest.mark.parametrize(("where", "method", "keywords"), CLIENT_CALLS, ids=[f"{w} {m}" for w, m, _ in CLIENT_CALLS])
def test_a_client_call_in_the_docs_uses_real_keywords(where: str, method: str, keywords: list[str]) -> None:
    params = inspect.signature(getattr(AsyncRolloutClient, method)).parameters
    for kw in keywords:
        assert kw in params, f"{where}: client.{method}() takes no {kw}= (it takes {list(params)[1:]})"


# --- prorl.yaml defaults the docs state ----------------------------------------------------------

DEFAULTS: dict[str, Any] = {}


def _flatten(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _flatten(value, f"{prefix}{f.name}.")
        else:
            DEFAULTS[f"{prefix}{f.name}"] = value


_flatten(ProrlConfig(), "")
SECTIONS = {key.split(".")[0] for key in DEFAULTS if "." in key}
UNITS = {"s": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _value(text: str) -> Any:
    """A stated default: ``600``, ``120 s``, ``64 KiB``, ``null``, `` `vllm` ``, ``[]``, ``0: none``."""
    text = text.strip().strip("`").split(":")[0].strip()
    m = re.fullmatch(r"(-?[\d.]+)\s*(s|KiB|MiB|GiB)?", text)
    if m:
        return float(m.group(1)) * UNITS.get(m.group(2) or "s", 1)
    return yaml.safe_load(text)


def _stated_defaults() -> list[tuple[str, str, str]]:
    """(where, key, value) for ``sec.key`` (default V) / ``sec.key``, default V / ``sec.key`` (V unit) in prose,
    and the rows of settings tables in a doc section that names its ``sec:`` / ``sec.*`` (a "default" column,
    or a "setting (default)" column of ``key`` (V) entries)."""
    found = []
    for doc in DOCS:
        text = _prose(doc.read_text())
        for m in re.finditer(
            r"`([a-z_]+\.[a-z_0-9]+)`(?:,? \(?default ([^,;)]+)|\s*\((-?[\d.]+\s*(?:s|KiB|MiB|GiB))\b)", text
        ):
            if m.group(1) in DEFAULTS:
                found.append((f"{doc.name}:{_line(text, m.start())}", m.group(1), m.group(2) or m.group(3)))
        for section in re.split(r"(?m)^(?=#)", text):
            offset = text.index(section)
            named = set(re.findall(r"`(\w+)(?::`|\.\*`)", section)) & SECTIONS
            if len(named) != 1:
                continue
            (sec,) = named
            header: list[str] = []
            for m in re.finditer(r"(?m)^\|(.*)\|\s*$", section):
                cells = [c.strip() for c in m.group(1).split("|")]
                if set("".join(cells)) <= set("-: "):
                    continue
                if not header or not cells[0].startswith("`") and "default" in " ".join(cells):
                    header = cells
                    continue
                where = f"{doc.name}:{_line(text, offset + m.start())}"
                for col, name in enumerate(header):
                    if col >= len(cells):
                        break
                    if name == "default" and re.fullmatch(r"`(\w+)`", cells[0]):
                        key = f"{sec}.{cells[0].strip('`')}"
                        if key in DEFAULTS:
                            found.append((where, key, cells[col]))
                    elif "(default)" in name:
                        for k, v in re.findall(r"`(\w+)` \(([^)]+)\)", cells[col]):
                            if f"{sec}.{k}" in DEFAULTS:
                                found.append((where, f"{sec}.{k}", v))
    return found


STATED = _stated_defaults()


def test_the_docs_have_defaults_to_check() -> None:
    keys = {key for _, key, _ in STATED}
    assert {"broker.kv_admission", "inference.capacity", "sandbox.max_procs", "node.loop_stall_limit_s"} <= keys


@pytest.mark.parametrize(("where", "key", "stated"), STATED, ids=[f"{w} {k}" for w, k, _ in STATED])
def test_a_default_the_docs_state_is_the_configs(where: str, key: str, stated: str) -> None:
    assert _value(stated) == DEFAULTS[key], f"{where}: the docs say {key} defaults to {stated}; it is {DEFAULTS[key]!r}"


# --- handler settings in the docs' YAML ----------------------------------------------------------


def _handler_blocks() -> list[tuple[str, str, Any]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == "yaml":
                data = yaml.safe_load(textwrap.dedent(m.group(2))) or {}
                for name, layer in (data.get("handlers") or {}).items():
                    found.append((f"{doc.name}:{_line(text, m.start())}", name, layer))
    return found


# The shipped handlers' sections only: ``fix_typo`` and the like are the docs' own example handlers.
SHIPPED = {"math_agent", "math", "code", "swe", "search", "harness"}
HANDLER_BLOCKS = [b for b in _handler_blocks() if b[1] in SHIPPED]


def test_the_docs_have_handler_settings_to_check() -> None:
    assert {"harness", "swe", "code"} <= {name for _, name, _ in HANDLER_BLOCKS}


@pytest.mark.parametrize(("where", "name", "layer"), HANDLER_BLOCKS, ids=[f"{w} {n}" for w, n, _ in HANDLER_BLOCKS])
def test_a_handlers_block_in_the_docs_sets_real_settings(where: str, name: str, layer: Any) -> None:
    from prorl_cli.node.registry import discover
    from prorl_cli.node.settings import resolve_settings

    resolve_settings(discover([], only=[name]).get(name).defaults, (f"{where}: handlers.{name}", layer))


# --- what the README says the CI machine gets -------------------------------------------------------


def _readme_paragraph(start: str, end: str) -> str:
    text = " ".join((REPO / "README.md").read_text().split())
    return text[text.index(start) : text.index(end, text.index(start))]


def test_the_readme_names_every_provision_step() -> None:
    said = set(re.findall(r"\((\d\d)[,)]", _readme_paragraph("runs `scripts/provision.sh`", "`scripts/install.sh` then")))
    steps = {p.name[:2] for p in (REPO / "scripts" / "provision").glob("[0-9][0-9]-*.sh")}
    assert steps == said, f"scripts/provision/ has steps {sorted(steps - said)} the README does not name; it names {sorted(said - steps)} that are gone"


def test_the_readme_names_every_extra_install_sh_installs() -> None:
    (extras,) = re.findall(r'-e "\.\[([\w,]+)\]"', (REPO / "scripts" / "install.sh").read_text())
    said = _readme_paragraph("`scripts/install.sh` then installs", "The suite starts")
    missing = [e for e in extras.split(",") if f"`{e}`" not in said]
    assert not missing, f"scripts/install.sh installs the extras {missing} that the README's Development section leaves out"


# --- lists the docs say are complete ------------------------------------------------------------------


def test_observability_md_lists_every_metric_as_exposed() -> None:
    """"The Prometheus metrics (every name)": name (counters with ``_total``), type, labels as scraped
    (the broker adds ``node`` or ``backend`` to a peer's figures), and who reports it."""
    from prorl_cli.observe.metrics import FAMILIES, PEER_LABEL

    text = (REPO / "docs" / "observability.md").read_text()
    rows = {
        m.group(1): (m.group(2), tuple(re.findall(r"`(\w+)`", m.group(3))), m.group(4))
        for m in re.finditer(r"(?m)^\| `(prorl_\w+)` \| (\w+) \| ([^|]*) \| (\w+) \|", text)
    }
    for name, family in FAMILIES.items():
        exposed = f"{name}_total" if family.kind == "counter" else name
        labels = ((PEER_LABEL[family.source],) if family.source in PEER_LABEL else ()) + family.labels
        assert rows.pop(exposed, None) == (family.kind, labels, family.source), (
            f"docs/observability.md: {exposed} should read | {family.kind} | {', '.join(labels)} | {family.source} |"
        )
    assert not rows, f"docs/observability.md lists metrics that do not exist: {sorted(rows)}"


def test_protocol_md_names_every_op() -> None:
    from prorl_cli.protocol.framing import Op

    text = (REPO / "docs" / "protocol.md").read_text()
    assert not [op.value for op in Op if f"`{op.value}`" not in text], "docs/protocol.md leaves ops out"


def test_every_prorl_environment_variable_the_docs_name_is_read_somewhere() -> None:
    named = {v for doc in DOCS for v in re.findall(r"\bPRORL_[A-Z][A-Z_]*[A-Z]\b", doc.read_text())}
    sources = [
        p.read_text(errors="replace")
        for top in ("prorl_cli", "scripts", "benchmarks", "examples", "tests", ".ci")
        for p in (REPO / top).rglob("*")
        if p.is_file() and p.suffix in (".py", ".sh", "") and p.name != Path(__file__).name
    ]
    unread = sorted(v for v in named if not any(re.search(rf"\b{v}\b", s) for s in sources))
    assert "PRORL_HOME" in named and not unread, f"the docs name environment variables nothing reads: {unread}"


@pytest.mark.parametrize(
    ("record", "paragraph"),
    [("JobSpec",) * 2, ("JobResult",) * 2, ("SamplingParams",) * 2, ("StatusReport",) * 2,
     ("NodeStatus", "StatusReport"), ("BackendStatus", "StatusReport")],
)
def test_protocol_md_names_every_field_of_the_records(record: str, paragraph: str) -> None:
    """Each record's paragraph (``**JobSpec** ...``) names every field it carries (``repr=False`` ones are
    bookkeeping, such as which fields a sender gave)."""
    import prorl_cli.protocol.records as protocol

    text = (REPO / "docs" / "protocol.md").read_text()
    start = text.index(f"**{paragraph}**")
    said = text[start : text.find("\n\n", start)]
    missing = [f.name for f in dataclasses.fields(getattr(protocol, record)) if f.repr and f"`{f.name}`" not in said]
    assert not missing, f"docs/protocol.md's {record} leaves out {missing}"


def test_slurm_md_names_every_key_of_deploy_yaml() -> None:
    """docs/slurm.md's table of deploy.yaml: each section's row names its keys; "every role" the Slurm options."""
    from prorl_cli.slurm import deploy

    text = (REPO / "docs" / "slurm.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"(?m)^\| (top level|`\w+`|every role) \| (.*) \|$", text)}
    common = {f.name for f in dataclasses.fields(deploy.SlurmJobOptions)}
    sections = {
        "top level": {f.name for f in dataclasses.fields(deploy.DeployConfig)} - {"broker", "nodes", "inference", "source"},
        "`broker`": {f.name for f in dataclasses.fields(deploy.BrokerRole)} - common,
        "`nodes`": {f.name for f in dataclasses.fields(deploy.NodesRole)} - common,
        "`inference`": {f.name for f in dataclasses.fields(deploy.InferenceRole)} - common,
        "every role": common,
    }
    for row, keys in sections.items():
        missing = sorted(k for k in keys if not re.search(rf"`{k}[`:]", rows[row]))  # `key` or `key: value`
        assert not missing, f"docs/slurm.md: the deploy.yaml row {row} leaves out {missing}"


def test_harness_md_lists_every_harness_setting_with_its_default() -> None:
    from prorl_cli.handlers.harness import HarnessHandler

    defaults = HarnessHandler.defaults
    text = (REPO / "docs" / "harness.md").read_text()
    table = text[text.index("## The `harness` settings") :].split("\n## ", 1)[0]
    rows = dict(re.findall(r"(?m)^\| `(\w+)` \| ([^|]+) \|", table))
    for key in [*defaults.extra, "image", "max_tokens"]:
        assert key in rows, f"docs/harness.md's settings table leaves out {key}"
        stated = rows[key].strip()
        if not stated.startswith("("):  # (required), (auto): described, not a value
            expected = defaults.extra[key] if key in defaults.extra else getattr(defaults, key)
            assert yaml.safe_load(stated.strip("`")) == expected, f"docs/harness.md: {key} defaults to {expected!r}"


def test_training_md_lists_every_sampler_config_field() -> None:
    from prorl_cli.training.sampler import SamplerConfig

    text = (REPO / "docs" / "training.md").read_text()
    start = text.index("| `SamplerConfig` field")
    table = text[start : text.index("\n\n", start)]
    rows = " ".join(re.findall(r"(?m)^\| (`\w+`(?:, `\w+`)*) \|", table))
    missing = [f.name for f in dataclasses.fields(SamplerConfig) if f"`{f.name}`" not in rows]
    assert not missing, f"docs/training.md's SamplerConfig table leaves out {missing}"


def test_architecture_md_package_map_names_real_packages_and_files() -> None:
    """Each row's packages (``broker/``) and modules exist under prorl_cli/, the modules in the row's packages;
    and every package of prorl_cli/ has a row."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("| package | role | runs in |") :].split("\n\n", 1)[0]
    pkg_root = REPO / "prorl_cli"
    named: set[str] = set()
    for row in table.splitlines()[2:]:
        first, role = row.split("|")[1:3]
        packages = re.findall(r"`(\w+)/`", first)
        named.update(packages)
        for module in re.findall(r"`(\w+\.py)`", first):
            assert (pkg_root / module).is_file(), f"docs/architecture.md: no prorl_cli/{module}"
        for module in re.findall(r"`(\w+\.py)`", role):
            places = [pkg_root / p / module for p in packages] or [pkg_root / module]
            assert any(p.is_file() for p in places), f"docs/architecture.md: no {module} in {packages or ['prorl_cli']}"
    actual = {p.parent.name for p in pkg_root.glob("*/__init__.py")}
    assert actual <= named, f"docs/architecture.md's package map leaves out {sorted(actual - named)}"


def _context_calls() -> list[tuple[str, str, str, list[str]]]:
    """``ctx.<method>(...)`` and ``sb.`` / ``sandbox.`` / ``ctx.sandbox.<method>(...)`` calls of the Python snippets."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) != "python":
                continue
            for node in ast.walk(ast.parse(textwrap.dedent(m.group(2)))):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                owner = ast.unparse(node.func.value)
                kind = "JobContext" if owner == "ctx" else "Sandbox" if owner in ("sb", "sandbox", "ctx.sandbox") else None
                if kind is not None:
                    kws = [k.arg for k in node.keywords if k.arg is not None]
                    found.append((f"{doc.name}:{_line(text, m.start()) + node.lineno}", kind, node.func.attr, kws))
    return found


CONTEXT_CALLS = _context_calls()


def test_the_docs_have_context_calls_to_check() -> None:
    assert {("JobContext", "start_sandbox"), ("Sandbox", "bash"), ("Sandbox", "edit")} <= {
        (kind, method) for _, kind, method, _ in CONTEXT_CALLS
    }


@pytest.mark.parametrize(
    ("where", "kind", "method", "keywords"), CONTEXT_CALLS, ids=[f"{w} {k}.{m}" for w, k, m, _ in CONTEXT_CALLS]
)
def test_a_ctx_or_sandbox_call_in_the_docs_is_real(where: str, kind: str, method: str, keywords: list[str]) -> None:
    from prorl_cli.node.handler import JobContext
    from prorl_cli.sandbox import Sandbox

    cls = {"JobContext": JobContext, "Sandbox": Sandbox}[kind]
    assert hasattr(cls, method), f"{where}: {kind} has no {method}()"
    params = inspect.signature(getattr(cls, method)).parameters
    for kw in keywords:
        assert kw in params, f"{where}: {kind}.{method}() takes no {kw}= (it takes {list(params)[1:]})"


def test_domains_md_table_gives_each_domains_defaults() -> None:
    """docs/domains.md's "The domains' values": turns, stage limits, image, tools and tool limit per domain."""
    from prorl_cli.node.registry import discover

    text = (REPO / "docs" / "domains.md").read_text()
    start = text.index("| key | math | code | swe | search |")
    rows = {
        cells[0]: cells[1:]
        for line in text[start : text.index("\n\n", start)].splitlines()[2:]
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    registry = discover([], only=["math", "code", "swe", "search"])
    for col, name in enumerate(["math", "code", "swe", "search"]):
        d = registry.get(name).defaults

        def said(key: str, col: int = col) -> str:
            return rows[key][col]

        assert said("`max_turns`") == str(d.max_turns), f"domains.md: {name} max_turns is {d.max_turns}"
        limits = " / ".join(f"{v:g}" for v in (d.init_timeout_s, d.run_timeout_s, d.eval_timeout_s))
        assert said("`init_timeout_s` / `run_timeout_s` / `eval_timeout_s`") == limits, f"domains.md: {name}: {limits}"
        assert said("`image`").startswith(f"`{d.image}`" if d.image else "none"), f"domains.md: {name} image {d.image}"
        assert said("`tools`") == f"`[{', '.join(d.tools or ())}]`", f"domains.md: {name} tools {d.tools}"
        tool_s = said("`tool_timeout_s`")
        assert tool_s == (f"{d.tool_timeout_s:g}" if d.tool_timeout_s else tool_s if tool_s.startswith("none") else "none")
        for key, value in d.extra.items():
            stated = re.search(rf"`{key}` \(([^)]*)\)", said("domain keys"))
            assert re.search(rf"`{key}`", said("domain keys")), f"domains.md: {name}'s domain keys leave out {key}"
            if stated and isinstance(value, int | float) and not isinstance(value, bool):
                assert float(stated.group(1)) == value, f"domains.md: {name}.{key} defaults to {value}"


def test_handlers_md_lists_every_handler_setting_with_its_default() -> None:
    from prorl_cli.node.handler import HandlerSettings

    text = (REPO / "docs" / "handlers.md").read_text()
    start = text.index("| field | default | meaning |")
    stated: dict[str, str] = {}
    for keys, default in re.findall(r"(?m)^\| ((?:`\w+`(?:, )?)+) \| ([^|]+) \|", text[start : text.index("\n\n", start)]):
        for key in re.findall(r"`(\w+)`", keys):
            stated[key] = default.split("(")[0].strip().strip("`")
    defaults = HandlerSettings()
    for f in dataclasses.fields(HandlerSettings):
        assert f.name in stated, f"docs/handlers.md's settings table leaves out {f.name}"
        value = getattr(defaults, f.name)
        assert (None if stated[f.name] == "None" else yaml.safe_load(stated[f.name])) == value, (
            f"docs/handlers.md: HandlerSettings.{f.name} defaults to {value!r}"
        )
