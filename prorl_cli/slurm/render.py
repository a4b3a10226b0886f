"""``prorl render-sbatch``: the same deployment as plain sbatch scripts.

Renders ``slurm_templates/*.sbatch.j2`` from a ``deploy.yaml`` with the
options ``prorl launch`` would use (:func:`prorl_cli.slurm.options.sbatch_options`),
plus ``prorl.yaml`` next to them: the effective configuration the roles read
(the deploy file's node settings, such as the sandbox runtime, folded in).
The roles behave as under ``prorl launch``: same identity, waiting and signals.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import jinja2

from prorl_cli.config import dump_config
from prorl_cli.resources import data_dir
from prorl_cli.slurm.deploy import DeployConfig
from prorl_cli.slurm.options import broker_bind_host, guarded_setup, node_config, sbatch_options

TEMPLATES = {
    "broker": "broker.sbatch.j2",
    "nodes": "node.sbatch.j2",
    "inference": "inference.sbatch.j2",
    "all-in-one": "all-in-one.sbatch.j2",
}


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("slurm_templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters["quote"] = lambda v: shlex.quote(str(v))
    return env


def _sbatch_time(minutes: int) -> str:
    return f"{minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00"


def _role_context(cfg: DeployConfig, role: str, config_file: Path) -> dict[str, Any]:
    sb = sbatch_options(cfg, "nodes" if role == "all-in-one" else role)
    opts = cfg.role("nodes" if role == "all-in-one" else role)
    if role == "all-in-one":
        sb["job-name"] = f"prorl-{cfg.deployment}"
        if cfg.inference.count and (cfg.inference.gres or cfg.inference.gpus_per_task):
            sb["gres"] = cfg.inference.gres or f"gpu:{cfg.inference.gpus_per_task}"
    sb["time"] = _sbatch_time(int(sb["time"]))
    inf = cfg.inference
    return {
        "deployment": cfg.deployment,
        "home": str(cfg.home_path),
        "config": str(config_file),
        "python": cfg.python_path,
        "setup": guarded_setup([*cfg.setup, *opts.setup]),
        "sb": sb,
        "signal_delay_s": opts.signal_delay_s,
        "log_dir": str(cfg.log_path),
        "output_pattern": "%x-%A_%a.out" if role in ("nodes", "inference") else "%x-%j.out",
        "count": getattr(opts, "count", 1),
        "array_parallelism": getattr(opts, "array_parallelism", 0),
        "rendezvous_wait_s": int(cfg.rendezvous_wait_s),
        "bind_host": broker_bind_host(cfg),
        "port": cfg.broker.port,
        "engine": inf.engine,
        "model": inf.model or "",
        "capacity": inf.capacity,
        "max_model_len": inf.max_model_len,
        "vllm_args": inf.vllm_args,
        "with_inference": bool(inf.count),
    }


def render_all(cfg: DeployConfig, out_dir: Path) -> list[Path]:
    """Write the scripts (for the roles the file asks for) and ``prorl.yaml`` to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.log_path.mkdir(parents=True, exist_ok=True)
    # The roles' configuration: prorl.yaml plus the deploy file's node settings.
    merged = node_config(cfg)
    config_file = out_dir / "prorl.yaml"
    config_file.write_text(dump_config(merged))
    env = _environment()
    written = [config_file]
    wanted = ["broker", "nodes", "all-in-one"] + (["inference"] if cfg.inference.count else [])
    for role in wanted:
        text = env.get_template(TEMPLATES[role]).render(**_role_context(cfg, role, config_file.absolute()))
        path = out_dir / TEMPLATES[role].removesuffix(".j2")
        path.write_text(text)
        path.chmod(0o755)
        written.append(path)
    return written
