"""The ``sandbox`` section of prorl.yaml (owned by the sandbox subsystem)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SandboxConfig:
    """How node servers start sandboxes for handlers."""

    runtime: str = "local"  # apptainer | bwrap | local (no isolation; development only)
