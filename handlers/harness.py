"""``harness``: an unmodified agent harness (mini-swe-agent, an OpenAI/Anthropic SDK program) as a task.

The harness runs inside the job's sandbox (no network) and talks to the
job's gateway (``prorl_cli.gateway``) through ``OPENAI_BASE_URL`` /
``ANTHROPIC_BASE_URL`` / ``OPENAI_API_KEY``, which point at a loopback port
the tool server relays to the node. Every model call is ``ctx.generate``,
recorded token-exactly. Settings (``handlers.harness`` in prorl.yaml, or an
instance's ``settings``; docs/harness.md)::

    image: harness                 # the sandbox image, with the harness installed
    # mini-swe-agent's -t takes the task text itself, not a file: read it from task_file.
    command: 'mini-swe-agent -t "$(cat {task_file})" -m openai/prorl -y --exit-immediately -l 0'
    env: {MSWEA_CONFIGURED: "true", MSWEA_COST_TRACKING: ignore_errors}
    workdir: /testbed
    timeout_s: 1800                # the harness is killed (its process group) past this
    scorer: swe                    # swe | code | math | none | "module:function"
    scorer_settings: {}            # the scorer domain's own settings (repo_dir, test_command, ...)
    workspace_max_mb: 256          # module:function scorers: the largest workdir copied out for them
    node_log_lines: 200            # output lines also copied to the node's log (all go to the job log)
    files: {/opt/agent: /shared/me/agent}   # the user's own program, copied in from the node at INIT
    model_aliases: [gpt-4o]        # more model names the endpoint accepts (a program that names its own)

The command finds the endpoint in ``OPENAI_BASE_URL`` / ``ANTHROPIC_BASE_URL`` (key: ``OPENAI_API_KEY``),
the model name in ``PRORL_GATEWAY_MODEL``, and the task file, workdir and job id in ``PRORL_TASK_FILE``,
``PRORL_WORKDIR`` and ``PRORL_JOB_ID``.

INIT starts the sandbox (for ``scorer: swe`` the repository is checked out at
``base_commit`` as the ``swe`` domain does) and writes the task text (the
instance's ``problem_statement``, ``question``, ``problem``, ``prompt`` or
``task``; of a verl-style row's chat ``prompt``, its last user message) to ``task_file``, and copies ``files``
in. RUN starts the command in its own process group,
streams its output to the job log, keeps the last ``log_tail_bytes`` in
``output["harness_log"]``, and saves the trajectory, the exit code and what
the scorer needs (``git diff`` for ``swe``, the solution file for ``code``,
the whole ``workdir`` for a ``module:function`` scorer, copied to the job's
run directory on the node, since the sandbox is stopped before EVAL).
The command runs as a script of its own, so its exit status is recorded
however it ends (``exit N``, ``exec prog``, ``set -e``). A harness that exits
non-zero keeps its partial trajectory with ``stop_reason`` ``error``, and
``trajectory.error`` (type ``HarnessExited``) and ``output["harness_error"]``
name the exit code; one that hangs past ``timeout_s``, is cancelled, or whose
recording shell is killed is killed with its process group, with
``stop_reason`` ``timeout``, ``cancelled`` or ``error``. Only the first
``node_log_lines`` lines of its output are also copied to the node's log.
EVAL runs the scorer, after every RUN that ended (a non-zero exit and
``timeout_s`` included; not after a cancel, or a RUN that raised, which the
node does not score): a ``module:function`` one is called as
``function(ctx, workspace)`` (the copied ``workdir``, a
:class:`~pathlib.Path`; ``None`` only when EVAL runs without RUN's copy, e.g.
called outside a node; a one-parameter function gets ``ctx`` alone) and
returns the reward. ``prorl serve node`` puts its working directory on
``sys.path``, so the module may be there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import logging
import os
import re
import shlex
import shutil
import socket
import sys
import tarfile
from pathlib import Path
from typing import Any

from prorl_cli import gateway
from prorl_cli.exceptions import DomainError, HarnessExited, SandboxError, ToolError
from prorl_cli.node.handler import AgentHandler, HandlerSettings, JobContext
from prorl_cli.node.settings import deployment_settings, resolve_settings
from prorl_cli.observe.logs import JobLogger

HARNESS_DIR = "/tmp/prorl-harness"
TASK_FIELDS = ("problem_statement", "question", "problem", "prompt", "task")
DOMAIN_SCORERS = ("swe", "code", "math")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_READ_CHUNK_BYTES = 1 << 20


def _domain_handler(name: str) -> AgentHandler:
    """The shipped domain handler ``name`` (its scorer and workspace set-up are reused)."""
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("prorl_cli.handlers."):
            for obj in vars(module).values():
                if inspect.isclass(obj) and issubclass(obj, AgentHandler) and obj.name == name:
                    return obj()
    from prorl_cli.node.registry import discover

    cls = discover().get(name)  # the node has not loaded it yet (a node restricted to some tasks)
    return cls()


def _as_domain(ctx: JobContext, domain: AgentHandler, settings: HandlerSettings) -> JobContext:
    """The job seen as a job of ``domain`` with ``settings``: same state, output and sandboxes, the domain's settings."""
    return dataclasses.replace(ctx, handler=domain, _settings=settings)


