"""The ``inference`` section of prorl.yaml (owned by the inference subsystem)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class InferenceConfig:
    """How node workers reach models."""

    generate_timeout_s: float = 600.0
