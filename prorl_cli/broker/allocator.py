"""Keep the broker's big buffers out of glibc's heap, so its memory follows its retention.

The broker receives, retains and sends results of hundreds of KB. glibc serves
blocks of at least ``M_MMAP_THRESHOLD`` (128 KiB at start) with their own
``mmap`` and gives them back on ``free``; but the first such block freed raises
that threshold to its size (up to 32 MiB), so from then on every result is
carved out of the heap and its arenas, which fragment and are not returned.
Measured (docs/reliability.md): 4,096 jobs in flight with 256 KB results and
256 MB of retention held the broker at 939 MB RSS; with the threshold fixed
at 128 KiB, at about 350 MB.

``mallopt(M_MMAP_THRESHOLD, ...)`` fixes the threshold (setting it turns the
dynamic adjustment off). Linux with glibc only; elsewhere (musl, macOS) it does
nothing. An operator's own ``MALLOC_MMAP_THRESHOLD_`` in the environment wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024
ENV_OVERRIDE = "MALLOC_MMAP_THRESHOLD_"


def fix_mmap_threshold(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve blocks of ``threshold_bytes`` or more with mmap from now on; True when glibc took the setting."""
    if not sys.platform.startswith("linux") or ENV_OVERRIDE in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (no mallopt): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, threshold_bytes))
    log.debug("malloc mmap threshold fixed at %d bytes: %s", threshold_bytes, ok)
    return ok
