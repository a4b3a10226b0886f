"""The sbatch options and submission of each role: what ``prorl launch``, the supervisor and ``render-sbatch`` share.

``sbatch_options`` is the one place a role's Slurm options are computed
(``render-sbatch`` writes them into scripts, ``launch`` hands them to
submitit); :func:`submit_role` submits tasks of a role (the launcher's first
submission, the supervisor's replacements).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prorl_cli.config import ENV_HOME, ProrlConfig, apply_overrides, config_from_dict, load_config
from prorl_cli.exceptions import ConfigError, SlurmError
from prorl_cli.slurm.deploy import DeployConfig, time_minutes
from prorl_cli.slurm.record import Member
from prorl_cli.slurm.roles import RoleSpec, submitted_role
from prorl_cli.slurm.squeue import partition_preemption

log = logging.getLogger(__name__)

#: What a node's drain on USR2 leaves of ``signal_delay_s`` for stopping the rest, unregistering and the requeue.
DRAIN_REQUEUE_MARGIN_S = 30


def prorl_config(cfg: DeployConfig) -> ProrlConfig:
    """The prorl.yaml every role of this deployment reads, with its home and name."""
    home_from = cfg.source if cfg.home else f"${ENV_HOME}" if os.environ.get(ENV_HOME) else "<defaults>"
    return load_config(cfg.config, {"home": str(cfg.home_path), "deployment": cfg.deployment},
                       given_as={"home": home_from, "deployment": cfg.source})


def node_config(cfg: DeployConfig) -> ProrlConfig:
    """What a node task of this deployment runs with: the roles' prorl.yaml plus the deploy file's node settings."""
    base = prorl_config(cfg).to_dict()
    return config_from_dict(apply_overrides(base, role_spec(cfg, "nodes").overrides), cfg.source)


def node_start_check(cfg: DeployConfig) -> tuple[list[str], list[str]]:
    """``(errors, warnings)``: the check ``prorl serve node`` makes at start, made here before anything is queued,
    so a misspelt ``handlers.<task>`` key does not wait in Slurm's queue to stop every node task.

    Bad settings of a handler that loads here are errors. A handler that does not load here is a warning: the
    nodes have their own Python and paths (``python``, ``handler_paths`` on node-local storage), where it may.
    So is a partition whose preemption GraceTime shortens the nodes' drain (:func:`preemption_warnings`).
    """
    from prorl_cli.node.registry import discover

    if not cfg.nodes.count:
        return [], []
    config = node_config(cfg)
    registry = discover(config.node.handler_paths, config.node.tasks or None)
    warnings = [f"{error} (the node tasks will refuse to start unless it loads on their machines)"
                for error in registry.errors]
    return registry.settings_errors(config), [*warnings, *preemption_warnings(cfg)]


def preemption_warnings(cfg: DeployConfig) -> list[str]:
    """Where a partition the nodes may run in preempts with a GraceTime that shortens their drain.

    One USR2 serves both the time-limit warning and a preemption (``preempt_send_user_signal``). A preemption
    sets the job's end to now + the partition's GraceTime, and a node bounds any drain by its job's end less a
    margin (:func:`prorl_cli.node.server.drain_grace_within`): a preempted node drains for that long at most,
    not ``node.drain_grace_s``, then stops the jobs still running (they run again elsewhere, a new attempt) and
    leaves before Slurm stops it; queued jobs go back at once, keeping their attempt. The time-limit and
    ``scale`` drains keep their grace. Said so the user knows what a preemption costs running jobs; nothing to
    fix in prorl's settings (a longer grace would be cut all the same). Only a partition with a GraceTime above
    0 is looked at (one with none kills at once, and a cluster-wide PreemptMode shows on every partition,
    preempted or not). Slurm that cannot be asked says nothing.
    """
    from prorl_cli.node.server import drain_grace_within

    partition = sbatch_options(cfg, "nodes").get("partition")
    if not cfg.nodes.count or not partition:
        return []
    try:
        preemption = partition_preemption()
    except (SlurmError, OSError) as e:
        log.debug("cannot read the partitions' preemption settings: %s", e)
        return []
    configured = prorl_config(cfg).node.drain_grace_s
    grace_s = node_drain_grace_s(cfg)
    key = "sbatch_options.partition" if "partition" in cfg.nodes.sbatch_options else "partition"
    source = ("prorl.yaml's node.drain_grace_s" if configured is not None
              else f"nodes.signal_delay_s {cfg.nodes.signal_delay_s} s - {DRAIN_REQUEUE_MARGIN_S} s")
    warnings = []
    for name in str(partition).split(","):  # sbatch takes a list: the job runs in whichever takes it first
        p = preemption.get(name)
        if p is None or not p.stops_jobs or not p.grace_time_s:
            continue
        bound = drain_grace_within(grace_s, float(p.grace_time_s))
        if not bound.by_job_end:
            continue
        warnings.append(
            f"{cfg.source}: nodes.{key}: partition {name!r} preempts with a GraceTime of {p.grace_time_s} s "
            f"(PreemptMode={p.mode}): a preempted node drains for at most {bound.grace_s:g} s, not the "
            f"{grace_s:g} s of its time-limit drain ({source}), keeping {bound.margin_s:g} s of the GraceTime for "
            f"stopping and the requeue; jobs still running then are stopped and start again on another node as a "
            f"new attempt (queued ones go back at once and keep theirs)"
        )
    return warnings


#: Where a broker on Slurm listens when neither deploy.yaml nor prorl.yaml says: every interface (peers run elsewhere).
SLURM_BIND_HOST = "0.0.0.0"


def broker_bind_host(cfg: DeployConfig) -> str:
    """The broker's listen address: deploy.yaml's ``broker.bind_host``, else the one prorl.yaml sets, else 0.0.0.0."""
    if cfg.broker.bind_host:
        return cfg.broker.bind_host
    if cfg.config:
        import yaml

        from prorl_cli import yamlfiles

        try:
            data = yamlfiles.load(Path(cfg.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{cfg.config}: cannot read: {e}") from e
        broker = data.get("broker") if isinstance(data, dict) else None
        if isinstance(broker, dict) and broker.get("bind_host"):
            return str(broker["bind_host"])
    return SLURM_BIND_HOST


def sandbox_runtime(cfg: DeployConfig) -> str:
    """The nodes' sandbox runtime: deploy.yaml's ``nodes.sandbox_runtime``, else prorl.yaml's ``sandbox.runtime``."""
    return cfg.nodes.sandbox_runtime or prorl_config(cfg).sandbox.runtime


