"""prorl.yaml: one schema with defaults, validated on load.

Errors name the file and the dotted key (``prorl.yaml: node.n_run: expected
int, got str 'eight'``). CLI flags override file values through
:func:`apply_overrides`. Sections owned by the sandbox, inference and image
subsystems live in their packages' ``settings`` modules.
"""

from __future__ import annotations

import dataclasses
import io
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from prorl_cli import yamlfiles
from prorl_cli.exceptions import ConfigError, one_line
from prorl_cli.images.settings import ImagesConfig
from prorl_cli.inference.settings import InferenceConfig
from prorl_cli.observe.logs import LOG_LEVELS, log_level_name
from prorl_cli.sandbox.settings import SandboxConfig

# Environment variables prorl reads, named once.
ENV_HOME = "PRORL_HOME"
ENV_CONFIG = "PRORL_CONFIG"
ENV_DEPLOYMENT = "PRORL_DEPLOYMENT"
ENV_LOG_LEVEL = "PRORL_LOG_LEVEL"
ENV_REQUIRE_ALL = "PRORL_REQUIRE_ALL"

DEFAULT_CONFIG_NAME = "prorl.yaml"


@dataclass
class BrokerConfig:
    """The ZeroMQ broker."""

    bind_host: str = "127.0.0.1"
    curve: Literal["auto", "on", "off"] = "auto"  # auto/on: encrypt and authenticate, loopback too; off: plain TCP
    port: int = 0  # 0: a free port, written to the rendezvous file
    heartbeat_interval_s: float = 1.0
    heartbeat_liveness: int = 3
    max_message_bytes: int = 64 * 1024 * 1024
    # Messages a peer may have waiting unread at the broker; past it the peer's own sends wait, so a flood of
    # big results stays with the nodes that made them and the broker's unread input is bounded.
    receive_window_messages: int = 16
    result_retention: int = 100_000  # finished results kept for late watchers (at most this many...)
    result_retention_mb: int = 1024  # ...and at most this many MB of them; the oldest go first
    dead_nodes_kept: int = 16  # dead nodes still listed in status (the most recent ones)
    journal: bool = True  # record jobs and results in <deployment>/broker.journal; a restarted broker replays it
    journal_fsync: bool = False  # fsync each write (survives a machine crash, not only a broker crash)
    journal_compact_mb: int = 256  # rewrite the journal with only what a replay needs once it grows past this
    # Which backend a generate call goes to: least_loaded_sticky (sticky per job, fewest live jobs),
    # round_robin (every call to the next backend), ever_assigned (the paper's: sticky, fewest jobs ever assigned).
    routing_policy: Literal["least_loaded_sticky", "round_robin", "ever_assigned"] = "least_loaded_sticky"
    # A job that ends cancels its generate calls at the engine; false is an ablation (stale calls keep running).
    cancel_propagation: bool = True
    # A job cancelled while it runs: its result waits this long for the node's own, which carries what the job
    # did so far (its partial trajectory); then (or at once with 0) the broker's result, without output, goes out.
    cancel_result_grace_s: float = 2.0
    # KV-cache admission (sticky policies): a new job's first call goes only to a backend whose live jobs' contexts
    # fill at most this share of the KV cache it reports (kv_capacity_tokens); 0 turns it off. Such a call waits
    # at the broker for room at most kv_admission_max_wait_s, then goes to the policy's choice anyway. The whole
    # cache by default: a young job reserves the mean context so far, more than it holds, so the cache keeps
    # headroom, and every job admitted makes the engines' batches larger (cheaper tokens).
    kv_admission: float = 1.0
    kv_admission_max_wait_s: float = 120.0
    # Serve Prometheus metrics of the whole deployment at http://metrics_host:metrics_port/metrics (nodes and
    # bridges send theirs in their heartbeats). None: off; 0: a free port (logged, and shown by `prorl status`).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"


@dataclass
class NodeConfig:
    """A node server: three stage pools and its handlers."""

    n_init: int = 8
    n_run: int = 32
    n_eval: int = 8
    credit: int = 0  # jobs held at once; 0 means n_init + n_run + n_eval
    handler_paths: list[str] = field(default_factory=list)  # extra handler files, folders or package names
    tasks: list[str] = field(default_factory=list)  # serve only these; empty: all found
    stop_grace_s: float = 5.0
    # On SIGUSR2 (a time-limit or preemption warning) running jobs get this long to finish and deliver; queued ones
    # are handed back at once. None: 90 s, or, launched on Slurm, the role's signal_delay_s minus 30 s for the requeue.
    drain_grace_s: float | None = None
    # The liveness sidecar stops vouching for a node whose event loop has been blocked this long.
    loop_stall_limit_s: float = 300.0


@dataclass
class JobsConfig:
    """Defaults for jobs that do not say otherwise."""

    timeout_s: float = 3600.0
    init_timeout_s: float | None = None
    run_timeout_s: float | None = None
    eval_timeout_s: float | None = None
    max_attempts: int = 3


