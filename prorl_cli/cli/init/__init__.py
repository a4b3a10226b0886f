"""``prorl init [--slurm]``: a commented prorl.yaml (and deploy.yaml) to start from.

The values written are read from the schemas' own defaults (:class:`ProrlConfig`,
:class:`DeployConfig`), never typed twice, so a generated file cannot drift
from what prorl assumes. ``--slurm`` changes exactly what a cluster needs:
the broker listens on every interface, sandboxes must isolate (Apptainer),
and deploy.yaml leaves both to prorl.yaml so the pair cannot disagree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from prorl_cli.cli.application import App, pass_app
from prorl_cli.cli.common import command_hint
from prorl_cli.cli.naming import deployment_option, named_deployment

PRORL_TEMPLATE = """\
# prorl.yaml: what every prorl process of a deployment reads (written by `prorl init{slurm_flag}`).
# The common keys, at their defaults{slurm_note}.
# `prorl config show` prints every key with its effective value; examples/prorl.yaml lists them all.
# Unknown keys are errors that name the key.
# Order of precedence: these values < PRORL_HOME / PRORL_DEPLOYMENT < command-line flags.

deployment: {deployment}         # the name: $PRORL_HOME/<deployment>/ holds the rendezvous file, journal and logs
home: {home}               # PRORL_HOME{home_note}

broker:
  bind_host: {bind_host}       # 127.0.0.1: this machine only; 0.0.0.0: every interface (peers on other hosts)
  curve: {curve}                # auto/on: encrypt and authenticate, on loopback too; off: plain TCP
  port: {port}                    # 0: a free port, published in the rendezvous file

node:
  n_init: {n_init}                  # INIT workers (sandbox starts)
  n_run: {n_run}                  # RUN workers (agent loops)
  n_eval: {n_eval}                  # EVAL workers (scoring)

jobs:
  timeout_s: {timeout_s}            # in-stage time budget per job (queue waits do not count)
  max_attempts: {max_attempts}             # a job whose node was lost runs again, at most this often

sandbox:
  runtime: {runtime}  # auto: Apptainer when it works, else bubblewrap, else local (NO isolation, warned);
  # apptainer | bwrap | local
  image: {image}                # default image for handlers that name none (.sif, directory, or "host" for bwrap)
  network: {network}           # sandboxes get the host's network only when a task asks

inference:
  capacity: {capacity}              # generate calls a bridge serves at once
  tokenizer: {tokenizer}           # the model directory handlers and the gateway tokenize for (none: `prorl launch`
  # uses the deploy file's model; a node started by hand needs it here, or a `tokenizer` field in each instance)
"""

DEPLOY_TEMPLATE = """\
# deploy.yaml: a prorl deployment on Slurm (written by `prorl init --slurm`).
#   prorl launch deploy.yaml --dry-run     the sbatch scripts and Slurm requests, nothing submitted
#   prorl launch deploy.yaml               submit, then watch every task register
#   prorl status -d {deployment} / prorl logs -d {deployment} nodes[0] / prorl down -d {deployment}
# examples/deploy.yaml lists every key; relative paths resolve against this file's folder.

deployment: {deployment}
config: {config}  # the prorl.yaml every role reads: the broker's bind_host and the sandbox
# runtime come from there (broker.bind_host and nodes.sandbox_runtime set here would override them)
python: {python}                 # Python in the jobs (must see prorl installed); null: the one running prorl launch
setup: []                    # shell lines before every role, e.g. ["module load cuda/12.4"]; one that fails
# stops the role, naming the line (append `|| true` to a line that may fail)

broker:
  where: {where}              # slurm: its own small job; here: a process on this (login) machine
  time: "{broker_time}"
  cpus_per_task: {broker_cpus}

nodes:
  count: {nodes_count}                   # node servers: one Slurm array task each (node-0, node-1, ...)
  time: "{nodes_time}"
  cpus_per_task: {nodes_cpus}
  partition: {partition}

inference:
  count: {inference_count}                   # inference bridges (vLLM), one GPU task each; needs model (sim: none)
  gpus_per_task: {gpus_per_task}
  model: {model}                # a local model directory on a shared filesystem
  engine: {engine}  # vllm | transformers (CPU) | sim: a simulated GPU server, no model or GPU
# (dry runs and planning; gpus_per_task: 0 runs it on CPU nodes)
  time: "{inference_time}"
  partition: {partition}
"""


#: Column the trailing comments of the generated files start at.
COMMENT_COLUMN = 30


def _align(text: str) -> str:
    """Trailing ``# comments`` at one column; a comment-only line under a key stays with its key."""
    out: list[str] = []
    for line in text.splitlines():
        code, sep, comment = line.partition("  # ")
        if sep and code.strip() and not code.lstrip().startswith("#"):
            line = f"{code.rstrip():<{COMMENT_COLUMN - 1}} # {comment}"
        elif line.lstrip().startswith("# ") and out and "  # " in out[-1] and line.startswith("  "):
            line = " " * COMMENT_COLUMN + line.lstrip()
        elif line.startswith("# ") and out and " # " in out[-1] and not out[-1].startswith("#"):
            line = " " * COMMENT_COLUMN + line
        out.append(line)
    return "\n".join(out) + "\n"


