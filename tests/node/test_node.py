"""The node server against a real broker: liveness under a blocked loop, bad timers, bad assignments,
broken handler files, and what results echo from their spec."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from prorl_cli import protocol as P
from prorl_cli.protocol import JobResult, Op
from tests.harness import Deployment, bare_dealer


@pytest.fixture
def deployment(tmp_path: Path):
    d = Deployment(tmp_path / "home", "node")
    d.start_broker()
    yield d
    d.close()


class RawClient:
    """A DEALER that speaks the wire protocol by hand, to send what the real client never would."""

    def __init__(self, address: str, deployment_dir: Path) -> None:
        self.ctx = zmq.Context()
        self.sock = bare_dealer(address, deployment_dir, ctx=self.ctx)
        self._rid = 0

    def request(self, header: dict[str, Any], payload: list[bytes]) -> dict[str, Any]:
        self._rid += 1
        self.sock.send_multipart(P.encode({**header, "rid": self._rid}, payload))
        while True:
            h, _ = self._recv(15.0)
            if h["op"] == Op.REPLY and h.get("rid") == self._rid:
                return h

    def _recv(self, timeout_s: float) -> tuple[dict[str, Any], list[bytes]]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("nothing from the broker")
        frames = self.sock.recv_multipart()
        header = P.decode_header(frames[0])
        return header, P.job_items(header["op"], frames[1:])

    def results(self, n: int, timeout_s: float = 60.0) -> dict[str, JobResult]:
        out: dict[str, JobResult] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            h, payload = self._recv(max(0.1, deadline - time.monotonic()))
            if h["op"] == Op.RESULT:
                for frame in payload:
                    r = JobResult.from_wire(P.unpack_obj(frame))
                    out[r.job_id] = r
        return out

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def test_a_handler_blocking_the_loop_10s_does_not_get_its_node_declared_dead(deployment: Deployment) -> None:
    # Liveness here is 8 x 0.25 s = 2 s: a loop blocked for 10 s would have been declared dead five times over.
    deployment.start_node("busy")
    client = deployment.client
    (job_id,) = client.submit("test", [{"block_s": {"run": 10}}], timeout_s=60)
    (result,) = client.wait([job_id], timeout_s=60)
    assert result.state == "done", result.error
    assert result.attempt == 1 and result.output["attempt"] == 1
    assert result.output["stages"] == ["init", "run", "eval"]
    node = next(n for n in client.status().nodes if n.node_id == "busy")
    assert node.alive
    # The sidecar writes "was blocked for" on its first check after the loop resumed, which may come after the result.
    deadline = time.monotonic() + 10
    log = deployment.log("busy")
    while "was blocked for" not in log and time.monotonic() < deadline:
        time.sleep(0.1)
        log = deployment.log("busy")
    assert "event loop blocked" in log and f"job {job_id} (stage run)" in log
    assert "was blocked for" in log


def test_a_loop_blocked_past_the_stall_limit_gets_its_node_declared_dead(tmp_path: Path) -> None:
    """A dead-locked node must still be declared dead: the sidecar stops vouching past node.loop_stall_limit_s."""
    # Declared dead about 0.5 + 3 x 0.25 s into the block: the block lasts several times that, so a loaded
    # machine's late heartbeat check still falls inside it.
    d = Deployment(tmp_path / "home", "stall", {"node": {"loop_stall_limit_s": 0.5},
                                                "broker": {"heartbeat_interval_s": 0.25}})
    try:
        d.start_broker()
        d.start_node("stuck")
        (job_id,) = d.client.submit("test", [{"block_s": {"run": 6}, "block_attempt": 1}], timeout_s=60,
                                    max_attempts=2)
        (result,) = d.client.wait([job_id], timeout_s=90)
        # Declared dead while blocked: the broker re-queued the job, whose second attempt (on the node come back:
        # there is no other) does not block. Which attempt's result ends it is a race the test does not decide:
        # the node, back after the block, sends the first attempt's result again as it registers, and the broker
        # takes it if it comes before the second attempt ends.
        assert "node stuck lost (silent for" in d.log("broker"), d.log("broker")
        assert result.state == "done", result.error
        assert "no longer vouching for this node" in d.log("stuck")
    finally:
        d.close()


def test_a_nan_sleep_fails_its_job_and_leaves_timers_and_heartbeats_working(deployment: Deployment) -> None:
    deployment.start_node("n1")
    client = deployment.client
    (bad,) = client.submit("test", [{"sleep_s": {"run": math.nan}}], timeout_s=30)
    (bad_result,) = client.wait([bad], timeout_s=30)
    assert bad_result.state == "failed"
    assert bad_result.error is not None and bad_result.error["type"] == "InvalidTimer"
    assert "finite" in bad_result.error["message"]
    # Other jobs' timeouts still fire on time (in order), and the node stays alive through it.
    quick = client.submit("test", [{"sleep_s": {"run": 0.3}}] * 4, timeout_s=5)
    hung = client.submit("test", [{"hang_in": "run"}] * 2, timeout_s=0.5)
    results = client.wait(quick + hung, timeout_s=30)
    assert [r.state for r in results] == ["done"] * 4 + ["timed_out"] * 2
    assert all(n.alive for n in client.status().nodes)
    # The node said which sandbox runtime sandbox.runtime (auto, by default) picked.
    assert "sandbox runtime " in deployment.log("n1")


def test_an_instance_the_handler_cannot_use_fails_and_returns_its_credit(deployment: Deployment) -> None:
    deployment.start_node("n1", "--credit", "1", "--n-init", "1", "--n-run", "1", "--n-eval", "1")
    client = deployment.client
    bad = client.submit("test", [[1, 2, 3]] * 3, timeout_s=10)
    good = client.submit("test", [{"echo": "after"}], timeout_s=10)
    results = client.wait(bad + good, timeout_s=60)
    assert [r.state for r in results] == ["failed"] * 3 + ["done"]
    assert all("must be a map" in (r.error or {}).get("message", "") for r in results[:3])
    assert results[3].output["echo"] == "after"


def test_an_assignment_the_node_cannot_decode_comes_back_failed(deployment: Deployment) -> None:
    deployment.start_node("n1", "--credit", "1", "--n-init", "1", "--n-run", "1", "--n-eval", "1")
    raw = RawClient(deployment.address, deployment.deployment_dir)
    try:
        garbage = b"\xc1\xc1 not msgpack"
        reply = raw.request({"op": Op.SUBMIT.value, "jobs": [{"job_id": f"g{i}", "task": "test"} for i in range(2)]},
                            [garbage, garbage])
        if not reply["ok"]:
            # A broker that refuses non-msgpack instances at submit keeps them from the node altogether.
            assert "msgpack" in reply["error"]["message"]
        else:
            got = raw.results(2)
            assert {r.state for r in got.values()} == {"failed"}
            assert all(r.critical_error == "assign" and "msgpack" in (r.error or {})["message"] for r in got.values())
        # The node's only credit came back either way.
        done = raw.request({"op": Op.SUBMIT.value, "jobs": [{"job_id": "ok", "task": "test"}]},
                           [P.pack_obj({"echo": 1})])
        assert done["ok"]
        assert raw.results(1)["ok"].state == "done"
    finally:
        raw.close()


def test_results_echo_group_id_and_meta(deployment: Deployment) -> None:
    deployment.start_node("n1")
    raw = RawClient(deployment.address, deployment.deployment_dir)
    try:
        meta = {"prompt": 7, "split": "train"}
        reply = raw.request({"op": Op.SUBMIT.value,
                             "jobs": [{"job_id": "k1", "task": "test", "group_id": "g7", "meta": meta},
                                      {"job_id": "k2", "task": "test", "timeout_s": 0.3}]},
                            [P.pack_obj({"echo": 1}), P.pack_obj({"hang_in": "run"})])
        assert reply["ok"], reply
        got = raw.results(2)
        assert (got["k1"].state, got["k1"].group_id, got["k1"].meta) == ("done", "g7", meta)
        assert (got["k2"].state, got["k2"].group_id, got["k2"].meta) == ("timed_out", None, None)
    finally:
        raw.close()


@pytest.mark.parametrize("case", ["syntax", "import", "missing"])
def test_serve_node_refuses_a_broken_handler_file(tmp_path: Path, case: str) -> None:
    d = Deployment(tmp_path / "home", "broken")
    try:
        path = tmp_path / "bad_handler.py"
        if case == "syntax":
            path.write_text("import os\n\ndef broken(:\n    pass\n")
            where = f"{path}:3"
        elif case == "import":
            path.write_text("import os\n\n\nraise RuntimeError('boom at import')\n")
            where = f"{path}:4"
        else:
            where = str(path)
        proc = subprocess.run(
            [sys.executable, "-m", "prorl_cli", "-d", "broken", "serve", "node", "--handlers", str(path)],
            env=d.env(), capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode != 0
        assert where in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    finally:
        d.close()


def test_a_job_cancelled_in_the_turn_it_was_assigned_still_reports(tmp_path: Path) -> None:
    """The cancel lands before the job's task first runs: nothing ran, and the result still says cancelled."""
    import asyncio
    import contextlib

    from prorl_cli.config import ProrlConfig
    from prorl_cli.node.handler import Services
    from prorl_cli.node.pipeline import Pipeline
    from prorl_cli.node.registry import HandlerRegistry
    from prorl_cli.testing.handlers.testing import ScriptedTestHandler

    registry = HandlerRegistry()
    registry.add(ScriptedTestHandler, "prorl_cli/testing/handlers/testing.py")
    done: list[JobResult] = []
    stages: list[str] = []

    async def main() -> None:
        pipeline = Pipeline(ProrlConfig(), registry, Services(), "n1", tmp_path,
                            on_stage=lambda spec, stage: stages.append(stage), on_done=done.append)
        spec = P.JobSpec(job_id="early", task="test", group_id="g", meta={"k": 1})
        assert pipeline.start(spec, {"echo": 1})
        assert not pipeline.start(spec, {"echo": 1})  # a repeated delivery runs nothing twice
        task = pipeline.jobs["early"].task
        assert pipeline.cancel("early")
        with contextlib.suppress(asyncio.CancelledError):
            await task  # never began: cancel() answered for it at once
        assert pipeline.jobs == {}

    asyncio.run(main())
    assert stages == []
    assert [(r.job_id, r.state, r.group_id, r.meta) for r in done] == [("early", "cancelled", "g", {"k": 1})]