@dataclass
class ProrlConfig:
    """The whole effective configuration."""

    deployment: str = "default"
    home: str = "~/.prorl"
    log_level: str = "INFO"  # one of LOG_LEVELS, any case (stored upper-case)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    # Per-task overrides of a handler's default settings, by task name
    # (e.g. {math: {max_turns: 8, image: /shared/math.sif}}); see docs/handlers.md.
    handlers: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The old name of ``handlers``, still read (with a deprecation warning naming the new key).
    domains: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The file this configuration was read from, as given (``--config``, ``$PRORL_CONFIG``, ``./prorl.yaml``), for
    #: errors about keys checked after loading (``handlers.<task>``, node settings): they must name the file the
    #: user edits. Not a field (no key of the file, not in ``to_dict``); set by :func:`load_config`.
    source = DEFAULT_CONFIG_NAME

    def __post_init__(self) -> None:
        if self.images.cache_dir is None:
            self.images.cache_dir = os.path.join(self.home, "images")

    @property
    def home_path(self) -> Path:
        return home_folder(self.home)

    @property
    def deployment_dir(self) -> Path:
        return self.home_path / self.deployment

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: The words YAML turns into each boolean, in the order a string choice prefers them.
_BOOL_WORDS: dict[bool, tuple[str, ...]] = {True: ("on", "yes", "true"), False: ("off", "no", "false")}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(tp))}"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null, got {value!r}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):
            # YAML 1.1 reads on/off, yes/no, true/false as booleans: take them back as the word the key documents.
            word = next((w for w in _BOOL_WORDS[value] if w in choices), None)
            if word is not None:
                return word
        elif value in choices:
            return value
        raise ConfigError(f"{where}: expected one of {list(choices)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        return {_coerce(k, key_tp, f"{where}"): _coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _build(cls: Any, data: Any, where: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'top level'}: expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where or 'top level'}: unknown key(s) {unknown}; known keys: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if callable(check):
        check(where)
    return obj


def _source(sources: Mapping[str, str], key: str, origin: str) -> str:
    """Where the dotted ``key`` (``node.tasks[0]``) came from: the nearest of it and its parents in ``sources``,
    else ``origin`` (the file)."""
    key = key.split("[", 1)[0]
    while key:
        if key in sources:
            return sources[key]
        key = key.rpartition(".")[0]
    return origin


def _validate(cfg: ProrlConfig, origin: str, sources: Mapping[str, str] | None = None) -> None:
    """Checks across fields. Each error names where its key came from: ``origin`` (the file), or what
    ``sources`` says for a key given elsewhere, so a bad ``-d`` or ``$PRORL_DEPLOYMENT`` is blamed on the flag
    or the variable, not on a prorl.yaml that never said it."""

    def at(key: str) -> str:
        return f"{_source(sources or {}, key, origin)}: {key}"

    level = log_level_name(cfg.log_level) if isinstance(cfg.log_level, str) else None
    if level is None:
        raise ConfigError(f"{at('log_level')}: expected one of {list(LOG_LEVELS)} (any case; WARN and FATAL too), "
                          f"got {cfg.log_level!r}")
    cfg.log_level = level  # one spelling for every source: the file, the variable and the flag
    for name in ("n_init", "n_run", "n_eval"):
        if getattr(cfg.node, name) < 1:
            raise ConfigError(f"{at(f'node.{name}')}: must be at least 1, got {getattr(cfg.node, name)}")
    if cfg.node.credit < 0:
        raise ConfigError(f"{at('node.credit')}: must be 0 (automatic) or positive")
    if not cfg.node.loop_stall_limit_s > 0:
        raise ConfigError(f"{at('node.loop_stall_limit_s')}: must be positive, got {cfg.node.loop_stall_limit_s}")
    if cfg.broker.heartbeat_interval_s <= 0:
        raise ConfigError(f"{at('broker.heartbeat_interval_s')}: must be positive")
    if cfg.broker.heartbeat_liveness < 1:
        raise ConfigError(f"{at('broker.heartbeat_liveness')}: must be at least 1")
    if not 0 <= cfg.broker.kv_admission <= 4:
        raise ConfigError(f"{at('broker.kv_admission')}: a share of the KV cache in [0, 4] (0: off), got {cfg.broker.kv_admission}")
    if cfg.broker.kv_admission_max_wait_s < 0:
        raise ConfigError(f"{at('broker.kv_admission_max_wait_s')}: must be >= 0, got {cfg.broker.kv_admission_max_wait_s}")
    if cfg.broker.receive_window_messages < 1:
        raise ConfigError(f"{at('broker.receive_window_messages')}: must be at least 1, got {cfg.broker.receive_window_messages}")
    if not 0 <= cfg.broker.port < 65536:
        raise ConfigError(f"{at('broker.port')}: must be 0..65535, got {cfg.broker.port}")
    if cfg.jobs.timeout_s <= 0:
        raise ConfigError(f"{at('jobs.timeout_s')}: must be positive")
    if not cfg.deployment or "/" in cfg.deployment or cfg.deployment.startswith("."):
        raise ConfigError(f"{at('deployment')}: {cfg.deployment!r} is not a valid deployment name")
    _check_home(cfg.home_path, _source(sources or {}, "home", origin))


def home_folder(home: str | os.PathLike[str]) -> Path:
    """The folder a prorl home setting names: ``~`` and ``$VARS`` expanded, absolute (a relative home is relative
    to the folder this process started in), so every path derived from it, and every message naming one, says
    where it really is. Every reading of a home (settings, deploy.yaml, ``--home``) goes through here."""
    return Path(os.path.expandvars(os.path.expanduser(os.fspath(home)))).absolute()


def _check_home(home: Path, origin: str) -> None:
    """``home`` (``PRORL_HOME``) must be a folder, or creatable as one: not a file, not under a file."""
    for path in (home, *home.parents):
        if path.exists():
            if not path.is_dir():
                what = "is a file" if path == home else f"is under {path}, which is a file"
                raise ConfigError(f"{origin}: home: {home} {what}; PRORL_HOME (or --home) must name a folder")
            return


def config_from_dict(data: Any, origin: str = "<config>", sources: Mapping[str, str] | None = None) -> ProrlConfig:
    """Build and validate a :class:`ProrlConfig`; errors are prefixed with ``origin``, or, for a top-level key
    given elsewhere (an environment variable, a flag), with where ``sources`` says it came from."""
    try:
        cfg = _build(ProrlConfig, data, "")
    except ConfigError as e:
        # _build's errors start with the dotted key they are about (or "top level").
        raise ConfigError(f"{_source(sources or {}, str(e).split(':', 1)[0], origin)}: {e}") from None
    _validate(cfg, origin, sources)
    return cfg


def find_config_file(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file to read: the explicit path, ``$PRORL_CONFIG``, or ``./prorl.yaml``."""
    for given, origin in ((explicit, ""), (os.environ.get(ENV_CONFIG), f" (from ${ENV_CONFIG})")):
        if not given:
            continue
        path = Path(given)
        if path.is_dir():
            raise ConfigError(f"{path}: a folder, not a config file{origin}")
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found{origin}")
        return path
    local = Path(DEFAULT_CONFIG_NAME)
    return local if local.is_file() else None


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    given_as: Mapping[str, str] | None = None,
) -> ProrlConfig:
    """Read, merge and validate the effective configuration.

    Order: defaults < file < environment (``PRORL_HOME``, ``PRORL_DEPLOYMENT``,
    ``PRORL_LOG_LEVEL``) < ``overrides`` (dotted keys, from CLI flags).
    ``given_as`` says where an override came from (``{"deployment": "-d"}``), for its errors; an override it
    does not name is reported as ``<overrides>``, a value from the environment by its variable.
    """
    file = find_config_file(path)
    data: dict[str, Any] = {}
    origin = str(file) if file else "<defaults>"
    if file is not None:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{file}: not a UTF-8 text file ({e.reason} at byte {e.start})") from e
        except OSError as e:
            raise ConfigError(f"{file}: cannot read: {e.strerror or e}") from e
        try:
            # A named stream, so the parser's position names the file rather than "<unicode string>".
            stream = io.StringIO(text)
            stream.name = str(file)
            loaded = yamlfiles.load(stream)
        except yaml.YAMLError as e:
            raise ConfigError(f"{file}: not valid YAML: {one_line(str(e))}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{file}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    env_map = {ENV_HOME: "home", ENV_DEPLOYMENT: "deployment", ENV_LOG_LEVEL: "log_level"}
    merged = {k: v for k, v in env_map.items() if os.environ.get(k)}
    all_overrides = {v: os.environ[k] for k, v in merged.items()}
    sources = {v: f"${k}" for k, v in merged.items()}
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    all_overrides.update(given)
    sources.update({k: (given_as or {}).get(k, "<overrides>") for k in given})
    data = apply_overrides(data, all_overrides)
    cfg = config_from_dict(data, origin, sources)
    if file is not None:
        cfg.source = str(file)
    return cfg


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted keys (``node.n_run``) set."""
    out = _deep_copy(data)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        cur = out
        for p in parts[:-1]:
            nxt = cur.get(p)
            if not isinstance(nxt, dict):
                nxt = {}
                cur[p] = nxt
            cur = nxt
        cur[parts[-1]] = value
    return out


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def dump_config(cfg: ProrlConfig) -> str:
    """The effective configuration as YAML (what ``prorl config show`` prints)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def section_from_dict(cls: Any, data: Any, origin: str) -> Any:
    """Build and validate any config dataclass (the ``deploy.yaml`` schema uses this too).

    Errors are prefixed with ``origin`` and name the dotted key.
    """
    try:
        return _build(cls, data, "")
    except ConfigError as e:
        raise ConfigError(f"{origin}: {e}") from None
