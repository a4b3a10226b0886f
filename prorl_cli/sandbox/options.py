"""What a handler may ask of one sandbox beyond the node's defaults: host folders and limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prorl_cli.exceptions import SandboxError


@dataclass(frozen=True)
class Mount:
    """A host path bound into the sandbox at ``target`` (read-only unless ``writable``)."""

    source: str
    target: str
    writable: bool = False

    def check(self) -> Mount:
        """The mount, or a :class:`SandboxError` naming what is wrong with it."""
        if not Path(self.source).exists():
            raise SandboxError(f"mount source {self.source!r} does not exist")
        if not self.target.startswith("/") or ":" in self.target or ":" in self.source:
            raise SandboxError(f"mount {self.source!r} -> {self.target!r}: the target must be an absolute path "
                               "and neither may contain ':'")
        return self


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox limits replacing ``sandbox.mem_gb`` / ``max_procs`` / ``wall_s`` / ``disk_mb`` (``None``: keep the node's)."""

    mem_gb: float | None = None
    max_procs: int | None = None
    wall_s: float | None = None
    disk_mb: int | None = None

    def check(self) -> SandboxLimits:
        for name in ("mem_gb", "max_procs", "wall_s", "disk_mb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
                raise SandboxError(f"sandbox limit {name}: expected a number >= 0 (0: no limit), got {value!r}")
        return self
