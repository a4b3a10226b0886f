"""Rootless sandboxes and the tools that run inside them.

One :class:`SandboxManager` per node server starts sandboxes in the
configured runtime (Apptainer, bubblewrap, or the unisolated local runtime)
and hands out :class:`Sandbox` objects with async tools: a persistent bash
on a PTY, a persistent Python namespace, a file editor, and byte-exact file
copy in and out. See docs/sandbox.md.
"""

from prorl_cli.sandbox.apptainer import ApptainerRuntime
from prorl_cli.sandbox.bwrap import BwrapRuntime
from prorl_cli.sandbox.local import LocalRuntime
from prorl_cli.sandbox.loopback import LoopbackAllocator
from prorl_cli.sandbox.manager import RUNTIMES, SandboxManager, make_runtime
from prorl_cli.sandbox.options import Mount, SandboxLimits
from prorl_cli.sandbox.runtime import LOOPBACK_ENV, LaunchSpec, Runtime
from prorl_cli.sandbox.sandbox import BashResult, EditResult, PythonResult, Sandbox
from prorl_cli.sandbox.settings import SandboxConfig

__all__ = [
    "LOOPBACK_ENV",
    "RUNTIMES",
    "ApptainerRuntime",
    "BashResult",
    "BwrapRuntime",
    "EditResult",
    "LaunchSpec",
    "LocalRuntime",
    "LoopbackAllocator",
    "Mount",
    "PythonResult",
    "Runtime",
    "Sandbox",
    "SandboxConfig",
    "SandboxLimits",
    "SandboxManager",
    "make_runtime",
]
