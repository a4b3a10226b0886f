"""``deploy.yaml``: what ``prorl launch`` and ``prorl render-sbatch`` submit.

One section per role (``broker``, ``nodes``, ``inference``) plus ``setup``
lines run before every role. Validated with the same machinery as
``prorl.yaml`` (:func:`prorl_cli.config.section_from_dict`): errors name the
file and the dotted key. ``examples/deploy.yaml`` lists every key.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from prorl_cli import yamlfiles
from prorl_cli.config import ENV_HOME, ProrlConfig, home_folder, section_from_dict
from prorl_cli.exceptions import ConfigError

_TIME_RE = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+)(?::(\d+))?$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def time_minutes(value: str) -> int:
    """Slurm ``--time`` (``MM``, ``HH:MM:SS``, ``D-HH:MM``...) in whole minutes, at least 1."""
    m = _TIME_RE.match(value.strip())
    if not m:
        raise ValueError(f"{value!r} is not a Slurm time (MM, HH:MM:SS or D-HH:MM:SS)")
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:
        # D-HH, D-HH:MM, D-HH:MM:SS
        hours = parts[0] if parts else 0
        minutes = parts[1] if len(parts) > 1 else 0
        seconds = parts[2] if len(parts) > 2 else 0
        total_s = ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    elif len(parts) == 1:
        total_s = parts[0] * 60
    elif len(parts) == 2:
        total_s = parts[0] * 60 + parts[1]
    else:
        total_s = (parts[0] * 60 + parts[1]) * 60 + parts[2]
    return max(1, (total_s + 59) // 60)


#: sbatch options prorl sets itself from a role's keys (launch and render-sbatch alike): sbatch_options may not.
MANAGED_SBATCH_OPTIONS = {
    "time": "time",
    "signal": "signal_delay_s (the role drains on SIGUSR2 that long before the limit)",
    "cpus-per-task": "cpus_per_task",
    "job-name": "deployment (jobs are named prorl-<deployment>-<role>)",
    "array": "count and array_parallelism",
    "output": "log_dir",
    "error": "log_dir",
    "open-mode": "nothing (logs are appended to, so a requeued task keeps its log)",
    "requeue": "requeue",
    "no-requeue": "requeue",
}


@dataclass
class SlurmJobOptions:
    """Where and how long a role's Slurm job runs (sbatch options)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str = "24:00:00"
    cpus_per_task: int = 2
    mem_gb: float | None = None  # None: the cluster's default (DefMemPerCPU)
    # The warning before the time limit: SIGUSR2 this long before; the role drains and requeues.
    signal_delay_s: int = 120
    # Extra sbatch options, without the dashes: {exclude: "n3", exclusive: true}.
    sbatch_options: dict[str, Any] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)  # run before this role only, after the top-level setup

    def validate(self, where: str) -> None:
        # sbatch takes mail_type and mail-type alike; keep one spelling so the managed keys below are found.
        self.sbatch_options = {str(k).replace("_", "-"): v for k, v in self.sbatch_options.items()}
        for key, instead in MANAGED_SBATCH_OPTIONS.items():
            if key in self.sbatch_options:
                raise ConfigError(f"{where}.sbatch_options.{key}: set by prorl; use {instead}")
        try:
            time_minutes(self.time)
        except ValueError as e:
            raise ConfigError(f"{where}.time: {e}") from None
        if self.cpus_per_task < 1:
            raise ConfigError(f"{where}.cpus_per_task: must be at least 1, got {self.cpus_per_task}")
        if self.mem_gb is not None and self.mem_gb <= 0:
            raise ConfigError(f"{where}.mem_gb: must be positive, got {self.mem_gb}")
        if self.signal_delay_s < 0:
            raise ConfigError(f"{where}.signal_delay_s: must be 0 or more, got {self.signal_delay_s}")
        if self.signal_delay_s >= time_minutes(self.time) * 60:
            raise ConfigError(
                f"{where}.signal_delay_s: {self.signal_delay_s} s is not shorter than time {self.time!r}"
            )


