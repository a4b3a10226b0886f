"""The local runtime: the tool server as a plain host process. NO ISOLATION.

For development on a laptop only: commands run as you, see your files and
your network. Every start logs a warning that says so.
"""

from __future__ import annotations

import os
import sys

from prorl_cli.sandbox.runtime import TOOLSERVER_PATH, LaunchSpec, Runtime


class LocalRuntime(Runtime):
    """Runs the tool server on the host, in its own process group, without isolation."""

    name = "local"
    isolated = False

    def check(self) -> None:
        """Always available."""

    def resolve_image(self, image: str | None) -> str:
        return "host (no isolation)"

    def command(self, spec: LaunchSpec) -> list[str]:
        self.log.warning(
            "sandbox %s: LOCAL RUNTIME, NO ISOLATION: commands run on this host as this user "
            "(development only; set sandbox.runtime to apptainer or bwrap)",
            spec.sandbox_id,
        )
        # --subreaper: a command's double-forked daemon stays the tool server's descendant (no PID namespace
        # holds it here), so stop finds and ends it.
        return [sys.executable, str(TOOLSERVER_PATH), *self.toolserver_argv(str(spec.socket_path), spec=spec),
                "--subreaper"]

    def host_env(self, spec: LaunchSpec) -> dict[str, str]:
        # Nothing to hide: without isolation the tool server can read the node's environment anyway.
        env = dict(os.environ)
        env.update(spec.sandbox_env)
        return env