def _yaml(value: Any) -> str:
    """One YAML scalar as the schema default would be dumped (null, quoted empty strings, lower-case booleans)."""
    import yaml

    return str(yaml.safe_dump(value, default_flow_style=True)).strip().removesuffix("...").strip()


def render_prorl_yaml(deployment: str, slurm: bool) -> str:
    """The commented prorl.yaml; ``slurm``: bind every interface, sandboxes must isolate."""
    from prorl_cli.config import ProrlConfig

    d = ProrlConfig()
    runtime = "apptainer" if slurm else d.sandbox.runtime
    return _align(PRORL_TEMPLATE.format(
        slurm_flag=" --slurm" if slurm else "",
        slurm_note=", except broker.bind_host and sandbox.runtime (set for a cluster)" if slurm else "",
        deployment=_yaml(deployment),
        home=_yaml(d.home),
        home_note=": on a cluster, a folder every node sees (a shared filesystem)" if slurm else "",
        bind_host=_yaml("0.0.0.0" if slurm else d.broker.bind_host),
        curve=_yaml(d.broker.curve), port=_yaml(d.broker.port),
        n_init=d.node.n_init, n_run=d.node.n_run, n_eval=d.node.n_eval,
        timeout_s=_yaml(d.jobs.timeout_s), max_attempts=d.jobs.max_attempts,
        runtime=runtime,
        image=_yaml(d.sandbox.image), network=_yaml(d.sandbox.network),
        capacity=d.inference.capacity, tokenizer=_yaml(d.inference.tokenizer),
    ))


def render_deploy_yaml(deployment: str, config_name: str) -> str:
    """The commented deploy.yaml; what it does not set comes from the schema's defaults or from prorl.yaml."""
    from prorl_cli.slurm.deploy import DeployConfig

    d = DeployConfig()
    return _align(DEPLOY_TEMPLATE.format(
        deployment=_yaml(deployment), config=_yaml(config_name), python=_yaml(d.python),
        where=_yaml(d.broker.where), broker_time=d.broker.time, broker_cpus=d.broker.cpus_per_task,
        nodes_count=d.nodes.count, nodes_time=d.nodes.time, nodes_cpus=d.nodes.cpus_per_task,
        partition=_yaml(d.nodes.partition), inference_count=d.inference.count,
        gpus_per_task=d.inference.gpus_per_task, model=_yaml(d.inference.model), engine=_yaml(d.inference.engine),
        inference_time=d.inference.time,
    ))


@click.command()
@click.option("--slurm", is_flag=True, help="Also write deploy.yaml, and set prorl.yaml for a cluster (broker on every interface, Apptainer sandboxes).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True,
              help="Folder to write the files in.")
@click.option("--force", is_flag=True, help="Overwrite files that exist.")
@deployment_option
@pass_app
def init(app: App, slurm: bool, out_dir: Path, force: bool) -> None:
    """Write a commented prorl.yaml (and, with --slurm, deploy.yaml) to start from.

    The deployment name is -d NAME (default: default). Both files are checked
    by loading them before the command returns.
    """
    from prorl_cli.config import DEFAULT_CONFIG_NAME, ENV_HOME, config_from_dict, load_config
    from prorl_cli.exceptions import ConfigError
    from prorl_cli.slurm.deploy import load_deploy

    name = named_deployment(app) or "default"
    # A name no deployment can have, or a PRORL_HOME that is a file, is the user's error: refused before a file
    # is written (the check after writing is for templates that drifted from the schema).
    home = app.overrides.get("home") or os.environ.get(ENV_HOME)
    try:
        config_from_dict({"deployment": name, **({"home": home} if home else {})}, origin="prorl init")
    except ConfigError as e:
        app.abort(str(e))
    files = {out_dir / DEFAULT_CONFIG_NAME: render_prorl_yaml(name, slurm)}
    if slurm:
        files[out_dir / "deploy.yaml"] = render_deploy_yaml(name, DEFAULT_CONFIG_NAME)
    existing = [str(p) for p in files if p.exists()]
    if existing and not force:
        one = len(existing) == 1
        app.abort(f"{' and '.join(existing)} {'exists' if one else 'exist'}: edit {'it' if one else 'them'}, or run "
                  "this command again with --force to overwrite")
    out_dir.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
    try:  # what we wrote must load: a template that drifted from the schema fails here, not at launch
        load_config(out_dir / DEFAULT_CONFIG_NAME)
        if slurm:
            load_deploy(out_dir / "deploy.yaml")
    except ConfigError as e:
        app.abort(f"the written file does not load (a prorl bug): {e}")
    for path in files:
        app.console.print(f"wrote {path}")
    if slurm:
        # The deployment is the file's own; --home, where given, is not written into it.
        hint = command_hint(app, "launch", out_dir / "deploy.yaml", "--dry-run", named=False)
        app.console.print(f"next: {hint}", markup=False)
