"""The gateway from inside a sandbox with no network: reachable through the tool server's relay,
while every other address (the node's external IP, 1.1.1.1) stays unreachable."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.gateway.server import Gateway
from prorl_cli.sandbox import SandboxManager
from prorl_cli.sandbox.settings import SandboxConfig
from tests.gateway.conftest import ScriptedModel, open_job

IMAGES = Path(os.environ.get("PRORL_TEST_IMAGES", "/var/cache/prorl-test"))

# Run inside the sandbox with its python3: a chat request through the relay, then two addresses that must fail.
PROBE = r"""
import json, os, socket, sys, urllib.request
base = os.environ["OPENAI_BASE_URL"]
req = urllib.request.Request(base + "/chat/completions", method="POST",
    data=json.dumps({"model": "prorl", "messages": [{"role": "user", "content": "ping"}]}).encode(),
    headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
answer = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]["content"]
def reach(host, port):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port)); return True
    except OSError:
        return False
    finally:
        s.close()
print(json.dumps({"answer": answer, "external": reach(sys.argv[1], int(sys.argv[2])) if sys.argv[1] else None,
                  "internet": reach("1.1.1.1", 80)}))
"""


def _external_ip() -> str:
    """This host's address on its default route ('' when it has none); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("1.1.1.1", 80))
            return str(s.getsockname()[0])
        except OSError:
            return ""


RUNTIMES = [
    pytest.param("local", None, id="local"),
    pytest.param("bwrap", "python-rootfs", id="bwrap", marks=pytest.mark.bwrap),
    pytest.param("apptainer", "python.sif", id="apptainer", marks=pytest.mark.apptainer),
]


@pytest.mark.parametrize(("runtime", "image"), RUNTIMES)
def test_gateway_answers_inside_a_sandbox_without_network(
    runtime: str, image: str | None, tokenizer: Any, tmp_path: Path
) -> None:
    if runtime != "local" and shutil.which(runtime) is None:
        pytest.skip(f"{runtime} is not installed (scripts/provision/)")
    if image is not None and not (IMAGES / image).exists():
        pytest.skip(f"test image {IMAGES / image} missing (run scripts/provision/45-test-images.sh as root)")
    external = _external_ip() if runtime != "local" else ""

    async def main() -> dict[str, Any]:
        config = SandboxConfig(runtime=runtime, image=str(IMAGES / image) if image else "",  # type: ignore[arg-type]
                               local_dir=str(tmp_path / "sb"))
        manager = SandboxManager(config, tmp_path / "state", logging.getLogger("test.gateway.relay"))
        gw = Gateway(host=external or "127.0.0.1")  # the node listens on its external address too
        await gw.start()
        model = ScriptedModel(tokenizer, ["pong"])
        job = open_job(gw, tokenizer, model)
        sandbox = await manager.start("relay-job", network=False)
        try:
            host_sock, inside_sock = sandbox.gateway_socket()
            await job.serve_unix(host_sock)
            host, port = await sandbox.relay(inside_sock)
            await sandbox.write_file("/tmp/probe.py", PROBE.encode())
            env = " ".join(f"{k}={v}" for k, v in job.env(host, port).items())
            ran = await sandbox.bash(f"env {env} python3 /tmp/probe.py '{external}' {gw.port}", timeout_s=90)
            assert ran.exit_code == 0, ran.output
            result: dict[str, Any] = json.loads(ran.output.strip().splitlines()[-1])
            result["calls"] = len(job.trajectory.calls)
            return result
        finally:
            await manager.stop_all()
            await gw.close()

    r = asyncio.run(main())
    assert r["answer"] == "pong" and r["calls"] == 1
    if runtime != "local":  # the local runtime has no isolation by design
        assert r["internet"] is False
        if external:
            assert r["external"] is False  # the gateway's own TCP port on the node, seen from inside: closed
