"""Which torch device a model runs on: ``auto`` is the GPU when torch sees one, else the CPU.

The transformers engine and the training examples take it; nothing hard-codes the CPU.
"""

from __future__ import annotations

from prorl_cli.exceptions import ConfigError

#: Accepted besides a torch device string such as ``cuda:1``.
AUTO = "auto"


def resolve_device(device: str = AUTO) -> str:
    """``auto`` → ``cuda`` when torch sees a CUDA device, else ``cpu``; other names checked by torch.

    Raises :class:`ConfigError` naming the value when torch does not know it, or when a CUDA
    device is asked for and torch sees none.
    """
    import torch

    if device == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r}: not a torch device (auto, cpu, cuda, cuda:N): {e}") from e
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: torch sees no CUDA device here (use auto or cpu)")
    return str(parsed)
