"""Which torch device a model runs on: ``auto`` is the GPU when torch sees one, else the CPU.

The transformers engine and the training examples take it; nothing hard-codes the CPU.
"""

from __future__ import annotations

import logging
import os

from prorl_cli.exceptions import ConfigError

log = logging.getLogger(__name__)

#: Accepted besides a torch device string such as ``cuda:1``.
AUTO = "auto"

#: What ``CUDA_VISIBLE_DEVICES`` holds when a process was given no GPU (Slurm writes ``NoDevFiles`` for a
#: GRES without device files; CUDA reads ``-1`` as none).
_NO_GPU = ("", "-1", "NoDevFiles")


def allotted_gpus(env: dict[str, str] | None = None) -> list[str]:
    """The GPUs this process was given by ``CUDA_VISIBLE_DEVICES`` (Slurm sets it from ``--gres``); [] for none."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES", "")
    gpus = [g.strip() for g in value.split(",") if g.strip()]
    return [] if not gpus or gpus[0] in _NO_GPU else gpus


def resolve_device(device: str = AUTO) -> str:
    """``auto`` → ``cuda`` when torch sees a CUDA device, else ``cpu``; other names checked by torch.

    ``auto`` falling back to the CPU although ``CUDA_VISIBLE_DEVICES`` names GPUs (a CPU build of
    torch on a GPU node, a broken driver) logs a warning saying why, so a GPU job is never moved to
    the CPU silently. Raises :class:`ConfigError` naming the value when torch does not know it, or
    when a CUDA device is asked for and torch sees none.
    """
    import torch

    if device == AUTO:
        if torch.cuda.is_available():
            return "cuda"
        gpus = allotted_gpus()
        if gpus:
            why = ("it is a CPU-only build" if torch.version.cuda is None
                   else f"it was built for CUDA {torch.version.cuda} but cannot use the GPUs (driver?)")
            log.warning("device auto: running on the CPU although this process was given GPU(s) %s "
                        "(CUDA_VISIBLE_DEVICES): torch %s sees none, %s. Install a CUDA build of torch, "
                        "or ask for device cpu to run on the CPU on purpose", ",".join(gpus),
                        torch.__version__, why)
        return "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r}: not a torch device (auto, cpu, cuda, cuda:N): {e}") from e
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: torch sees no CUDA device here (use auto or cpu)")
    return str(parsed)
