"""Finding the prorl tool server that every image carries."""

from __future__ import annotations

import os
import re
from pathlib import Path

from prorl_cli import __version__
from prorl_cli.exceptions import ConfigError
from prorl_cli.images.render import ToolServer

_SANDBOX_DIR = Path(__file__).resolve().parent.parent / "sandbox"
# Names the sandbox subsystem may give its stdlib-only server (a file or a zipapp), in preference order.
_CANDIDATES = ("tool_server.pyz", "tool_server.py", "toolserver.pyz", "toolserver.py", "prorl_tool_server.py")
_VERSION_RE = re.compile(rb"""^(?:__version__|VERSION|TOOL_SERVER_VERSION)\s*=\s*["']([^"']+)["']""", re.M)


def find_tool_server(explicit: str | os.PathLike[str] | None = None) -> ToolServer:
    """The tool server to copy into images: ``explicit`` (``images.tool_server``) or the one in ``prorl_cli/sandbox``.

    Its version is the ``__version__`` it declares, else prorl's.
    """
    if explicit:
        path = Path(os.path.expandvars(os.path.expanduser(str(explicit)))).resolve()
        if not path.is_file():
            raise ConfigError(f"images.tool_server: {path} is not a file")
    else:
        found = [_SANDBOX_DIR / n for n in _CANDIDATES if (_SANDBOX_DIR / n).is_file()]
        if not found:
            raise ConfigError(
                f"no prorl tool server found in {_SANDBOX_DIR} (looked for {', '.join(_CANDIDATES)}); set images.tool_server in prorl.yaml"
            )
        path = found[0]
    m = _VERSION_RE.search(path.read_bytes()[:65536]) if path.suffix == ".py" else None
    version = m.group(1).decode() if m else __version__
    return ToolServer(src=path, version=version)
