"""The ``inference`` section of prorl.yaml (owned by the inference subsystem)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prorl_cli.exceptions import ConfigError

#: The engines ``prorl serve inference`` can run.
ENGINES = ("vllm", "transformers", "sim")


@dataclass
class InferenceConfig:
    """How node workers reach models, and how ``prorl serve inference`` runs them.

    Command-line flags of ``prorl serve inference`` override the bridge keys.
    """

    #: Longest a node waits for one generate call (queued and served; time held at the broker does not count).
    generate_timeout_s: float = 600.0
    #: Model directory whose tokenizer and chat template handlers use (``prorl dev tiny-model`` makes one).
    tokenizer: str | None = None
    #: Bridge: ``vllm`` (a vLLM child process), ``transformers`` (the in-process CPU reference engine)
    #: or ``sim`` (a simulated GPU server: no model, no GPU; docs/inference.md).
    engine: str = "vllm"
    #: Bridge, sim engine: a profile name in ``prorl_cli/inference/sim_profiles`` or a YAML file.
    sim_profile: str = "h100-8b"
    #: Bridge, sim engine: run this many times faster than the profile's GPU (``null``: the profile's own).
    sim_speedup: float | None = None
    #: Bridge, sim engine: write a per-call GPU-time ledger here on exit (``<backend id>.json``; benchmarks).
    sim_ledger_dir: str | None = None
    #: Bridge, transformers engine: the torch device (``auto``: the GPU when torch sees one, else the CPU).
    device: str = "auto"
    #: Bridge: generate requests served at once (more wait in the bridge).
    capacity: int = 64
    #: Bridge: how long vLLM may take to become healthy.
    startup_timeout_s: float = 900.0
    #: Bridge: extra flags for vLLM's OpenAI server (``--dtype``, ``--tensor-parallel-size``, ...).
    vllm_args: list[str] = field(default_factory=list)
    #: Bridge: extra environment for the vLLM child (defaults keep the CPU backend small).
    vllm_env: dict[str, str] = field(default_factory=dict)
    #: Bridge, vLLM: load new weights in place (``update_weights``) through vLLM's ``POST /collective_rpc``
    #: (its ``reload_weights`` plus prorl's refresh of tied output heads, see ``vllm_reload.py``): the vLLM
    #: child starts with ``VLLM_SERVER_DEV_MODE=1`` (its dev endpoints, on 127.0.0.1 only) and
    #: ``--worker-extension-cls``. Off: such a bridge answers ``update_weights`` with an error and is
    #: restarted on the checkpoint instead.
    vllm_reload_in_place: bool = True

    def validate(self, where: str) -> None:
        """Called by the config loader: reject values no bridge could use, naming the key."""
        prefix = f"{where}." if where else "inference."
        if self.engine not in ENGINES:
            raise ConfigError(f"{prefix}engine: expected one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.sim_speedup is not None and not self.sim_speedup > 0:
            raise ConfigError(f"{prefix}sim_speedup: must be positive, got {self.sim_speedup}")
        if self.capacity < 1:
            raise ConfigError(f"{prefix}capacity: must be at least 1, got {self.capacity}")
        for name in ("generate_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}{name}: must be positive, got {getattr(self, name)}")
