"""Per-sandbox loopback addresses (127.x.y.z) for services that need TCP ports.

Every sandbox gets its own address, exported as ``PRORL_LOOPBACK_IP``, so
two sandboxes can both listen on port 8000 even when they share the host's
network namespace (all of 127.0.0.0/8 is local on Linux). The allocator is
thread-safe and reuses released addresses.
"""

from __future__ import annotations

import hashlib
import threading

from prorl_cli.exceptions import SandboxError


class LoopbackAllocator:
    """Hands out 127.<prefix>.<hi>.<lo> addresses, one per live sandbox."""

    def __init__(self, prefix: int) -> None:
        if not 1 <= prefix <= 255:
            raise ValueError(f"loopback prefix must be in 1..255 (127.0.x.x is the host's), got {prefix}")
        self.prefix = prefix
        self._lock = threading.Lock()
        self._next = 0
        self._free: list[int] = []
        self._used: set[int] = set()
        self._capacity = 256 * 254  # hi in 0..255, lo in 1..254

    @classmethod
    def for_node(cls, key: str) -> LoopbackAllocator:
        """An allocator whose prefix derives from ``key`` (the node's run directory).

        Node servers sharing a host mostly get different prefixes, so their
        sandboxes' addresses differ too when they use the host's network.
        """
        digest = hashlib.sha256(key.encode()).digest()
        return cls(1 + digest[0] % 255)

    def _address(self, index: int) -> str:
        return f"127.{self.prefix}.{index // 254}.{1 + index % 254}"

    def allocate(self) -> str:
        """A free address; :class:`SandboxError` when all are taken."""
        with self._lock:
            if self._free:
                index = self._free.pop()
            elif self._next < self._capacity:
                index = self._next
                self._next += 1
            else:
                raise SandboxError(f"all {self._capacity} loopback addresses of 127.{self.prefix}.x.y are in use")
            self._used.add(index)
            return self._address(index)

    def release(self, address: str) -> None:
        """Return an address to the pool (unknown addresses are ignored)."""
        parts = address.split(".")
        if len(parts) != 4 or parts[0] != "127" or int(parts[1]) != self.prefix:
            return
        index = int(parts[2]) * 254 + int(parts[3]) - 1
        with self._lock:
            if index in self._used:
                self._used.remove(index)
                self._free.append(index)
