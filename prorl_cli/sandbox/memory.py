"""A sandbox's memory as the node measures it where no memory cgroup bounds the sandbox.

Without a cgroup (an ordinary user, the usual case on clusters: cgroup v1, or
v2 without delegation) the kernel bounds each process (``RLIMIT_AS``) and the
number of processes per sandbox (``RLIMIT_NPROC``, counted per user namespace),
not their sum: ``max_procs`` processes may hold ``max_procs`` x ``mem_gb``. The
node closes that gap itself, as it does for disk: it sums the private memory
of every process of the sandbox every ``sandbox.memory_check_s`` and stops a
sandbox over its ``mem_gb``.

Which processes: the leader's process tree, as the host sees it. Every
process of an isolating runtime lives in the sandbox's PID namespace, where an
orphan is re-parented to the namespace's init (a descendant of the leader), so
no process inside can leave the tree; ``setsid`` leaves the session, not the
tree.

What is counted: each process's ``Pss_Anon`` + ``Pss_Shmem``
(``/proc/PID/smaps_rollup``): its anonymous and shared-memory pages, a page
that several processes share (a fork's copy-on-write heap) split among them,
so the sum over the tree is what the sandbox holds. The node may read it: it
owns the sandboxes' user namespaces (bubblewrap's, Apptainer's with fakeroot),
or is root. Where it may not, ``RssAnon`` + ``RssShmem`` of ``/proc/PID/status``
(readable for every uid) stand in, which count a shared page once per process
that maps it: an overestimate, on the safe side. Pages of mapped files (the
interpreter, shared libraries) are left out either way: they are shared and
reclaimable, and would charge a sandbox of 64 Python processes hundreds of MB
it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from prorl_cli.processes import child_pids, descendants

#: Fields of /proc/PID/smaps_rollup summed per process (kB): shared pages split among their processes.
_PROPORTIONAL = (b"Pss_Anon:", b"Pss_Shmem:")
#: The stand-in from /proc/PID/status (readable for every uid; shared pages counted in full).
_RESIDENT = (b"RssAnon:", b"RssShmem:")


@dataclass(frozen=True)
class TreeMemory:
    """What the processes of one sandbox hold: how many there are and their private resident memory."""

    processes: int
    rss_bytes: int


def _sum_fields(path: str, names: tuple[bytes, ...]) -> int | None:
    """The sum of the named kB fields of a /proc file in bytes; None if unreadable or none is there."""
    total, seen = 0, False
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(names):
                    total += int(line.split()[1]) * 1024
                    seen = True
    except (OSError, ValueError, IndexError):
        return None
    return total if seen else None


def private_rss_bytes(pid: int) -> int:
    """The anonymous and shared memory one process holds, in bytes (0 if it is gone, or a kernel thread)."""
    found = _sum_fields(f"/proc/{pid}/smaps_rollup", _PROPORTIONAL)
    if found is None:
        found = _sum_fields(f"/proc/{pid}/status", _RESIDENT)
    return found or 0


def tree_memory(leaders: list[int]) -> dict[int, TreeMemory]:
    """For each leader pid: its process tree's count and private resident memory (one scan of /proc for all)."""
    if not leaders:
        return {}
    children = child_pids()
    found = {}
    for leader in leaders:
        tree = [leader, *descendants(leader, children)]
        found[leader] = TreeMemory(len(tree), sum(private_rss_bytes(pid) for pid in tree))
    return found