def expand_command(template: str, **values: str) -> str:
    """``{task_file}``, ``{workdir}`` and ``{model}`` replaced (shell-quoted); other braces left alone."""
    for key, value in values.items():
        template = template.replace("{" + key + "}", shlex.quote(value))
    return template


def _unpack(tar_path: Path, dest: Path) -> list[str]:
    """Extract ``tar_path`` into a fresh ``dest`` (then delete it); the names left out as unsafe."""
    skipped: list[str] = []

    def safe(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
        try:
            return tarfile.data_filter(member, path)
        except tarfile.FilterError:  # a link out of the copy, a device: not part of what a scorer reads
            skipped.append(member.name)
            return None

    shutil.rmtree(dest, ignore_errors=True)  # a retried RUN's earlier copy
    dest.mkdir(parents=True)
    try:
        with tarfile.open(tar_path) as tar:
            tar.extractall(dest, filter=safe)
    finally:
        tar_path.unlink()
    return skipped


def _last_line(output: bytes | bytearray) -> str:
    """``; its last line of output: '...'`` (the last non-blank line, cut to 200 characters), or ``""``."""
    lines = [line for line in bytes(output).decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1].strip()
    if len(line) > 200:
        line = line[:200] + "..."
    return f"; its last line of output: {line!r}"


def _files_to_copy(files: dict[str, Any], max_mb: float) -> list[tuple[Path, str, int | None]]:
    """The setting ``files`` (``{path in the sandbox: path on the node}``, a file or a folder each) as
    ``(node file, sandbox path, mode)`` to copy (a folder's empty folders with no mode); refused, naming the
    entry, when a path is not absolute, a source is missing, or all of it is over ``files_max_mb``."""
    copies: list[tuple[Path, str, int | None]] = []
    for target, raw in files.items():
        if not isinstance(raw, str) or not raw:
            raise DomainError(f"harness: files[{target!r}]: expected the path of a file or folder on the node, "
                              f"got {raw!r}")
        source = Path(raw).expanduser()
        if not target.startswith("/") or not source.is_absolute():
            raise DomainError(f"harness: files: {target!r}: {raw!r}: both paths must be absolute (the key is where "
                              "the copy goes in the sandbox, the value what to copy from the node)")
        if source.is_file():
            copies.append((source, target, source.stat().st_mode & 0o777))
        elif source.is_dir():
            base = target.rstrip("/")
            for folder, dirs, names in os.walk(source):  # links to folders are not followed (no loops)
                here = Path(folder)
                rel = here.relative_to(source).as_posix()
                dest = base if rel == "." else f"{base}/{rel}"
                if not dirs and not names:
                    copies.append((here, dest or "/", None))
                for name in sorted(names):
                    path = here / name
                    if path.is_file():  # a link to a file is copied as the file; other kinds are left out
                        copies.append((path, f"{dest}/{name}", path.stat().st_mode & 0o777))
        else:
            raise DomainError(f"harness: files: {raw!r} (for {target!r}) is not a file or folder on node "
                              f"{socket.gethostname()}")
    total = sum(source.stat().st_size for source, _, mode in copies if mode is not None)
    if total > max_mb * 2**20:
        raise DomainError(f"harness: files: {total / 2**20:.1f} MiB to copy into the sandbox, over "
                          f"files_max_mb={max_mb:g}; copy less (a folder's .venv or data), or raise the setting")
    return copies


def _chat_task(value: Any) -> str | None:
    """The text of the last user message of a chat-message list (a verl row's ``prompt``), else None."""
    if not isinstance(value, list):
        return None
    users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        return None
    content = users[-1]
    if isinstance(content, list):  # text parts
        texts = [p.get("text") if isinstance(p, dict) else p for p in content]
        if not all(isinstance(t, str) for t in texts):
            return None
        content = "\n".join(str(t) for t in texts)
    return content if isinstance(content, str) else None


def _model_names(settings: HandlerSettings) -> tuple[str, ...]:
    """``model`` then ``model_aliases``: the names the job's endpoint accepts (the first is ``{model}``)."""
    names = [settings.get("model"), *settings.get("model_aliases")]
    bad = [n for n in names if not isinstance(n, str) or not n.strip()]
    if bad:
        raise DomainError(f"harness: model and model_aliases must be non-empty strings, got {bad}")
    return tuple(dict.fromkeys(names))


#: Per scorer module name: its source file's (path, mtime_ns, size) when last imported; a change reloads it.
_SCORER_SOURCES: dict[str, tuple[str, int, int]] = {}


def _source_stamp(module: Any) -> tuple[str, int, int] | None:
    path = getattr(module, "__file__", None)
    if not path:
        return None
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return str(path), st.st_mtime_ns, st.st_size


def scorer_function(scorer: str) -> Any:
    """The function a ``module:function`` scorer names, its module imported (again, when its source file changed
    since the node last imported it: an edited scorer scores the next jobs, not the copy the node first read)."""
    module_name, _, attr = scorer.partition(":")
    importlib.invalidate_caches()  # a scorer module written after the node started is found too
    try:
        module = importlib.import_module(module_name)
        stamp = _source_stamp(module)
        known = _SCORER_SOURCES.get(module_name)
        if stamp is not None and known is not None and known != stamp:
            module = importlib.reload(module)
            stamp = _source_stamp(module)
        if stamp is not None:
            _SCORER_SOURCES[module_name] = stamp
        return getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise DomainError(f"harness: scorer {scorer!r} cannot be imported: {e}") from e
    except Exception as e:  # the module itself raised while it was imported (a syntax error, a failing import line)
        raise DomainError(f"harness: scorer {scorer!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e


def _reward(scorer: str, result: Any) -> float | None:
    """A scorer's return value as the reward: a number, or None (the reward left unset)."""
    if result is None:
        return None
    if not isinstance(result, str | bytes | bytearray | dict | list | tuple):
        try:
            return float(result)
        except (TypeError, ValueError):
            pass
    shown = repr(result)
    shown = shown if len(shown) <= 120 else shown[:120] + "..."
    raise DomainError(f"harness: scorer {scorer!r} returned {type(result).__name__} {shown}; it must return the "
                      "reward, a number (or None to leave it unset); put anything else in ctx.output")


def _scorer_args(fn: Any, ctx: JobContext, workspace: Path | None) -> tuple[Any, ...]:
    """``(ctx, workspace)``, or ``(ctx,)`` for a scorer that takes one argument."""
    try:
        inspect.signature(fn).bind(ctx, workspace)
    except TypeError:
        return (ctx,)
    except ValueError:  # no signature to inspect (a builtin): the documented form
        pass
    return (ctx, workspace)


class _OutputLog:
    """The harness's output, line by line, into the job log; only its first lines into the node's log too.

    The job log keeps every line (docs/harness.md). The node's log serves every job of the node, so a chatty
    agent must not flood it: past ``node_lines`` lines a job's output goes to its job log only, and one line
    in the node's log says how many lines it holds there.
    """

    def __init__(self, ctx: JobContext, node_lines: int) -> None:
        self._ctx = ctx
        self._node_lines = max(0, node_lines)
        self._lines = 0
        self._partial = b""

    def write(self, chunk: bytes) -> None:
        """Log the whole lines of ``chunk`` (a line cut at its end waits for the rest)."""
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._line(line)

    def close(self) -> None:
        """Log a last line with no newline, and how many lines the node's log left out."""
        if self._partial:
            self._line(self._partial)
            self._partial = b""
        hidden = self._lines - self._node_lines
        if hidden > 0:
            log = self._ctx.log
            where = f"the job log ({log.path})" if isinstance(log, JobLogger) else "the job's logger at DEBUG"
            log.info("job %s harness: %d more line(s) of output after the first %d went to %s only",
                     self._ctx.job_id, hidden, self._node_lines, where)

    def _line(self, line: bytes) -> None:
        self._lines += 1
        log, text = self._ctx.log, line.decode("utf-8", "replace")
        if self._lines <= self._node_lines:
            log.info("job %s harness| %s", self._ctx.job_id, text)
        elif isinstance(log, JobLogger):
            log.note(logging.INFO, "job %s harness| %s", self._ctx.job_id, text)
        else:  # a logger with no job file of its own (a handler run outside a node): below the usual level
            log.debug("job %s harness| %s", self._ctx.job_id, text)


class _Output:
    """The harness's output file, read from where the last read stopped: into the job log, and its last
    ``keep`` bytes into :attr:`tail` (``output["harness_log"]``)."""

    def __init__(self, ctx: JobContext, sandbox: Any, path: str, keep: int, node_lines: int) -> None:
        self._sandbox = sandbox
        self._path = path
        self._keep = keep
        self._log = _OutputLog(ctx, node_lines)
        self._offset = 0
        self.tail = bytearray()

    async def read(self) -> None:
        """Everything written since the last read."""
        while chunk := await self._sandbox.read_file(self._path, offset=self._offset, max_bytes=_READ_CHUNK_BYTES):
            self._offset += len(chunk)
            self.tail += chunk
            del self.tail[: max(0, len(self.tail) - self._keep)]
            self._log.write(chunk)

    def close(self) -> None:
        self._log.close()


class _InRoot:
    """A file of the job's harness folder: on a :class:`_Paths`, ``script = _InRoot("run.sh")`` reads as
    ``f"{paths.root}/run.sh"``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, paths: _Paths, owner: object = None) -> str:
        return f"{paths.root}/{self.name}"


@dataclasses.dataclass(frozen=True)
class _Paths:
    """Where one job's harness files are in its sandbox.

    A sandbox has a /tmp of its own, so every job uses the same names there. The local runtime has none:
    jobs running side by side on one node would share (and overwrite) the task file, the script, the log
    and the exit-code file, and the first job to exit would end every other. There each job gets a folder
    of its own, and the ``task_file`` and ``workdir`` defaults move into it (values a user set are kept).
    """

    root: str
    task_file: str
    workdir: str

    script = _InRoot("run.sh")  # what the node starts: exports, then the command, then its exit code to rc
    command = _InRoot("command.sh")  # the user's command, a script of its own
    log = _InRoot("output.log")
    rc = _InRoot("exit_code")
    workspace_tar = _InRoot("workspace.tar")

    @classmethod
    def of(cls, job_id: str, runtime: str, settings: HandlerSettings, defaults: HandlerSettings) -> _Paths:
        task_file, workdir = str(settings.get("task_file")), str(settings.get("workdir"))
        if runtime != "local":
            return cls(HARNESS_DIR, task_file, workdir)
        root = f"{HARNESS_DIR}-{hashlib.blake2b(job_id.encode(), digest_size=8).hexdigest()}"
        return cls(root, f"{root}/task.md" if task_file == defaults.get("task_file") else task_file,
                   f"{root}/work" if workdir == defaults.get("workdir") else workdir)


class HarnessHandler(AgentHandler):
    """Runs an agent harness command in the sandbox against the job's gateway; scores with a domain's scorer."""

    name = "harness"
    defaults = HandlerSettings(
        max_turns=1000, system_prompt="", tools=(), image="python",
        init_timeout_s=300.0, run_timeout_s=3600.0, eval_timeout_s=1800.0, max_tokens=2048,
        extra={"command": "", "env": {}, "workdir": "/work", "timeout_s": 1800.0, "scorer": "none",
               "scorer_settings": {}, "task_file": "/tmp/prorl-task.md", "task_field": "", "parser": "hermes",
               "model": "prorl", "model_aliases": [], "log_tail_bytes": 8192, "poll_s": 0.5,
               "max_concurrent_requests": 8, "workspace_max_mb": 256.0, "node_log_lines": 200,
               "tool_choice_retries": 2, "files": {}, "files_max_mb": 64.0},
    )

    # ------------------------------------------------------------------ INIT
    def scorer_settings(self, ctx: JobContext, settings: HandlerSettings, domain: AgentHandler) -> HandlerSettings:
        """The scorer domain's settings: its defaults, ``handlers.<scorer>``, then ``scorer_settings``."""
        own = dict(settings.get("scorer_settings"))
        own.setdefault("image", settings.image)
        return resolve_settings(
            domain.defaults,
            deployment_settings(ctx.config, domain.name),
            (f"harness scorer_settings of job {ctx.job_id}", own),
        )

    def _task_text(self, ctx: JobContext, settings: HandlerSettings) -> str:
        field = settings.get("task_field")
        names = (field,) if field else TASK_FIELDS
        for name in names:
            value = ctx.instance.get(name)
            if isinstance(value, str):
                return value
            text = _chat_task(value)
            if text is not None:  # a verl-style row: ``prompt`` holds the chat messages
                return text
        present = {name: type(ctx.instance[name]).__name__ for name in names if name in ctx.instance}
        found = f"; the instance has {present}" if present else f"; the instance's fields: {sorted(ctx.instance)[:20]}"
        raise DomainError(f"harness: the instance has no task text (a string field among {list(names)}, or a "
                          f"list of chat messages with a user message as verl rows' `prompt`){found}; the setting "
                          "task_field names another field")

    async def init(self, ctx: JobContext) -> None:
        settings = ctx.settings
        if not settings.get("command"):
            raise DomainError("harness: settings.command is empty "
                              "(e.g. 'mini-swe-agent -t \"$(cat {task_file})\" -m openai/prorl -y ...')")
        bad = [k for k in settings.get("env") if not _ENV_NAME.match(k)]
        if bad:
            raise DomainError(f"harness: env names {bad} are not valid variable names")
        scorer = str(settings.get("scorer"))
        task = self._task_text(ctx, settings)
        _model_names(settings)  # checked before a sandbox starts
        copies = await asyncio.to_thread(_files_to_copy, settings.get("files"), float(settings.get("files_max_mb")))
        if scorer == "swe":
            swe = _domain_handler("swe")
            # The swe domain's own set-up: the repository at base_commit, a clean work tree.
            swe_settings = self.scorer_settings(ctx, settings, swe)
            scrub = bool(swe_settings.get("scrub_history"))
            sandbox = await swe._sandbox(_as_domain(ctx, swe, swe_settings), swe_settings, scrub)  # type: ignore[attr-defined]
        else:
            options: dict[str, Any] = {"network": False}
            if settings.image:
                options["image"] = settings.image
            sandbox = await ctx.start_sandbox(**options)
        ctx.sandbox = sandbox  # the swe set-up started it on the domain's view of the job
        paths = _Paths.of(ctx.job_id, getattr(sandbox, "runtime", ""), settings, self.defaults)
        ctx.state["harness_paths"] = paths
        made = await sandbox.bash(f"mkdir -p {shlex.quote(paths.workdir)} {shlex.quote(paths.root)} 2>&1")
        if made.exit_code != 0:
            raise DomainError(f"harness: cannot make the workdir {paths.workdir}: {made.output[-500:]}")
        await sandbox.write_file(paths.task_file, task.encode())
        for source, target, mode in copies:
            try:
                if mode is None:  # an empty folder of a copied folder
                    made = await sandbox.bash(f"mkdir -p {shlex.quote(target)} 2>&1")
                    if made.exit_code != 0:
                        raise DomainError(f"harness: files: cannot make {target} in the sandbox: {made.output[-300:]}")
                else:
                    await sandbox.write_file(target, await asyncio.to_thread(source.read_bytes), mode=mode)
            except (OSError, ToolError) as e:
                raise DomainError(f"harness: files: cannot copy {source} to {target} in the sandbox: {e}") from e
        ctx.output["sandboxes"] = {"run": sandbox.sandbox_id}

    # ------------------------------------------------------------------- RUN
    async def run(self, ctx: JobContext) -> None:
        settings = ctx.settings
        sandbox = ctx.sandbox
        job = await gateway.session(ctx, parser=str(settings.get("parser")), models=_model_names(settings),
                                    sampling=ctx.agent_sampling(),
                                    max_concurrent=int(settings.get("max_concurrent_requests")),
                                    tool_choice_retries=int(settings.get("tool_choice_retries")))
        host_sock, inside_sock = sandbox.gateway_socket()
        await job.serve_unix(host_sock)
        host, port = await sandbox.relay(inside_sock)
        paths: _Paths = ctx.state["harness_paths"]
        # Where the task and the workdir are: the runtime decides (the local runtime moves the defaults into a
        # folder of the job's own), so a program reads them here rather than from a path written into it.
        where = {"PRORL_TASK_FILE": paths.task_file, "PRORL_WORKDIR": paths.workdir, "PRORL_JOB_ID": ctx.job_id}
        env = {**{k: str(v) for k, v in settings.get("env").items()}, **where, **job.env(host, port)}
        command = expand_command(str(settings.get("command")), task_file=paths.task_file,
                                 workdir=paths.workdir, model=str(settings.get("model")))
        # The command runs as a script of its own, in a child shell: its `exit N`, `exec prog` or `set -e`
        # ends that shell only, so the line after it always records the exit status. It inherits the
        # exports, the working directory, stdin and the process group of run.sh.
        await sandbox.write_file(paths.command, (command + "\n").encode())
        script = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        script += [f"if cd {shlex.quote(paths.workdir)}; then sh {paths.command}; rc=$?; else rc=97; fi",
                   f"echo $rc > {paths.rc}.tmp && mv {paths.rc}.tmp {paths.rc}"]
        await sandbox.write_file(paths.script, ("\n".join(script) + "\n").encode())
        # A background job of the tool server's interactive shell gets a process group of its own: $! is its id.
        started = await sandbox.bash(f"rm -f {paths.rc}; : > {paths.log}; sh {paths.script} >> {paths.log} 2>&1 "
                                     "< /dev/null & echo $!")
        try:
            pgid = int(started.output.strip().splitlines()[-1])
        except (ValueError, IndexError) as e:
            raise DomainError(f"harness: could not start the command: {started.output[-500:]}") from e
        ctx.state["harness_pgid"] = pgid
        output = _Output(ctx, sandbox, paths.log, int(settings.get("log_tail_bytes")), int(settings.get("node_log_lines")))
        tail = output.tail
        stop_reason, exit_code, error = "cancelled", None, None
        try:
            try:
                exit_code, stop_reason, error = await self._follow(ctx, sandbox, settings, paths, pgid, output)
            finally:
                if exit_code is None:  # timed out, cancelled, or its shell vanished: what it started may still run
                    with contextlib.suppress(SandboxError, OSError):
                        await asyncio.shield(self._kill(sandbox, pgid))
                # What it printed since the last poll: on a kill, what a SIGTERM handler printed (where it hung).
                with contextlib.suppress(SandboxError, ToolError, OSError):
                    await asyncio.shield(output.read())
                output.close()
                traj = ctx.trajectory = job.trajectory
                traj.stop_reason = stop_reason
                if error is not None:
                    # As ctx.agent() records the error that ended its loop: the job is still scored (EVAL), and
                    # this is how the result (and `prorl submit`'s summary) tells a crashed agent from a clean run.
                    traj.error = {"call": len(traj.calls), "type": HarnessExited.__name__, "message": error}
                ctx.output.update({
                    "trajectory": traj.to_dict(), "turns": len(traj.calls), "stop_reason": stop_reason,
                    "harness_exit_code": exit_code, "harness_error": error,
                    "harness_log": tail.decode("utf-8", "replace"),
                    "continuity": job.buffer.continuity, "segments": job.buffer.conversations,
                })
                await job.close()
            await self._save_artifacts(ctx, settings, sandbox)
        finally:
            if paths.root != HARNESS_DIR:  # the local runtime's folder of this job is on the host: gone with it
                with contextlib.suppress(SandboxError, OSError):
                    await asyncio.shield(sandbox.bash(f"rm -rf {shlex.quote(paths.root)}", timeout_s=60))

    async def _follow(
        self, ctx: JobContext, sandbox: Any, settings: HandlerSettings, paths: _Paths, pid: int, output: _Output
    ) -> tuple[int | None, str, str | None]:
        """Stream the harness's output to the job log until it exits, vanishes or runs past ``timeout_s``.

        Returns ``(exit code, stop reason, error)``: the exit code is ``None`` when none was recorded;
        ``error`` (else ``None``) says why the harness ended in error: the non-zero exit code and its last
        line of output, or that its shell (``pid``, run.sh) ended without recording an exit code.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(settings.get("timeout_s"))
        while True:
            # Whether run.sh lives is read before its exit-code file: a shell found gone had written the
            # file already if it ever would, so "gone and no file" is final, not a race with its last line.
            alive = await self._alive(sandbox, pid)
            try:
                rc_text = (await sandbox.read_file(paths.rc)).decode().strip()
            except ToolError:
                rc_text = ""  # still running
            await output.read()  # everything written so far, including after the exit code appeared
            if rc_text:
                code = int(rc_text)
                if code == 0:
                    return code, "stop", None
                error = f"the harness exited with code {code}{_last_line(output.tail)}"
                ctx.log.warning("harness: %s", error)
                return code, "error", error
            if not alive:
                error = (f"the harness's shell (pid {pid}) ended without recording an exit code "
                         "(killed by a signal, e.g. the out-of-memory killer or a `kill` of its process group)")
                ctx.log.warning("harness: %s", error)
                return None, "error", error
            if loop.time() >= deadline:
                ctx.log.warning("harness: still running after timeout_s=%g s; killing its process group (SIGTERM, "
                                "SIGKILL 2 s later)", float(settings.get("timeout_s")))
                return None, "timeout", None
            await asyncio.sleep(float(settings.get("poll_s")))

    @staticmethod
    async def _alive(sandbox: Any, pid: int) -> bool:
        """Whether process ``pid`` of the sandbox still runs (a zombie, not yet reaped, has ended)."""
        try:
            stat = await sandbox.read_file(f"/proc/{pid}/stat")
        except ToolError:
            return False
        # The state is the field after the command name, which is in parentheses and may hold any character.
        fields = stat.rpartition(b")")[2].split()
        return bool(fields) and fields[0] not in (b"Z", b"X")

    @staticmethod
    async def _kill(sandbox: Any, pgid: int) -> None:
        """SIGTERM the harness's process group, SIGKILL what is left after 2 s."""
        await sandbox.bash(f"kill -TERM -- -{pgid} 2>/dev/null; for i in 1 2 3 4 5 6 7 8 9 10; do "
                           f"kill -0 -- -{pgid} 2>/dev/null || break; sleep 0.2; done; "
                           f"kill -KILL -- -{pgid} 2>/dev/null; true", timeout_s=10)

    async def _save_artifacts(self, ctx: JobContext, settings: HandlerSettings, sandbox: Any) -> None:
        """What the scorer reads: the diff against ``base_commit`` (swe) or the solution file (code)."""
        scorer = str(settings.get("scorer"))
        if scorer == "swe":
            swe = self.scorer_settings(ctx, settings, _domain_handler("swe"))
            repo_dir = shlex.quote(str(swe.get("repo_dir")))
            base = shlex.quote(str(ctx.instance["base_commit"]))
            diff = await sandbox.bash(f"cd {repo_dir} && git add -A && git diff --cached --binary {base} "
                                      "> /tmp/model.patch")
            if diff.exit_code != 0:
                raise DomainError(f"harness: git diff against base_commit failed: {diff.output[-1000:]}")
            ctx.output["model_patch"] = (await sandbox.read_file("/tmp/model.patch")).decode("utf-8", "replace")
        elif scorer == "code":
            path = str(self.scorer_settings(ctx, settings, _domain_handler("code")).get("solution_path"))
            try:
                ctx.output["solution"] = (await sandbox.read_file(path)).decode("utf-8", "replace")
                ctx.output["solution_source"] = path
            except SandboxError:
                ctx.output["solution"], ctx.output["solution_source"] = None, None
        elif ":" in scorer:
            ctx.state["workspace"] = str(await self._save_workspace(ctx, settings, sandbox))

    async def _save_workspace(self, ctx: JobContext, settings: HandlerSettings, sandbox: Any) -> Path:
        """Copy ``workdir`` out of the sandbox into ``<job run dir>/workspace``; returns that folder.

        A ``module:function`` scorer runs in EVAL, after the node has stopped the sandbox, so what the
        agent wrote is only readable from a copy. Links that point outside the copy, device files and
        the like are left out (with a warning), as :func:`tarfile.data_filter` refuses them.
        """
        paths: _Paths = ctx.state["harness_paths"]
        workdir, tar = paths.workdir, paths.workspace_tar
        max_mb = float(settings.get("workspace_max_mb"))
        packed = await sandbox.bash(f"tar -C {shlex.quote(workdir)} -cf {tar} . 2>&1 && wc -c < {tar}", timeout_s=600)
        if packed.exit_code != 0:
            raise DomainError(f"harness: cannot pack the workdir {workdir} for the scorer: {packed.output[-500:]}")
        size_bytes = int(packed.output.split()[-1])
        if size_bytes > max_mb * 2**20:
            await sandbox.bash(f"rm -f {tar}")
            raise DomainError(f"harness: the workdir {workdir} is {size_bytes / 2**20:.1f} MiB (as a tar), over "
                              f"workspace_max_mb={max_mb:g}; raise the setting or have the command clean up")
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        dest, tar_path = ctx.run_dir / "workspace", ctx.run_dir / "workspace.tar"
        with tar_path.open("wb") as out:
            while chunk := await sandbox.read_file(tar, offset=out.tell(), max_bytes=_READ_CHUNK_BYTES):
                out.write(chunk)
        await sandbox.bash(f"rm -f {tar}")
        skipped = await asyncio.to_thread(_unpack, tar_path, dest)
        if skipped:
            ctx.log.warning("harness: %d entries of %s not copied for the scorer (outside the workdir or not "
                            "regular files), e.g. %s", len(skipped), workdir, skipped[:5])
        return dest

    # ------------------------------------------------------------------ EVAL
    async def eval(self, ctx: JobContext) -> None:
        settings = ctx.settings
        scorer = str(settings.get("scorer"))
        ctx.output["scorer"] = scorer
        if scorer == "none":
            ctx.reward = 0.0
        elif scorer in DOMAIN_SCORERS:
            domain = _domain_handler(scorer)
            view = _as_domain(ctx, domain, self.scorer_settings(ctx, settings, domain))
            await domain.eval(view)
            ctx.reward = view.reward
        elif ":" in scorer:
            workspace = Path(ctx.state["workspace"]) if ctx.state.get("workspace") else None
            try:
                fn = scorer_function(scorer)
                try:
                    result = fn(*_scorer_args(fn, ctx, workspace))
                    if inspect.isawaitable(result):
                        result = await result
                except Exception as e:
                    # The user's code: its traceback to the job log, its error named after the scorer in the result.
                    ctx.log.error("harness: scorer %r raised", scorer, exc_info=True)
                    raise DomainError(f"harness: scorer {scorer!r} raised {type(e).__name__}: {e}") from e
            finally:
                if workspace is not None:  # the copy lives on the node's disk: only for the scorer
                    await asyncio.to_thread(shutil.rmtree, workspace, True)
            reward = _reward(scorer, result)
            if reward is not None:
                ctx.reward = reward
        else:
            raise DomainError(f"harness: unknown scorer {scorer!r}; use swe, code, math, none or 'module:function'")