def effective_deploy(cfg: DeployConfig) -> dict[str, Any]:
    """deploy.yaml as the roles will see it: defaults, paths and what it leaves to prorl.yaml filled in."""
    data = asdict(cfg)
    data.pop("source", None)
    data.update(home=str(cfg.home_path), log_dir=str(cfg.log_path), python=cfg.python_path)
    data["broker"]["bind_host"] = broker_bind_host(cfg)
    data["nodes"]["sandbox_runtime"] = sandbox_runtime(cfg)
    return data


def role_spec(cfg: DeployConfig, role: str, index: int | None = None) -> RoleSpec:
    """What a submitted task of ``role`` runs."""
    n, inf = cfg.nodes, cfg.inference
    overrides: dict[str, Any] = {}
    if role == "nodes":
        if n.sandbox_runtime is not None:  # unset: the roles' prorl.yaml decides
            overrides["sandbox.runtime"] = n.sandbox_runtime
        if n.sandbox_image:
            overrides["sandbox.image"] = n.sandbox_image
        if n.handler_paths:
            overrides["node.handler_paths"] = list(n.handler_paths)
        if n.tasks:
            overrides["node.tasks"] = list(n.tasks)
        for name in ("n_init", "n_run", "n_eval"):
            if getattr(n, name) is not None:
                overrides[f"node.{name}"] = getattr(n, name)
        roles_config = prorl_config(cfg)  # read once: the file is read from disk each time
        if roles_config.node.drain_grace_s is None:
            # On the USR2 warning running jobs may finish until shortly before the end; 30 s are left for the requeue.
            overrides["node.drain_grace_s"] = node_drain_grace_s(cfg)
        if inf.model and inf.engine != "sim" and roles_config.inference.tokenizer is None:
            # Handlers tokenize for the model the bridges serve.
            overrides["inference.tokenizer"] = inf.model
    return RoleSpec(
        role={"broker": "broker", "nodes": "node", "inference": "inference"}[role],  # type: ignore[arg-type]
        deployment=cfg.deployment,
        home=str(cfg.home_path),
        config_path=cfg.config,
        overrides=overrides,
        index=index,
        rendezvous_wait_s=cfg.rendezvous_wait_s,
        requeue=True if role == "broker" else cfg.role(role).requeue,  # type: ignore[attr-defined]
        bind_host=broker_bind_host(cfg),
        port=cfg.broker.port,
        model=inf.model,
        engine=inf.engine,
        vllm_args=list(inf.vllm_args),
        capacity=inf.capacity,
        max_model_len=inf.max_model_len,
    )


def node_drain_grace_s(cfg: DeployConfig) -> float:
    """How long a node's drain with grace lets running jobs finish: prorl.yaml's ``node.drain_grace_s``, else
    the nodes' ``signal_delay_s`` minus :data:`DRAIN_REQUEUE_MARGIN_S`."""
    configured = prorl_config(cfg).node.drain_grace_s
    return float(configured) if configured is not None else float(max(0, cfg.nodes.signal_delay_s - DRAIN_REQUEUE_MARGIN_S))


