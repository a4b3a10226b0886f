"""End to end: the shipped debootstrap ``base`` recipe, built for real, runs the tool server in the Apptainer sandbox runtime.

The image is slow to build (a Debian minbase, about a minute and a half), so
it lives in a lock-mode cache under /var/cache/prorl-test/images: later runs
reuse it until the recipe, the mirror or the tool server change.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

import pytest

from prorl_cli.images import resolve_image
from prorl_cli.sandbox import SandboxConfig, SandboxManager
from tests.harness import TEST_BUILD_ARGS

from .conftest import REPO, TOOL_SERVER, Workspace, apptainer_missing

CACHE = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test")) / "images"


def _missing() -> str | None:
    if apptainer_missing():
        return apptainer_missing()
    if shutil.which("debootstrap") is None:
        return "debootstrap is not installed (Bootstrap: debootstrap images need the Debian package 'debootstrap')"
    if not TOOL_SERVER.is_file():
        return f"the sandbox tool server {TOOL_SERVER} is missing"
    return None


pytestmark = [
    pytest.mark.apptainer,
    pytest.mark.slow,
    pytest.mark.skipif(_missing() is not None, reason=_missing() or ""),
    pytest.mark.timeout(1200),
]


@pytest.fixture(scope="module")
def base_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped ``base`` image, built (or reused) by ``prorl build-images`` with the real tool server."""
    ws = Workspace(tmp_path_factory.mktemp("e2e"))
    ws.settings = {"cache_dir": str(CACHE), "config_file": str(REPO / "sif_recipes" / "images.yaml"),
                   "build_args": TEST_BUILD_ARGS}
    ws.write(ws.images)
    result = ws.build("--mode", "lock", "base")["base"]
    assert result["action"] in ("built", "reused"), result
    ws.prorl("images", "prune")  # older keys of the test cache (earlier tool servers) go
    path = resolve_image("base", CACHE)
    assert path == Path(result["path"])
    return path


def test_built_image_runs_the_tool_server_in_the_sandbox_runtime(base_image: Path, tmp_path: Path) -> None:
    async def scenario() -> dict[str, object]:
        config = SandboxConfig(runtime="apptainer", image=str(base_image), local_dir=str(tmp_path / "sb"))
        manager = SandboxManager(config, tmp_path / "state", logging.getLogger("test.images.e2e"))
        sandbox = await manager.start("e2e-job")
        try:
            os_release = await sandbox.bash("grep ^VERSION_CODENAME= /etc/os-release")
            py = await sandbox.python("import sys; print(sys.version_info[:2] >= (3, 8))")
            bound = await sandbox.read_file("/.prorl/toolserver.py")
            in_image = await sandbox.bash("test -e /opt/prorl/tool_server.py && echo copied || echo absent")
            return {"os": os_release.output, "py": py.stdout.strip(), "py_error": py.error, "bound": bound,
                    "in_image": in_image.output.strip()}
        finally:
            await manager.stop_all()

    r = asyncio.run(scenario())
    assert "VERSION_CODENAME=bookworm" in str(r["os"])
    assert r["py"] == "True" and r["py_error"] is None
    assert r["bound"] == TOOL_SERVER.read_bytes()  # the runtime bound this very tool server in
    assert r["in_image"] == "absent"  # and the image carries none of its own
