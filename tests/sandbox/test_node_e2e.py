"""A handler runs real tools in a real Apptainer sandbox, through the real broker and node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prorl_cli.protocol import JobState
from prorl_cli.sandbox.runtime import proc_start_ticks, session_members, wait_gone
from tests.harness import Deployment

pytestmark = [pytest.mark.apptainer, pytest.mark.usefixtures("need_apptainer")]


@pytest.fixture
def deployment(tmp_path: Path, images: dict[str, str]):  # type: ignore[no-untyped-def]
    d = Deployment(tmp_path / "home", "sbx", config={
        "sandbox": {"runtime": "apptainer", "image": images["sif"], "local_dir": str(tmp_path / "sb")},
        "jobs": {"timeout_s": 120.0},
    })
    d.start_broker()
    yield d
    d.close()


def test_handler_uses_real_tools_through_broker_and_node(deployment: Deployment) -> None:
    deployment.start_node("n1")
    client = deployment.client
    (job_id,) = client.submit("sandbox_demo", [{}])
    (result,) = client.wait([job_id], timeout_s=120)
    assert result.state == JobState.DONE.value, result
    out = result.output
    assert out["runtime"] == "apptainer"
    assert out["steps"][0] == "/work\n2:    return a - b\n"
    assert out["steps"][2] == "2 + 3 = 5\n"
    assert "-    return a - b" in out["diff"] and "+    return a + b" in out["diff"]
    assert out["python"] == "90"
    assert out["uid_inside"] == "0"  # fakeroot
    assert out["stopped_before_eval"] is True
    assert result.reward == 1.0
    # The pipeline's cleanup stopped the sandbox: nothing recorded, nothing left.
    records = deployment.deployment_dir / "nodes" / "n1" / "sandboxes"
    assert list(records.glob("*.json")) == []


def test_kill9_node_leaves_no_sandbox_and_a_node_with_another_id_reaps_its_record(deployment: Deployment) -> None:
    deployment.start_node("n1")
    client = deployment.client
    (job_id,) = client.submit("sandbox_demo", [{"hang_in_run": True}])
    records = deployment.deployment_dir / "nodes" / "n1" / "sandboxes"
    deployment.wait_for(lambda st: any(records.glob("*.json")) and st.jobs.get("run", 0) > 0, 120,
                        "the job to reach RUN with its sandbox", "n1")
    (record_path,) = records.glob("*.json")
    record = json.loads(record_path.read_text())
    assert proc_start_ticks(record["pid"]) == record["start_ticks"]  # the sandbox runs
    members = session_members(record["pid"])
    assert len(members) >= 3  # with its tool server and FUSE helpers

    deployment.kill("n1")  # SIGKILL to the node server's process group only
    # Its sandbox does not outlive it: not its leader, nor helpers in its session (squashfuse, fuse-overlayfs).
    assert wait_gone(members, 60) == []

    # A node under another id (the default id is host-pid: a replacement never matches) cleans up the rest.
    deployment.start_node("n2")
    assert not record_path.exists()
    assert not Path(record["session_dir"]).exists()
    client.cancel([job_id])