def sbatch_options(cfg: DeployConfig, role: str) -> dict[str, Any]:
    """The role's sbatch options (long names without dashes; True is a bare flag)."""
    opts = cfg.role(role)
    out: dict[str, Any] = {
        "job-name": f"prorl-{cfg.deployment}-{role}",
        "time": time_minutes(opts.time),
        "cpus-per-task": opts.cpus_per_task,
        "signal": f"USR2@{opts.signal_delay_s}",
        "open-mode": "append",
    }
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(opts, key):
            out[key] = getattr(opts, key)
    if opts.mem_gb is not None:
        out["mem"] = f"{int(opts.mem_gb * 1024)}M"
    if role == "inference" and (cfg.inference.gres or cfg.inference.gpus_per_task):
        out["gres"] = cfg.inference.gres or f"gpu:{cfg.inference.gpus_per_task}"
    requeue = True if role == "broker" else getattr(opts, "requeue", True)
    out["requeue" if requeue else "no-requeue"] = True
    # false or null: the option is left out (submitit would write `--exclusive=False`, which sbatch refuses).
    out.update({k: v for k, v in opts.sbatch_options.items() if v is not False and v is not None})
    return out


#: Said in a task's log when one of its setup lines fails; the task then exits with that line's status.
SETUP_FAILED = "prorl: a setup line failed"


def guarded_setup(lines: list[str]) -> list[str]:
    """The role's setup lines as submitit writes them into the batch script, stopped at the first that fails.

    A failing line (``module load`` of a module the site lacks, a ``source`` of a missing file) would otherwise be
    passed over and the role started without what it sets up, to fail later on something unrelated. The rendered
    scripts run their setup under ``set -eo pipefail`` for the same reason; here an ``ERR`` trap (reset after the
    setup) stops the script instead, naming the line, so submitit's own lines that follow are left as they are.
    """
    if not lines:
        return []
    # Only the lines themselves: a command that fails inside a file they source (a site's module or conda init, which
    # may test things that fail harmlessly) is that file's business; the source line's own status still counts.
    trap = ("trap 'rc=$?; if [ \"${#BASH_SOURCE[@]}\" -le 1 ]; then "
            f"echo \"{SETUP_FAILED} (exit $rc): $BASH_COMMAND; the role does not start\" >&2; exit $rc; fi' ERR")
    return [trap, *lines, "trap - ERR"]


#: The first line of every role's batch script under ``prorl launch``. submitit's batch shell runs the role in an
#: ``srun`` step and waits for it; a SIGUSR2 sent to the whole job (``scancel --signal=USR2 --full``, a site's
#: preemption script) reaches that shell too, which bash's default disposition kills: the job then ends FAILED
#: (exit code 0:12) mid-drain and is replaced as a crash, instead of draining and requeueing as the role does on
#: SIGUSR2. A handler (not an ignore, which srun would inherit across exec) keeps the shell; the role in the step
#: gets its own signal.
BATCH_SHELL_USR2_TRAP = "trap ':' USR2  # prorl: the role in the srun step drains on SIGUSR2; this shell must outlive it"


def executor(cfg: DeployConfig, role: str, count: int) -> Any:
    import submitit

    opts = cfg.role(role)
    sb = sbatch_options(cfg, role)
    ex = submitit.SlurmExecutor(folder=str(cfg.log_path / role / "%j"), python=shlex.quote(cfg.python_path))
    # submitit's own knobs; everything else goes in as raw sbatch options.
    ex.update_parameters(
        job_name=sb.pop("job-name"),
        time=sb.pop("time"),
        cpus_per_task=sb.pop("cpus-per-task"),
        signal_delay_s=opts.signal_delay_s,
        setup=[BATCH_SHELL_USR2_TRAP, *guarded_setup([*cfg.setup, *opts.setup])],
        stderr_to_stdout=True,
        array_parallelism=getattr(opts, "array_parallelism", 0) or max(count, 1),
        additional_parameters={k: v for k, v in sb.items() if k != "signal"},
        # The role runs in submitit's srun step: with sbatch_options `export: NONE` (a clean environment) the step
        # would inherit that and start with an empty environment, without what the setup lines exported.
        srun_args=["--export=ALL"],
    )
    return ex


def submit_role(cfg: DeployConfig, role: str, indices: list[int]) -> list[Member]:
    """Submit ``role`` tasks with these indices (one job, or one array)."""
    ex = executor(cfg, role, len(indices))
    # submitit prints a failed sbatch's stderr itself and raises with the same text: keep only the error we raise.
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            if role == "broker":
                job = ex.submit(submitted_role, role_spec(cfg, role))
                return [Member(role, 0, str(job.job_id))]
            jobs = ex.map_array(submitted_role, [role_spec(cfg, role, i) for i in indices])
    except RuntimeError as e:  # submitit's FailedJobError carries sbatch's message
        raise SlurmError(f"sbatch refused the {role}: {str(e).strip()}") from e
    return [Member(role, i, str(j.job_id)) for i, j in zip(indices, jobs, strict=True)]