@dataclass
class BrokerRole(SlurmJobOptions):
    """The broker: its own small Slurm job, or ``here`` (a process on the launching machine)."""

    where: Literal["slurm", "here"] = "slurm"
    # None: prorl.yaml's broker.bind_host when that file sets one, else 0.0.0.0 (peers on other hosts must
    # reach it; CURVE is on, as for every broker). One setting, so the two files cannot disagree.
    bind_host: str | None = None
    port: int = 0
    cpus_per_task: int = 1
    # A broker job that ended on its own (killed, FAILED, OUT_OF_MEMORY, NODE_FAIL) is replaced by its nodes and
    # bridges (its own supervisor died with it) at most this often, restart_backoff_s after it was seen ended
    # (doubling with each restart); the new broker replays the journal. Shorter than a task's: everything waits.
    max_restarts: int = 3
    restart_backoff_s: float = 10.0

    def validate(self, where: str) -> None:
        super().validate(where)
        if not 0 <= self.port < 65536:
            raise ConfigError(f"{where}.port: must be 0..65535, got {self.port}")
        _check_restarts(self.max_restarts, self.restart_backoff_s, where)


def _check_restarts(max_restarts: int, restart_backoff_s: float, where: str) -> None:
    if max_restarts < 0:
        raise ConfigError(f"{where}.max_restarts: must be 0 (never replace) or more, got {max_restarts}")
    if restart_backoff_s < 0:
        raise ConfigError(f"{where}.restart_backoff_s: must be 0 or more, got {restart_backoff_s}")


@dataclass
class ArrayRole(SlurmJobOptions):
    """A role submitted as a Slurm job array: one server per array task."""

    count: int = 0
    array_parallelism: int = 0  # at most this many tasks at once; 0: all
    requeue: bool = True  # preempted or timed-out tasks drain, are requeued and rejoin
    # A task that ended on its own (FAILED, NODE_FAIL, OUT_OF_MEMORY, TIMEOUT) is replaced under its name by the
    # broker job's supervisor at most this often per name, restart_backoff_s after it was seen ended (that wait
    # doubling with each restart of the name).
    max_restarts: int = 3
    restart_backoff_s: float = 30.0

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.count < 0:
            raise ConfigError(f"{where}.count: must be 0 or more, got {self.count}")
        if self.array_parallelism < 0:
            raise ConfigError(f"{where}.array_parallelism: must be 0 (all) or more, got {self.array_parallelism}")
        _check_restarts(self.max_restarts, self.restart_backoff_s, where)


@dataclass
class NodesRole(ArrayRole):
    """Node servers: one Slurm array task each."""

    count: int = 1
    # None: prorl.yaml's sandbox.runtime (default auto: Apptainer when it works, else bubblewrap, else local, warned about).
    sandbox_runtime: Literal["auto", "apptainer", "bwrap", "local"] | None = None
    sandbox_image: str = ""  # default image for handlers that name none
    handler_paths: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)  # serve only these; empty: all found
    n_init: int | None = None
    n_run: int | None = None
    n_eval: int | None = None

    def validate(self, where: str) -> None:
        super().validate(where)
        for name in ("n_init", "n_run", "n_eval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{where}.{name}: must be at least 1, got {value}")


@dataclass
class InferenceRole(ArrayRole):
    """Inference bridges: one array task per backend, ``gpus_per_task`` GPUs each (``--gres=gpu:N``).

    With several GPUs per task, one vLLM runs over all of them
    (``--tensor-parallel-size`` = the GPUs Slurm made visible, unless
    ``vllm_args`` sets it); for one backend per GPU, use ``gpus_per_task: 1``
    and a larger ``count``.
    """

    count: int = 0
    gpus_per_task: int = 1
    gres: str | None = None  # full --gres value instead of gpu:<gpus_per_task> (e.g. gpu:a100:1)
    model: str | None = None  # a local model directory on a shared filesystem (sim: optional, the name it serves)
    # sim: a simulated GPU server (no model, no GPU used; prorl.yaml's inference.sim_profile and sim_speedup), for
    # dry runs and planning a deployment on the cluster itself before its GPUs are spent on it.
    engine: Literal["vllm", "transformers", "sim"] = "vllm"
    vllm_args: list[str] = field(default_factory=list)
    capacity: int | None = None
    max_model_len: int | None = None

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.gpus_per_task < 0:
            raise ConfigError(f"{where}.gpus_per_task: must be 0 or more, got {self.gpus_per_task}")
        if self.count and not self.model and self.engine != "sim":
            raise ConfigError(f"{where}.model: required when count > 0 (a local model directory; "
                              f"engine sim needs none)")
        if self.vllm_args and self.engine != "vllm":
            raise ConfigError(f"{where}.vllm_args: only for engine vllm, engine is {self.engine!r}")


@dataclass
class DeployConfig:
    """The whole deployment file."""

    deployment: str = "default"
    home: str | None = None  # PRORL_HOME for every role (shared filesystem); None: $PRORL_HOME or ~/.prorl
    config: str | None = None  # prorl.yaml every role reads (relative to deploy.yaml)
    python: str | None = None  # interpreter in the jobs; None: the one running prorl launch
    log_dir: str | None = None  # Slurm logs; None: <home>/<deployment>/slurm
    rendezvous_wait_s: float = 600.0  # nodes and bridges wait this long for the broker's rendezvous file
    setup: list[str] = field(default_factory=list)  # shell lines before every role (module load, exports)
    broker: BrokerRole = field(default_factory=BrokerRole)
    nodes: NodesRole = field(default_factory=NodesRole)
    inference: InferenceRole = field(default_factory=InferenceRole)

    #: Where the file was read from (not a key).
    source: str = field(default="<deploy>", init=False, compare=False, repr=False)

    def validate(self, where: str = "") -> None:
        if not _NAME_RE.match(self.deployment):
            raise ConfigError(f"deployment: {self.deployment!r} is not a valid deployment name")
        if self.rendezvous_wait_s <= 0:
            raise ConfigError(f"rendezvous_wait_s: must be positive, got {self.rendezvous_wait_s}")
        if self.nodes.count + self.inference.count == 0:
            raise ConfigError("nodes.count: nothing to launch (nodes.count and inference.count are both 0)")

    @property
    def home_path(self) -> Path:
        return home_folder(self.home or os.environ.get(ENV_HOME) or ProrlConfig.home)

    @property
    def deployment_dir(self) -> Path:
        return self.home_path / self.deployment

    @property
    def log_path(self) -> Path:
        if self.log_dir:
            return Path(os.path.expandvars(os.path.expanduser(self.log_dir))).absolute()
        return self.deployment_dir / "slurm"

    @property
    def python_path(self) -> str:
        return self.python or sys.executable

    def role(self, name: str) -> SlurmJobOptions:
        return {"broker": self.broker, "nodes": self.nodes, "inference": self.inference}[name]


@dataclass(frozen=True)
class FileKind:
    """What a YAML file is taken for, a deploy.yaml or a prorl.yaml, and the keys that told.

    The two schemas share top-level sections (``broker``, ``inference``, ``deployment``, ``home``) whose keys
    mostly differ (``broker.where``, ``inference.count`` are deploy.yaml's; ``broker.heartbeat_interval_s``
    prorl.yaml's), so a file is judged by all its keys, nested ones included: a misspelt section name (``node:``
    for ``nodes:``) then no longer turns a deploy.yaml into a prorl.yaml with the valid keys blamed.
    """

    deploy: bool
    #: Dotted keys only deploy.yaml knows, and those only prorl.yaml knows (under a section both know, or at the
    #: top level: a section one schema lacks counts once, not once per key in it).
    deploy_keys: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()
    #: Keys the kind it was taken for does not know, each with the closest key it does know there ("" when none).
    unknown: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return "deploy.yaml" if self.deploy else "prorl.yaml"

    def describe(self) -> str:
        """Which kind it was taken for and why, for one line: ``a deploy.yaml (deploy.yaml-only keys: config, python,
        setup, broker.where (4); prorl.yaml-only: node (1); node: did you mean nodes?)``."""

        def some(keys: tuple[str, ...]) -> str:
            return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "") + f" ({len(keys)})"

        why = [f"{kind}-only keys: {some(keys)}" for kind, keys in (("deploy.yaml", self.deploy_keys),
                                                                       ("prorl.yaml", self.config_keys)) if keys]
        why = why or ["no key in it is deploy.yaml-only"]
        why += [f"{key}: did you mean {close}?" for key, close in self.unknown if close]
        return f"a {self.name} ({'; '.join(why)})"


def _field_names(obj: object) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if f.init]  # type: ignore[arg-type]


def _compare_keys(deploy: object, config: object, data: dict[Any, Any], prefix: str,
                  found: dict[str, list[tuple[str, str, str]]]) -> None:
    """Sort ``data``'s keys into ``found``: ``deploy`` / ``config`` (only that schema knows the key) or ``neither``,
    each as (dotted key, closest deploy.yaml key, closest prorl.yaml key); recursing into sections both know."""
    import difflib

    in_deploy, in_config = _field_names(deploy), _field_names(config)
    for key, value in data.items():
        name = str(key)
        dotted = f"{prefix}{name}"
        close_deploy, close_config = (next(iter(difflib.get_close_matches(name, known, n=1)), "")
                                      for known in (in_deploy, in_config))
        entry = (dotted, close_deploy, close_config)
        if name in in_deploy and name not in in_config:
            found["deploy"].append(entry)
        elif name in in_config and name not in in_deploy:
            found["config"].append(entry)
        elif name not in in_deploy:
            found["neither"].append(entry)
        elif isinstance(value, dict):
            sub_deploy, sub_config = getattr(deploy, name), getattr(config, name)
            if dataclasses.is_dataclass(sub_deploy) and dataclasses.is_dataclass(sub_config):
                _compare_keys(sub_deploy, sub_config, value, f"{dotted}.", found)


def file_kind(data: Any) -> FileKind:
    """Whether a file's YAML is a deploy.yaml or a prorl.yaml: the kind more of its keys (nested ones included)
    belong to alone; a tie (only shared keys, or none) is a prorl.yaml, the file every command reads. Both key
    sets come from the two schemas, so the rule follows them."""
    if not isinstance(data, dict):
        return FileKind(False)
    found: dict[str, list[tuple[str, str, str]]] = {"deploy": [], "config": [], "neither": []}
    _compare_keys(DeployConfig(), ProrlConfig(), data, "", found)
    deploy = len(found["deploy"]) > len(found["config"])
    # The keys the chosen schema will refuse, with what it would have taken (node -> nodes).
    refused = found["config"] if deploy else found["deploy"]
    unknown = tuple((key, close_deploy if deploy else close_config)
                    for key, close_deploy, close_config in [*refused, *found["neither"]])
    return FileKind(deploy, tuple(k for k, _, _ in found["deploy"]), tuple(k for k, _, _ in found["config"]), unknown)



def read_deploy_data(path: str | os.PathLike[str]) -> Any:
    """The YAML of a deploy file, read as :func:`load_deploy` reads it (errors name the file)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{file}: deployment file not found")
    try:
        return yamlfiles.load(file.read_text())  # an unquoted 24:00:00 stays a time, not base-60 86400
    except UnicodeDecodeError as e:
        raise ConfigError(f"{file}: not a UTF-8 text file ({e.reason} at byte {e.start})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: not valid YAML: {e}") from e


def deploy_from_dict(data: Any, origin: str = "<deploy>", deployment: str | None = None) -> DeployConfig:
    """Build and validate a :class:`DeployConfig`; ``deployment`` (``-d``) overrides the file's name.

    A role's ``time`` given as a number is minutes, as sbatch reads a bare number.
    """
    if deployment is not None:
        data = {**(data or {}), "deployment": deployment}
    if isinstance(data, dict):
        data = dict(data)
        for role in ("broker", "nodes", "inference"):
            section = data.get(role)
            if isinstance(section, dict) and type(section.get("time")) is int:
                data[role] = {**section, "time": str(section["time"])}
    cfg: DeployConfig = section_from_dict(DeployConfig, data, origin)
    cfg.source = origin
    return cfg


def load_deploy(path: str | os.PathLike[str], deployment: str | None = None) -> DeployConfig:
    """Read ``deploy.yaml``; relative paths in it (``config``, ``handler_paths``, ``model``, ``log_dir``) resolve
    against its folder, so every command of a deployment finds the same files from whatever folder it runs in."""
    file = Path(path)
    data = read_deploy_data(file)
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{file}: top level must be a mapping, got {type(data).__name__}")
    cfg = deploy_from_dict(data or {}, str(file), deployment)
    base = file.parent.absolute()

    def resolve(p: str) -> str:
        return str(base / os.path.expanduser(p)) if not os.path.isabs(os.path.expanduser(p)) else os.path.expanduser(p)

    if cfg.config:
        cfg.config = resolve(cfg.config)
        if not Path(cfg.config).is_file():
            raise ConfigError(f"{file}: config: {cfg.config} not found")
    # A dotted package name (prorl_cli.testing.handlers) names handlers wherever prorl is installed: kept as is.
    cfg.nodes.handler_paths = [
        p if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", p) and not (base / p).exists() else resolve(p)
        for p in cfg.nodes.handler_paths
    ]
    if cfg.inference.model:
        cfg.inference.model = resolve(cfg.inference.model)
    if cfg.log_dir:
        cfg.log_dir = resolve(os.path.expandvars(cfg.log_dir))
    return cfg


def deploy_snapshot(cfg: DeployConfig) -> dict[str, Any]:
    """``cfg`` as a plain mapping :func:`deploy_from_dict` rebuilds it from (paths already resolved)."""
    import dataclasses

    data = dataclasses.asdict(cfg)
    data.pop("source", None)
    return data


def dump_deploy(cfg: DeployConfig) -> str:
    """The effective deployment as YAML."""
    return yaml.safe_dump(deploy_snapshot(cfg), sort_keys=False)
